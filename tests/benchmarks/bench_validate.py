"""Validation benchmarks (not tests): prints and saves JSON.

- fingerprint cost as a fraction of extraction wall time, in the same run (goal < 1%)
- validation wall time for the probe set (replay + alignment + reference acceptance)

    python tests/benchmarks/bench_validate.py
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from _results import save_result  # noqa: E402

from pipeline.data.stdlib import write_conversations  # noqa: E402
from pipeline.demo.tiny import make_tiny_target  # noqa: E402
from pipeline.extract.job import run_extract  # noqa: E402
from pipeline.train.job import run_train  # noqa: E402
from pipeline.validate.job import run_validate  # noqa: E402
from schemas.extract import ExtractConfig  # noqa: E402
from schemas.train import TrainConfig  # noqa: E402
from schemas.validation import ValidateConfig  # noqa: E402


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="strata-bench-validate-"))
    target = make_tiny_target(root / "target", num_layers=6, hidden_size=256)
    write_conversations(root / "conv.jsonl")
    probes = 16
    t0 = time.perf_counter()
    m = run_extract(
        ExtractConfig.model_validate(
            {
                "target": {"path": str(target)},
                "source": {"uri": str(root / "conv.jsonl")},
                "output": {"uri": str(root / "ds")},
                "max_length": 512,
                "engine": {"dtype": "float32", "device": "cpu"},
                "fingerprint": {"probe_samples": probes},
            }
        ),
        progress=False,
        use_ray=False,
    )
    extract_s = time.perf_counter() - t0
    run_train(
        TrainConfig.model_validate(
            {
                "dataset": str(root / "ds"),
                "target": {"path": str(target)},
                "output": str(root / "run"),
                "draft_vocab_size": 2048,
                "ttt_steps": 3,
                "batch_tokens": 2048,
                "max_steps": 10,
                "num_workers": 1,
                "eval_fraction": 0.05,
                "deepspeed": {"zero_stage": 2, "dtype": "float32"},
                "export": {"dtype": "float32"},
            }
        ),
        use_ray=False,
    )
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        r = run_validate(
            ValidateConfig.model_validate(
                {
                    "artifact": str(root / "run/export/vllm"),
                    "acceptance_prompts": 6,
                    "serving": {"engine": "vllm", "replay": "hf", "dtype": "float32", "target": {"path": str(target)}},
                }
            )
        )
        times.append(time.perf_counter() - t0)
    result = {
        "benchmark": "validate",
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "extraction": {
            "samples": m.totals.rows,
            "tokens": m.totals.tokens,
            "wall_s": extract_s,
            "fingerprint_s": m.fingerprints["seconds"],
            "probe_samples": probes,
            "fingerprint_fraction_of_extraction": m.fingerprints["seconds"] / extract_s,
        },
        "validation": {
            "probe_samples": probes,
            "acceptance_prompts": 6,
            "wall_s_best": min(times),
            "wall_s": times,
            "decision": r.decision,
            "reasons": r.reasons,
        },
    }
    save_result(result, "validate_tiny_cpu.json")


if __name__ == "__main__":
    main()
