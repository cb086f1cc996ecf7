"""Where benchmark results go: printed, and saved as JSON under ``results/`` (or ``out``).

Each file is stamped with the commit it measured (``+dirty`` when the tree had changes) and the
date, so a figure quoted elsewhere can say where it came from."""

from __future__ import annotations

import datetime
import json
import subprocess
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
REPO = Path(__file__).resolve().parents[2]


def provenance() -> dict:
    """The commit and date a result was measured at; ``commit: null`` outside a git checkout."""

    def git(*args: str) -> str | None:
        try:
            run = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return run.stdout.strip() if run.returncode == 0 else None

    commit = git("rev-parse", "--short=7", "HEAD")
    if commit and git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    return {"commit": commit, "date": datetime.date.today().isoformat()}


def save_result(result: dict, name: str, out: str | Path | None = None) -> Path:
    result = {**result, "measured_at": provenance()}
    print(json.dumps(result, indent=1))
    path = Path(out) if out else RESULTS / name
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(path)
    print(f"saved {path}")
    return path
