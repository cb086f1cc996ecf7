"""Training benchmarks (not tests): prints and saves JSON.

1. step: tokens/s of the DeepSpeed engine step (ZeRO-2, one process) / a plain-torch step
   (AdamW + grad clip) of the same draft on the same batches, in the same run (goal >= 0.9).
2. data: the real training loop (in-process, prefetching decoder) on an extracted dataset:
   fraction of step time spent waiting for data (goal < 5%).

    python tests/benchmarks/bench_train.py                                   # CPU, tiny shapes
    python tests/benchmarks/bench_train.py --shape llama-8b --device cuda    # GPU box (needs deepspeed)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from _results import save_result  # noqa: E402

from pipeline.draft.model import DraftConfig, Eagle3Draft, TargetBatch, init_weights  # noqa: E402

SHAPES = {
    # hidden, intermediate, heads, kv heads, vocab, draft vocab, seq
    "tiny": (256, 672, 4, 2, 2048, 2048, 512),
    "llama-8b": (4096, 14336, 32, 8, 128256, 32000, 2048),
}


def synthetic_batches(cfg: DraftConfig, n: int, seq: int, device, dtype) -> list[tuple]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        aux = torch.randn(1, seq, cfg.num_aux * cfg.target_hidden_size, generator=g).to(device, dtype)
        ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=g).to(device)
        p = torch.softmax(torch.randn(1, seq, cfg.draft_vocab_size, generator=g) * 3, -1).to(device)
        greedy = torch.randint(0, cfg.draft_vocab_size, (1, seq), generator=g).to(device)
        tb = TargetBatch(
            p_draft=p,
            greedy=greedy,
            in_draft_vocab=torch.ones(1, seq, dtype=torch.bool, device=device),
            trained=torch.ones(1, seq, dtype=torch.bool, device=device),
        )
        out.append((aux, ids, tb))
    return out


def make_model(cfg: DraftConfig, device, dtype) -> Eagle3Draft:
    m = Eagle3Draft(cfg)
    init_weights(m, seed=0)
    m.d2t.zero_()
    return m.to(device=device, dtype=dtype)


def plain_step(model: Eagle3Draft, opt: torch.optim.Optimizer, ttt: int):
    """One plain-torch training step of the draft (the baseline DeepSpeed is measured against)."""

    def step(aux, ids, tb):
        out = model(aux, ids, tb, steps=ttt)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()

    return step


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_steps(shape: str, device: torch.device, dtype: torch.dtype, steps: int, ttt: int) -> dict:
    import deepspeed

    h, inter, heads, kv, vocab, dvocab, seq = SHAPES[shape]
    cfg = DraftConfig(
        hidden_size=h,
        target_hidden_size=h,
        num_aux=3,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=h // heads,
        vocab_size=vocab,
        draft_vocab_size=dvocab,
    )
    batches = synthetic_batches(cfg, 2, seq, device, dtype)

    def run(step_fn) -> float:
        step_fn(*batches[0])  # warm-up
        sync(device)
        t0 = time.perf_counter()
        for i in range(steps):
            step_fn(*batches[i % len(batches)])
        sync(device)
        return steps * seq / (time.perf_counter() - t0)

    plain = make_model(cfg, device, dtype)
    opt = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=1e-4)
    plain_tps = run(plain_step(plain, opt, ttt))

    if not torch.distributed.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    model = make_model(cfg, device, torch.float32)
    ds_cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": 2},
        "bf16": {"enabled": dtype == torch.bfloat16},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4),
        config=ds_cfg,
    )

    def ds_step(aux, ids, tb):
        out = engine(aux, ids, tb, steps=ttt)
        engine.backward(out.loss)
        engine.step()

    ds_tps = run(ds_step)
    return {
        "shape": shape,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "seq_len": seq,
        "ttt_steps": ttt,
        "trainable_params": sum(p.numel() for p in engine.module.parameters() if p.requires_grad),
        "plain_torch_tok_s": plain_tps,
        "deepspeed_tok_s": ds_tps,
        "ratio_deepspeed_over_plain": ds_tps / plain_tps,
    }


def bench_data_wait(steps: int) -> dict:
    """The real loop (run_train, in-process) on a freshly extracted tiny dataset."""
    from pipeline.data.stdlib import write_conversations
    from pipeline.demo.tiny import make_tiny_target
    from pipeline.extract.job import run_extract
    from pipeline.train.job import run_train
    from schemas.extract import ExtractConfig
    from schemas.train import TrainConfig

    root = Path(tempfile.mkdtemp(prefix="strata-bench-train-"))
    target = make_tiny_target(root / "target", num_layers=6, hidden_size=256)
    write_conversations(root / "conv.jsonl", n=400)
    run_extract(
        ExtractConfig.model_validate(
            {
                "target": {"path": str(target)},
                "source": {"uri": str(root / "conv.jsonl")},
                "output": {"uri": str(root / "ds")},
                "max_length": 512,
                "engine": {"dtype": "float32", "device": "cpu"},
            }
        ),
        progress=False,
        use_ray=False,
    )
    cfg = TrainConfig.model_validate(
        {
            "dataset": str(root / "ds"),
            "target": {"path": str(target)},
            "output": str(root / "run"),
            "draft_vocab_size": 2048,
            "batch_tokens": 2048,
            "max_steps": steps,
            "metrics_every": steps,
            "checkpoint": {"every": 10**6},
            "num_workers": 1,
            "eval_fraction": 0.0,
            "deepspeed": {"zero_stage": 2, "dtype": "float32"},
            "resume": "none",
        }
    )
    m = run_train(cfg, use_ray=False)["metrics"]["train"]
    return {
        "steps": steps,
        "tokens_per_s": m["tokens_per_s"],
        "data_wait_fraction": m["data_wait_fraction"],
        "compute_fraction": m["compute_fraction"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--skip-data", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    result = {
        "benchmark": "train",
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
    }
    result["step"] = bench_steps(a.shape, device, dtype, a.steps, a.ttt)
    print(json.dumps({"step": result["step"]}, indent=1))
    if not a.skip_data:
        result["data"] = bench_data_wait(steps=30)
        print(json.dumps({"data": result["data"]}, indent=1))
    save_result(result, f"train_{a.shape}_{device.type}.json", a.out)


if __name__ == "__main__":
    main()
