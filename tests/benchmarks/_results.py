"""Where benchmark results go: printed, and saved as JSON under ``results/`` (or ``out``)."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def save_result(result: dict, name: str, out: str | Path | None = None) -> Path:
    print(json.dumps(result, indent=1))
    path = Path(out) if out else RESULTS / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"saved {path}")
    return path
