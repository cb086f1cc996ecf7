"""The demo's probe chapter, measured (not a test): prints and saves JSON.

`strata demo` ends by handing its draft over without Strata's files, the incident's ids in its config,
and probing it on the demo's regenerated conversations. This runs that chapter (the same function) on a
finished demo directory for the demo's own draft and for the same training config run longer, at
several prompt counts (and for that draft with random-init weights): the probe's verdict, best set, margins, what a tie leaves open, and how that
compares with the set the draft was trained on (the manifest the probe never sees).

    .venv/bin/strata demo                       # once: builds strata-demo/
    python tests/benchmarks/bench_demo_probe.py --demo strata-demo --epochs 0 8 32 --prompts 32 300 800
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from _results import save_result  # noqa: E402
from bench_probe import random_init_copy  # noqa: E402

from pipeline import conventions  # noqa: E402
from pipeline.demo.story import against_training, chapter_probe, trained_points  # noqa: E402
from pipeline.identity import target_identity  # noqa: E402
from pipeline.train.job import run_train  # noqa: E402
from schemas.config import load_config  # noqa: E402
from schemas.train import TrainConfig  # noqa: E402


def _draft(demo: Path, epochs: int) -> Path:
    """The demo's exported vLLM draft, or (another epoch count) the demo's training config run that long;
    0: the demo's draft with random-init weights (its manifest kept, for the comparison)."""
    cfg = load_config(demo / "train.yaml", TrainConfig)
    if epochs == cfg.epochs:
        return demo / "run" / "export" / "vllm"
    if epochs == 0:
        return random_init_copy(demo / "run" / "export" / "vllm", demo / "run-e0" / "export" / "vllm", demo / "target")
    run = demo / f"run-e{epochs}"
    if not (run / "export" / "vllm").exists():
        shutil.rmtree(run, ignore_errors=True)
        update = {"epochs": epochs, "output": str(run), "heldout_acceptance": {"prompts": 0}}
        run_train(cfg.model_validate({**cfg.model_dump(), **update}), use_ray=False)
    return run / "export" / "vllm"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--demo", type=Path, default=Path("strata-demo"), help="a directory `strata demo` finished in")
    ap.add_argument("--epochs", type=int, nargs="+", default=[0, 8, 32], help="0: the demo's draft, random-init")
    ap.add_argument("--prompts", type=int, nargs="+", default=[32, 300, 800])
    ap.add_argument("--out")
    args = ap.parse_args()
    demo = args.demo.resolve()
    bad = demo / "misconfigured-config.json"
    if not bad.exists():
        sys.exit(f"{demo}: no misconfigured-config.json -- run `strata demo` there first")
    n = target_identity(demo / "target").num_layers
    ids, _ = conventions.ids_in_draft_config(json.loads(bad.read_text()), "vllm")
    fed = conventions.points_read_from(ids, "vllm", n)  # what vLLM feeds under the incident's config
    rows = []
    for epochs in args.epochs:
        art = _draft(demo, epochs)
        for prompts in args.prompts:
            lines: list[str] = []
            t = time.perf_counter()
            r = chapter_probe(
                demo, art, bad, fed, lines.append, demo / "regenerated" / "conversations.jsonl", {"prompts": prompts}
            )
            row = {
                "draft_epochs": epochs,
                "prompts_asked": prompts,
                "prompts": r.prompts,
                "positions": r.positions,
                "verdict": r.verdict,
                "best": r.best.boundaries,
                "runner_up": r.runner_up.boundaries,
                "margin": r.margin,
                "margin_se": r.margin_se,
                "min_margin": r.min_margin,
                "over_frequencies": r.over_frequencies,
                "over_frequencies_se": r.over_frequencies_se,
                "slots": r.slots,
                "admissible": r.admissible,
                "against_training": against_training(r, trained_points(art)),
                "chapter": lines,
                "chapter_s": round(time.perf_counter() - t, 1),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    save_result(
        {
            "benchmark": "the demo's probe chapter: the incident's draft without Strata's files",
            "machine": platform.machine(),
            "demo": str(demo),
            "incident_fed": [conventions.boundary_label(p, n) for p in fed],
            "rows": rows,
        },
        "probe_demo_tiny_cpu.json",
        args.out,
    )


if __name__ == "__main__":
    main()
