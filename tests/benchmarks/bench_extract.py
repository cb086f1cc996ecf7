"""Extraction benchmarks (not tests): prints and saves JSON; ratios against baselines run
in the same process, never absolute-seconds assertions.

1. writer: byte_planes_v1 writer GB/s per core and size vs raw bf16, on 4096-wide bf16
   activations, against the plain baseline (one FLBA(2H) value per token, zstd-1).
2. end-to-end: extraction tok/s (capture + encode + write + fsync + publish) / bare
   forward tok/s, same model, same batches.

    python tests/benchmarks/bench_extract.py                       # CPU, tiny target
    python tests/benchmarks/bench_extract.py --shape llama-8b --device cuda   # on a GPU box

Runs without Ray (compute code imports without it).
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

import pyarrow as pa
import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from _results import save_result  # noqa: E402

from pipeline.store.encoding import split_planes  # noqa: E402
from pipeline.store.fs import resolve  # noqa: E402
from pipeline.store.writer import SampleMeta, ShardWriter, _HashingFile  # noqa: E402
from schemas.capture import CapturePoint  # noqa: E402
from schemas.dataset import dataset_schema  # noqa: E402
from schemas.provenance import EngineRef, TensorProvenance  # noqa: E402

SHAPES = {
    "tiny": dict(
        num_hidden_layers=6,
        hidden_size=256,
        intermediate_size=672,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=2048,
    ),
    "mid": dict(
        num_hidden_layers=8,
        hidden_size=1024,
        intermediate_size=2816,
        num_attention_heads=16,
        num_key_value_heads=8,
        vocab_size=32000,
    ),
    "llama-8b": dict(
        num_hidden_layers=32,
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
}


def activations(tokens: int, hidden: int, seed: int = 0) -> torch.Tensor:
    """bf16 with per-channel scales and a few massive channels, like real residual streams."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(hidden, generator=g) * 0.7)
    scale[torch.randperm(hidden, generator=g)[:4]] *= 50
    return (torch.randn(tokens, hidden, generator=g) * scale).to(torch.bfloat16)


def prov(point: CapturePoint, hidden: int, dtype: str = "bfloat16") -> TensorProvenance:
    return TensorProvenance(
        capture_point=point,
        boundary="r_?",
        dtype=dtype,
        hidden_size=hidden,
        encoding="byte_planes_v1",
        engine=EngineRef(name="hf", version="bench", native_id=None, native_id_convention="none"),
        target_model="bench",
        target_key="bench",
    )


def bench_writer(hidden: int = 4096, samples: int = 8, seq: int = 1024, repeats: int = 3) -> dict:
    x = activations(samples * seq, hidden)
    raw_bytes = x.numel() * 2
    point = CapturePoint.layer_output(1)
    schema = dataset_schema([prov(point, hidden)], "{}", "{}", {})
    metas = [SampleMeta(f"s{i}", "bench", i, "c", [0] * seq, [1] * seq) for i in range(samples)]
    planes = split_planes(x).numpy()
    tmp = Path(tempfile.mkdtemp(prefix="strata-bench-"))

    def ours(pre_split: bool) -> tuple[float, float, int]:
        t0, c0 = time.perf_counter(), time.process_time()
        p = planes if pre_split else split_planes(x).numpy()
        fs, path = resolve(str(tmp / "ours.parquet"))
        w = ShardWriter(fs, path, schema)
        w.write(metas, [seq] * samples, {str(point): p})
        nbytes, _ = w.commit()
        return time.perf_counter() - t0, time.process_time() - c0, nbytes

    def baseline() -> tuple[float, float, int]:
        """Plain encoding, same durability (hashed while written, fsync, rename)."""
        t0, c0 = time.perf_counter(), time.process_time()
        flat = x.view(torch.uint8).numpy().reshape(samples * seq, 2 * hidden)
        arr = pa.FixedSizeBinaryArray.from_buffers(pa.binary(2 * hidden), samples * seq, [None, pa.py_buffer(flat)])
        sink = _HashingFile(str(tmp / "base.tmp"))
        pq.write_table(
            pa.table({"x": arr}),
            pa.PythonFile(sink, mode="w"),
            compression="zstd",
            compression_level=1,
            use_dictionary=False,
            write_statistics=False,
        )
        sink.close()
        os.replace(tmp / "base.tmp", tmp / "base.parquet")
        return time.perf_counter() - t0, time.process_time() - c0, sink.size

    def best(fn, *a):
        runs = [fn(*a) for _ in range(repeats)]
        return min(runs, key=lambda r: r[0])

    ours_gpu_path, ours_cpu_path, base = best(ours, True), best(ours, False), best(baseline)
    out = {
        "hidden": hidden,
        "tokens": samples * seq,
        "raw_bf16_bytes": raw_bytes,
        "ours_planes_given": {  # the GPU path: the byte split happens on the device before the copy
            "GBps": raw_bytes / ours_gpu_path[0] / 1e9,
            "GBps_per_cpu_second": raw_bytes / ours_gpu_path[1] / 1e9,
            "size_ratio": ours_gpu_path[2] / raw_bytes,
        },
        "ours_with_cpu_split": {
            "GBps": raw_bytes / ours_cpu_path[0] / 1e9,
            "GBps_per_cpu_second": raw_bytes / ours_cpu_path[1] / 1e9,
            "size_ratio": ours_cpu_path[2] / raw_bytes,
        },
        "baseline_flba_zstd1": {
            "GBps": raw_bytes / base[0] / 1e9,
            "GBps_per_cpu_second": raw_bytes / base[1] / 1e9,
            "size_ratio": base[2] / raw_bytes,
        },
        "note": "single writer thread; both include Parquet, SHA-256 while writing, fsync and rename. "
        "GBps_per_cpu_second excludes time blocked on the disk (fsync).",
    }
    out["speedup_vs_baseline_wall"] = out["ours_planes_given"]["GBps"] / out["baseline_flba_zstd1"]["GBps"]
    out["speedup_vs_baseline_cpu"] = (
        out["ours_planes_given"]["GBps_per_cpu_second"] / out["baseline_flba_zstd1"]["GBps_per_cpu_second"]
    )
    return out


