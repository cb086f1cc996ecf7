"""Calibrating the gate's acceptance comparison (not a test): prints and saves JSON.

For targets of different kinds and depths -- random-init (like the unit tests'), the demo's
pretrained 12-layer target, a random 61-layer one (the depth of the false block that started
this) -- a draft is trained with its held-out acceptance recorded, then validated in its
correct configuration across serving dtypes (float32, bfloat16) and prompt sets (2 or 6
prompts, 16 or 32 new tokens), and once with every slot shifted by one (a misconfiguration,
for contrast). Per case: the acceptance measured at validation, the held-out acceptance
from training, the standard error of their difference, and

    b_max = (measured + z * SE) / heldout

the largest ``tolerances.acceptance_vs_heldout`` under which the case still passes. The
default bound is chosen below the smallest b_max of any correct case, with margin; the
teacher-forced prediction's ratio is recorded too (why it is reported, not gated).

    python tests/benchmarks/calibrate_acceptance.py      # ~15 min on two cores
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from _results import save_result  # noqa: E402

from pipeline.conventions import default_aux_points, draft_config_feeding, shifted  # noqa: E402
from pipeline.data.stdlib import write_conversations  # noqa: E402
from pipeline.demo.pretrain import PretrainRecipe, trained_tiny_target  # noqa: E402
from pipeline.demo.tiny import make_tiny_target  # noqa: E402
from pipeline.extract.job import run_extract  # noqa: E402
from pipeline.train.job import run_train  # noqa: E402
from pipeline.validate.job import run_validate  # noqa: E402
from schemas.artifact import ARTIFACT_MANIFEST, DraftArtifactManifest  # noqa: E402
from schemas.extract import ExtractConfig  # noqa: E402
from schemas.train import TrainConfig  # noqa: E402
from schemas.validation import Tolerances, ValidateConfig  # noqa: E402

Z = Tolerances().acceptance_z
TARGETS = {
    "random 6x256 (unit tests' kind)": lambda d: make_tiny_target(d, num_layers=6, hidden_size=256, seed=0),
    "random 61x64 (the false block's depth)": lambda d: make_tiny_target(d, num_layers=61, hidden_size=64, seed=1),
    "pretrained 12x128 (the demo's)": lambda d: trained_tiny_target(d, PretrainRecipe()),
}
PROMPT_SETS = [(2, 16), (6, 16), (6, 32)]


def train_draft(name: str, root: Path) -> tuple[Path, Path, int]:
    target = TARGETS[name](root / "target")
    n = json.loads((target / "config.json").read_text())["num_hidden_layers"]
    aux = default_aux_points("vllm", n)
    write_conversations(root / "conv.jsonl", n=240)
    run_extract(
        ExtractConfig.model_validate(
            {
                "target": {"path": str(target)},
                "source": {"uri": str(root / "conv.jsonl")},
                "output": {"uri": str(root / "ds")},
                "capture": [*(str(p) for p in aux), "final:post_norm"],
                "max_length": 256,
                "engine": {"dtype": "float32", "device": "cpu"},
                "fingerprint": {"probe_samples": 8},
            }
        ),
        progress=False,
        use_ray=False,
    )
    run_train(
        TrainConfig.model_validate(
            {
                "dataset": str(root / "ds"),
                "target": {"path": str(target)},
                "output": str(root / "run"),
                "draft_vocab_size": 2048,
                "ttt_steps": 3,
                "batch_tokens": 2048,
                "epochs": 6,
                "num_workers": 1,
                "optim": {"lr": 1e-2, "warmup_steps": 10},
                "deepspeed": {"zero_stage": 2, "dtype": "float32"},
                "export": {"dtype": "float32", "engines": ["vllm"]},
                "heldout_acceptance": {"prompts": 8},
            }
        ),
        use_ray=False,
    )
    return target, root / "run" / "export" / "vllm", n


def case(art: Path, target: Path, dtype: str, prompts: int, new_tokens: int, draft_config: Path | None) -> dict:
    serving = {"engine": "vllm", "replay": "hf", "dtype": dtype, "target": {"path": str(target)}}
    if draft_config:
        serving["draft_config"] = str(draft_config)
    r = run_validate(
        ValidateConfig.model_validate(
            {"artifact": str(art), "acceptance_prompts": prompts, "max_new_tokens": new_tokens, "serving": serving}
        )
    )
    a = r.acceptance
    vs = a.vs_heldout.model_dump() if a.vs_heldout else {}
    m = a.measured
    row = {
        "dtype": dtype,
        "prompts": prompts,
        "max_new_tokens": new_tokens,
        "decision": r.decision,
        "reasons": r.reasons,
        "measured": vs.get("measured"),
        "heldout": vs.get("heldout"),
        "se": vs.get("se"),
        "gated": vs.get("gated"),
        "verify_steps": m.verify_steps if m else None,
        "predicted_teacher_forced": a.predicted_accepted_per_step,
    }
    if vs.get("heldout"):
        row["b_max"] = (vs["measured"] + Z * vs["se"]) / vs["heldout"]
        row["ratio"] = vs["measured"] / vs["heldout"]
    if a.predicted_accepted_per_step and m:
        row["ratio_to_teacher_forced"] = m.accepted_per_step / a.predicted_accepted_per_step
    return row


def main() -> None:
    result: dict = {
        "benchmark": "calibrate_acceptance",
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "z": Z,
        "targets": {},
    }
    for name in TARGETS:
        t0 = time.perf_counter()
        root = Path(tempfile.mkdtemp(prefix="strata-calibrate-"))
        target, art, n = train_draft(name, root)
        manifest = DraftArtifactManifest.model_validate_json((art / ARTIFACT_MANIFEST).read_text())
        trained = manifest.aux_capture_points
        shifted_cfg = draft_config_feeding(
            json.loads((art / "config.json").read_text()), shifted(trained, 1, n), "vllm", n
        )
        (root / "shifted.json").write_text(json.dumps(shifted_cfg))
        rows = [
            {"config": "correct", **case(art, target, dtype, p, t, None)}
            for dtype in ("float32", "bfloat16")
            for p, t in PROMPT_SETS
        ]
        rows.append({"config": "every slot shifted +1", **case(art, target, "float32", 6, 16, root / "shifted.json")})
        result["targets"][name] = {
            "layers": n,
            "heldout_at_training": manifest.metrics.get("heldout_acceptance"),
            "eval_acc_per_pos": (manifest.metrics.get("eval") or {}).get("acc_per_pos"),
            "cases": rows,
            "seconds": round(time.perf_counter() - t0, 1),
        }
        print(json.dumps({name: rows}, indent=1))
    correct = [r for t in result["targets"].values() for r in t["cases"] if r["config"] == "correct"]
    b = [r["b_max"] for r in correct if r.get("b_max") is not None and r["gated"] is not False]
    tf = [r["ratio_to_teacher_forced"] for r in correct if r.get("ratio_to_teacher_forced") is not None]
    result["summary"] = {
        "correct_cases": len(correct),
        "correct_blocked": sum(r["decision"] != "pass" for r in correct),
        "min_b_max_correct": min(b) if b else None,
        "suggested_bound": math.floor(min(b) * 0.8 * 20) / 20 if b else None,
        "default_bound": Tolerances().acceptance_vs_heldout,
        "teacher_forced_ratio_range": [min(tf), max(tf)] if tf else None,
    }
    save_result(result, "calibrate_acceptance_tiny_cpu.json")


if __name__ == "__main__":
    main()
