"""Engine benchmarks (not tests): prints and saves JSON.

- capture throughput, vLLM (extract_hidden_states + Strata's connector) vs the HF engine
  (forward hooks), same target, same samples, same batches, same run: tok/s and the ratio
- the whole extraction job with each engine (tokenize + capture + encode + write)
- a Strata-trained draft served by vLLM with EAGLE-3: vLLM's own acceptance counters next
  to the reference implementation's on the same prompts, and losslessness

    python tests/benchmarks/bench_engines.py            # tiny target on this CPU
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
from pipeline.engines.hf import HFEngine  # noqa: E402
from pipeline.engines.packing import pack_by_tokens  # noqa: E402
from pipeline.engines.vllm import engine as vllm_engine  # noqa: E402
from pipeline.extract.job import run_extract  # noqa: E402
from pipeline.store.reader import DatasetReader  # noqa: E402
from pipeline.train.job import run_train  # noqa: E402
from pipeline.validate.job import run_validate  # noqa: E402
from schemas.capture import parse_points  # noqa: E402
from schemas.extract import ExtractConfig  # noqa: E402
from schemas.train import TrainConfig  # noqa: E402
from schemas.validation import ValidateConfig  # noqa: E402

POINTS = ["layer_output:1", "layer_output:2", "layer_output:3", "final:pre_norm"]


def timed_capture(engine, batches: list[list[list[int]]], repeats: int = 3) -> float:
    engine.capture(batches[0])  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for b in batches:
            engine.capture(b)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="strata-bench-engines-"))
    target = make_tiny_target(root / "target", num_layers=6, hidden_size=256)
    write_conversations(root / "conv.jsonl")
    base = {
        "target": {"path": str(target)},
        "source": {"uri": str(root / "conv.jsonl")},
        "capture": POINTS,
        "max_length": 512,
        "fingerprint": {"probe_samples": 16},
    }
    jobs = {}
    for name in ("hf", "vllm"):
        t0 = time.perf_counter()
        m = run_extract(
            ExtractConfig.model_validate(
                {
                    **base,
                    "output": {"uri": str(root / f"ds-{name}")},
                    "engine": {"name": name, "dtype": "float32", "device": "cpu", "max_model_len": 1024},
                }
            ),
            progress=False,
            use_ray=False,
        )
        wall = time.perf_counter() - t0
        jobs[name] = {
            "wall_s_incl_engine_start": wall,
            "tokens": m.totals.tokens,
            "rows": m.totals.rows,
            "tok_per_s_incl_engine_start": m.totals.tokens / wall,
        }

    seqs = [s.input_ids.tolist() for s in DatasetReader(str(root / "ds-hf")).iter_samples()]
    tokens = sum(len(s) for s in seqs)
    batches = [[seqs[i] for i in b] for b in pack_by_tokens([len(s) for s in seqs], 4096)]
    points = parse_points(POINTS)
    hf = HFEngine(target, points, "float32", "cpu", batch_tokens=4096)
    hf_s = timed_capture(hf, batches)
    hf.close()
    t0 = time.perf_counter()
    vl = vllm_engine.VLLMEngine(target, points, "float32", max_model_len=1024, batch_tokens=4096)
    start_s = time.perf_counter() - t0
    vl_s = timed_capture(vl, batches)
    vl.close()

    run_train(
        TrainConfig.model_validate(
            {
                "dataset": str(root / "ds-hf"),
                "target": {"path": str(target)},
                "output": str(root / "run"),
                "draft_vocab_size": 4096,
                "ttt_steps": 3,
                "batch_tokens": 2048,
                "epochs": 3,
                "num_workers": 1,
                "eval_fraction": 0.05,
                "optim": {"lr": 3e-3, "warmup_steps": 2},
                "deepspeed": {"zero_stage": 2, "dtype": "float32"},
                "export": {"dtype": "float32"},
            }
        ),
        use_ray=False,
    )
    r = run_validate(
        ValidateConfig.model_validate(
            {
                "artifact": str(root / "run/export/vllm"),
                "acceptance_prompts": 16,
                "max_new_tokens": 32,
                "speculative_tokens": 3,
                "serving": {
                    "engine": "vllm",
                    "replay": "engine",
                    "dtype": "float32",
                    "max_model_len": 1024,
                    "target": {"path": str(target)},
                },
            }
        )
    )
    vllm_engine.close_all()
    acc = r.acceptance
    result = {
        "benchmark": "engines",
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "vllm": vllm_engine.vllm_version(),
        "target": {"layers": 6, "hidden": 256, "dtype": "float32"},
        "capture": {
            "samples": len(seqs),
            "tokens": tokens,
            "batches": len(batches),
            "points": POINTS,
            "hf_tok_per_s": tokens / hf_s,
            "vllm_tok_per_s": tokens / vl_s,
            "vllm_over_hf": hf_s / vl_s,
            "vllm_engine_start_s": start_s,
        },
        "extraction_job": jobs,
        "acceptance": {
            "decision": r.decision,
            "reasons": r.reasons,
            "k": acc.measured.k if acc.measured else None,
            "vllm": acc.served.model_dump(
                include={"mean_acceptance_length", "acceptance_per_pos", "verify_steps", "draft_tokens", "lossless"}
            )
            if acc.served
            else None,
            "reference": acc.reference.model_dump(
                include={"mean_acceptance_length", "acceptance_per_pos", "verify_steps", "lossless"}
            )
            if acc.reference
            else None,
        },
    }
    save_result(result, "engines_tiny_cpu.json")


if __name__ == "__main__":
    main()