def build_target(shape: str, root: Path) -> Path:
    """Random-weight target of a named shape, saved locally (nothing downloaded); a target
    already built under ``root`` is reused."""
    out = root / shape
    if (out / "config.json").exists():
        return out
    if shape == "tiny":
        from pipeline.demo.tiny import make_tiny_target

        return make_tiny_target(out, num_layers=6, hidden_size=256)
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.demo.tiny import train_tokenizer

    tok = train_tokenizer(2048)
    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=8192, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    tmp = root / f".{shape}.tmp"
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def bench_end_to_end(shape: str, device: str, dtype: str, samples: int, seq: int, repeats: int) -> dict:
    from pipeline.engines.hf import HFEngine
    from pipeline.extract.job import build_schema
    from pipeline.extract.worker import TokenizedUnit, UnitWriter
    from pipeline.identity import target_identity
    from schemas.extract import ExtractConfig

    root = Path(tempfile.mkdtemp(prefix="strata-bench-e2e-"))
    target = build_target(shape, root)
    ident = target_identity(target)
    n = ident.num_layers
    # The EAGLE-3 default aux layers (de-duplicated: they collapse for small N) + final post-norm.
    points = [f"layer_output:{j}" for j in sorted({1, n // 2 - 1, n - 4})] + ["final:post_norm"]
    cfg = ExtractConfig.model_validate(
        {
            "target": {"path": str(target)},
            "source": {"uri": "bench.jsonl"},
            "output": {"uri": str(root / "ds")},
            "capture": points,
            "engine": {"dtype": dtype, "device": device, "batch_tokens": samples * seq},
        }
    )
    schema, _ = build_schema(cfg, ident)
    engine = HFEngine(target, cfg.capture, dtype, device, "sdpa", samples * seq)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(10, ident.vocab_size, (seq,), generator=g).tolist() for _ in range(samples)]
    unit = TokenizedUnit(
        0, 0, samples, [SampleMeta(f"s{i}", "bench", i, "c", s, [1] * seq) for i, s in enumerate(seqs)]
    )
    writer = UnitWriter(cfg, schema, engine, compress_threads=max(1, min(8, (os.cpu_count() or 2) - 1)))
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)

    engine.forward(seqs)  # warm-up
    sync()
    bare = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.forward(seqs)
        sync()
        bare.append(time.perf_counter() - t0)
    e2e = []
    for r in range(repeats):
        unit.unit = r
        t0 = time.perf_counter()
        rec = writer.process(unit)  # capture, encode, write, fsync, publish, commit record
        e2e.append(time.perf_counter() - t0)
    tokens = samples * seq
    bare_tps, e2e_tps = tokens / min(bare), tokens / min(e2e)
    return {
        "shape": shape,
        "device": str(engine.device),
        "dtype": dtype,
        "samples": samples,
        "seq_len": seq,
        "capture_points": points,
        "bare_forward_tok_s": bare_tps,
        "extraction_tok_s": e2e_tps,
        "ratio_extraction_over_bare": e2e_tps / bare_tps,
        "shard_bytes": rec.bytes,
        "bytes_per_token": rec.bytes / tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on GPU")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq", type=int, default=None, help="default: 512 on CPU, 2048 on GPU")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-writer", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    gpu = a.device.startswith("cuda")
    dtype = a.dtype or ("bfloat16" if gpu else "float32")
    seq = a.seq or (2048 if gpu else 512)
    result = {
        "benchmark": "extract",
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if gpu else None,
        "torch_threads": torch.get_num_threads(),
    }
    if not a.skip_writer:
        result["writer"] = bench_writer(repeats=a.repeats)
        print(json.dumps({"writer": result["writer"]}, indent=1))
    result["end_to_end"] = bench_end_to_end(a.shape, a.device, dtype, a.samples, seq, a.repeats)
    print(json.dumps({"end_to_end": result["end_to_end"]}, indent=1))
    save_result(result, f"extract_{a.shape}_{'gpu' if gpu else 'cpu'}.json", a.out)


if __name__ == "__main__":
    main()
