"""Training's reads from a dataset (not a test): a row group per sample, as shards are written,
against a row group per forward batch, as they were written before -- the same samples, the
same training plan, the training job's own ``load_batch``.

Parquet reads whole column chunks, so a batch that needs one sample of a row group reads all of
it. Extraction packs many samples into one forward (``engine.batch_tokens``), and training draws
a batch's samples from all over the dataset (length-bucketed, shuffled): with a row group per
forward, every training batch reads about one forward batch per sample it needs.

One mid-shape dataset (hidden 1024, 8 layers, bf16, the stdlib conversations) is extracted once
(cached under ``--work``); its shards are rewritten in both layouts by the same Parquet writer
settings (the baseline grouped as extraction packs forwards: consecutive samples up to
``--forward-tokens``). Measured per layout, alternated ``--repeats`` times: the bytes of the column
chunks an epoch's ``load_batch`` calls read (from the footers: what a disk or S3 would serve),
the epoch's wall time (from the page cache here, so it understates a disk's cost), the shards'
footer bytes, and the rewrite's wall time with fsync.

    python tests/benchmarks/bench_reads.py
    python tests/benchmarks/bench_reads.py --conversations 60 --repeats 1 --out reads.json   # smoke
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

from _results import save_result  # noqa: E402
from bench_extract import build_target  # noqa: E402
from bench_train_job import dataset  # noqa: E402

from pipeline.store.reader import DatasetReader, index_samples  # noqa: E402
from pipeline.store.writer import parquet_options  # noqa: E402
from pipeline.train.data import load_batch  # noqa: E402
from pipeline.train.plan import plan_epoch  # noqa: E402


def rewrite(src: Path, dst: Path, forward_tokens: int | None) -> float:
    """``src``'s dataset with each shard's row groups regrouped: one per sample (``None``) or
    consecutive samples up to ``forward_tokens`` tokens; returns the writes' wall time (fsync'd)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.parquet"))
    seconds = 0.0
    for f in sorted(src.rglob("*.parquet")):
        table = pq.read_table(f)
        groups, start, tokens = [], 0, 0
        for i, n in enumerate(table["num_tokens"].to_pylist()):
            if forward_tokens is None or (i > start and tokens + n > forward_tokens):
                if i > start:
                    groups.append((start, i - start))
                start, tokens = i, 0
            tokens += n
        groups.append((start, table.num_rows - start))
        out = dst / f.relative_to(src)
        t0 = time.perf_counter()
        with open(out, "wb") as sink:
            w = pq.ParquetWriter(sink, table.schema, **parquet_options(table.schema))  # the store's settings
            for s, n in groups:
                w.write_table(table.slice(s, n), row_group_size=n)
            w.close()
            sink.flush()
            os.fsync(sink.fileno())
        seconds += time.perf_counter() - t0
    return seconds


def epoch(uri: Path, batch_tokens: int) -> dict:
    """One epoch of the training plan through ``load_batch``: bytes of the column chunks read, wall time."""
    reader = DatasetReader(str(uri), verify_checksums=False)
    refs = index_samples(reader)
    plan = plan_epoch(refs, batch_tokens, 1, seed=0, epoch=0, packed=True)
    points = reader.points
    aux, final = points[:-1], points[-1]
    chunk: dict[tuple[str, int], int] = {}
    footer = 0
    for shard in reader.shards:
        md = pq.ParquetFile(uri / shard.path).metadata
        footer += md.serialized_size
        for rg in range(md.num_row_groups):
            g = md.row_group(rg)
            chunk[(shard.path, rg)] = sum(g.column(c).total_compressed_size for c in range(g.num_columns))
    read, used = 0, 0
    t0 = time.perf_counter()
    for step in plan:
        batch = [refs[j] for j in step[0]]
        load_batch(reader, batch, aux, final, packed=True)
        read += sum(chunk[g] for g in {(r.shard, r.row_group) for r in batch})
        used += len(batch)
    return {
        "wall_s": time.perf_counter() - t0,
        "bytes_read": read,
        "samples": used,
        "batches": len(plan),
        "row_groups": len(chunk),
        "footer_bytes": footer,
        "sample_ids": [r.sample_id for step in plan for r in (refs[j] for j in step[0])],
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=800)
    ap.add_argument("--batch-tokens", type=int, default=2048, help="training batch (the train-job benchmark's)")
    ap.add_argument("--forward-tokens", type=int, default=16384, help="extraction's engine.batch_tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", default=None, help="directory for the target and dataset (cached)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    work = Path(args.work or Path(tempfile.gettempdir()) / "strata-bench-reads")
    work.mkdir(parents=True, exist_ok=True)
    src = dataset(build_target("mid", work), work, args.conversations)
    layouts = {"per_forward": args.forward_tokens, "per_sample": None}
    runs: dict[str, list[dict]] = {k: [] for k in layouts}
    with tempfile.TemporaryDirectory(prefix="strata-bench-reads-", dir=work) as tmp:
        for rep in range(args.repeats):  # alternated: rewrite, then read, each layout in turn
            for name, tokens in layouts.items():
                dst = Path(tmp) / f"{name}-{rep}"
                write_s = rewrite(src, dst, tokens)
                r = epoch(dst, args.batch_tokens)
                r["write_s"] = write_s
                runs[name].append(r)
                shutil.rmtree(dst)
                print(f"{name}: {r['bytes_read'] / 1e6:.0f} MB read in {r['wall_s']:.2f} s, written in {write_s:.2f} s")
    a, b = runs["per_forward"][0], runs["per_sample"][0]
    assert a.pop("sample_ids") == b.pop("sample_ids"), "the two layouts must give the same plan"
    for rs in runs.values():
        for r in rs:
            r.pop("sample_ids", None)
    med = {k: {m: statistics.median(r[m] for r in rs) for m in ("wall_s", "write_s")} for k, rs in runs.items()}
    result = {
        "benchmark": "reads",
        "cpu_count": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "shape": "mid",
        "conversations": args.conversations,
        "batch_tokens": args.batch_tokens,
        "forward_tokens": args.forward_tokens,
        "runs": runs,
        "median": med,
        "bytes_read_per_sample_over_per_forward": b["bytes_read"] / a["bytes_read"],
        "epoch_wall_per_sample_over_per_forward": med["per_sample"]["wall_s"] / med["per_forward"]["wall_s"],
        "write_wall_per_sample_over_per_forward": med["per_sample"]["write_s"] / med["per_forward"]["write_s"],
        "footer_bytes_per_sample_over_per_forward": b["footer_bytes"] / a["footer_bytes"],
    }
    save_result(result, "reads_mid_cpu.json", args.out)
    return result


if __name__ == "__main__":
    main()
