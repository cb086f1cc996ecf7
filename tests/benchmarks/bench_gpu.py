"""The GPU box benchmark (not a test): needs only torch, transformers and pyarrow -- GPU boxes
may lack Ray, DeepSpeed, vLLM, zstandard and pydantic, and have no network. Prints and saves
JSON; every figure is a ratio against a baseline measured in the same run.

1. extraction: a random-init Llama of the given shape over conversations of realistic,
   variable lengths, packed end to end into token-budget batches as the HF engine runs them
   (``pipeline.engines.packing``: no padding). Baseline: the bare packed forward. Measured: the same
   forward with hooks on the EAGLE-3 aux boundaries and the final norm, the tokens split
   into byte planes on the device, one pinned device-to-host copy
   per batch, and ``writers`` threads writing byte-plane Parquet shards (exponent plane zstd,
   mantissa planes raw, as Strata's byte_planes_v1) with fsync, overlapped with the next
   forward. Goal on an H200 at the 8B shape: capture >= 0.90 of the bare forward.
2. draft step: Strata's EAGLE-3 draft (``pipeline.draft.model``, torch only) trained in plain
   torch with the TTT unroll of ``--ttt`` steps, against one unrolled step (the TTT cost).
3. packing: the draft trained (plain torch, ``--ttt`` steps) on an epoch's first ``--steps``
   batches as training plans them (``pipeline.train.plan.plan_epoch``: length-bucketed, filled up
   to the shape's training batch_tokens), its sequences packed end to end against padded to rows:
   real tokens/s, alternated ``--repeats`` times. Two length distributions: the demo's
   conversations as its tokenizer and chat template count them (cut at its max_length 512), and
   chat-like lognormal lengths.
4. stream: the compute half of streaming vs extract-then-train on one device, ``--epochs`` over
   the same conversations in the same packed training batches (``plan_epoch``). Streamed: each
   batch's target forward with hooks on the aux boundaries and the final norm, its states
   through host memory (one pinned copy each way, the hop Ray's object store makes) into the
   draft's training step, captured again every epoch. Extract-then-train: the target forward
   over token-budget batches, byte-plane Parquet shards written by ``writers`` threads (as in 1),
   then each epoch reads every batch's samples back from them (a row group per sample, as the
   store writes them, each read once for its batch as the training job's ``load_batch`` does),
   reassembles the bytes and trains.
   Measured: wall time per phase, bytes written, peak device memory and peak host RSS per mode,
   and how far apart the two drafts end (the same samples and order; the captures differ only in
   which sequences share a forward, i.e. float summation order).

    python tests/benchmarks/bench_gpu.py --out $OUT/gpu.json                      # H200, 8B, bf16
    python tests/benchmarks/bench_gpu.py --shape tiny --device cpu --out gpu.json # CI smoke test
    python tests/benchmarks/bench_gpu.py --shape demo --device cpu --dtype float32 --sections packing
"""

from __future__ import annotations

import argparse
import os
import platform
import queue
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from _results import save_result  # noqa: E402
from bench_train import make_model, plain_step, sync, synthetic_batches  # noqa: E402

from pipeline.draft.model import (  # noqa: E402  (torch only)
    DraftConfig,
    Eagle3Draft,
    TargetBatch,
)
from pipeline.engines.packing import pack_by_tokens, packed_forward  # noqa: E402  (torch and transformers only)
from pipeline.train.plan import plan_epoch  # noqa: E402  (standard library only)

SHAPES = {  # hidden, layers, intermediate, heads, kv heads, vocab, conversations, batch tokens
    "tiny": (64, 4, 128, 4, 2, 512, 24, 2048),
    "demo": (128, 12, 336, 4, 2, 2048, 200, 8192),  # the demo's pretrained target
    "mid": (1024, 8, 2816, 16, 8, 32000, 200, 16384),
    "llama-8b": (4096, 32, 14336, 32, 8, 128256, 400, 65536),
}


def conversation_lengths(n: int, seed: int = 0, cap: int = 2048) -> list[int]:
    """Chat-like lengths: lognormal around ~600 tokens, 32..cap."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.clip(rng.lognormal(6.2, 0.8, n), 32, cap)]


def build_target(shape: str, device: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    h, layers, inter, heads, kv, vocab, *_ = SHAPES[shape]
    cfg = LlamaConfig(
        hidden_size=h,
        num_hidden_layers=layers,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        max_position_embeddings=4096,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    return model.eval()


def conversations(lengths: list[int], vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


class PlaneWriters:
    """``n`` threads, each appending a batch's samples to its own Parquet shard, a row group per
    sample: the exponent plane as one zstd frame per sample, mantissa planes raw (byte_planes_v1's
    layout)."""

    def __init__(self, n: int, out_dir: Path, points: list[str], nbytes: int):
        self.q: queue.Queue = queue.Queue(maxsize=2 * n)
        names = [f"{p}#b{k}" for p in points for k in range(nbytes)]
        self.schema = pa.schema(
            [pa.field("sample", pa.int64()), pa.field("num_tokens", pa.int32())]
            + [pa.field(c, pa.large_binary()) for c in names]
        )
        self.points, self.nbytes, self.bytes, self.busy_s = points, nbytes, 0, 0.0
        self.index: dict[int, tuple[Path, int, int]] = {}  # sample -> (shard, row group, row)
        self.threads = [
            threading.Thread(target=self._run, args=(out_dir / f"shard-{i}.parquet",), daemon=True) for i in range(n)
        ]
        self._lock = threading.Lock()
        for t in self.threads:
            t.start()

    def _run(self, path: Path) -> None:
        codec = pa.Codec("zstd", compression_level=1)
        with open(path, "wb") as f:
            w = pq.ParquetWriter(f, self.schema, compression="none", use_dictionary=False, data_page_size=64 << 20)
            row_groups = 0
            while (item := self.q.get()) is not None:
                t0 = time.perf_counter()
                lengths, planes, samples = item
                offs = np.concatenate([[0], np.cumsum(lengths)])
                cols = {"sample": pa.array(samples, pa.int64()), "num_tokens": pa.array(lengths, pa.int32())}
                size = 0
                for p in self.points:
                    for k in range(self.nbytes):
                        cells = [planes[p][k][offs[i] : offs[i + 1]].tobytes() for i in range(len(lengths))]
                        if k == self.nbytes - 1:
                            cells = [codec.compress(c, asbytes=True) for c in cells]
                        size += sum(map(len, cells))
                        cols[f"{p}#b{k}"] = pa.array(cells, pa.large_binary())
                # a row group per sample, as the store writes them (so a read takes one sample's bytes)
                w.write_table(pa.table(cols, schema=self.schema), row_group_size=1)
                with self._lock:
                    self.index.update({x: (path, row_groups + j, 0) for j, x in enumerate(samples)})
                    self.bytes += size
                    self.busy_s += time.perf_counter() - t0
                row_groups += len(samples)
            w.close()
            f.flush()
            os.fsync(f.fileno())

    def put(self, lengths: list[int], planes: dict[str, np.ndarray], samples: list[int]) -> None:
        """One packed batch, split into one run of consecutive samples per writer, so every writer
        works on every batch (a large batch given to one writer would leave the others idle)."""
        n = len(self.threads)
        offs = np.concatenate([[0], np.cumsum(lengths)])
        for c in range(n):
            lo, hi = c * len(lengths) // n, (c + 1) * len(lengths) // n
            if lo < hi:
                a, b = offs[lo], offs[hi]
                self.q.put((lengths[lo:hi], {p: v[:, a:b] for p, v in planes.items()}, samples[lo:hi]))

    def close(self) -> None:
        for _ in self.threads:
            self.q.put(None)
        for t in self.threads:
            t.join()


class _Hooks:
    """The aux boundaries (as the inputs of those layers) and the final norm's output of one forward."""

    def __init__(self, model, aux: list[int]):
        self.store: dict[str, torch.Tensor] = {}
        layers = model.model.layers
        self.hooks = [
            layers[k].register_forward_pre_hook(
                lambda _m, args, kw, k=k: self.store.__setitem__(f"r_{k}", args[0] if args else kw["hidden_states"]),
                with_kwargs=True,
            )
            for k in aux
        ]
        self.hooks.append(
            model.model.norm.register_forward_hook(lambda _m, _a, out: self.store.__setitem__("final_post", out))
        )

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


def host_planes(states: dict[str, torch.Tensor], points: list[str], device: torch.device) -> dict[str, np.ndarray]:
    """Each point's packed row [1, sum T, H] split into byte planes on the device, then one pinned
    copy to the host per point (byte_planes_v1's split, written out: the store's module needs zstandard)."""
    host = {}
    for p in points:
        x = states[p][0]
        planes = x.view(torch.uint8).view(*x.shape, -1).permute(2, 0, 1).contiguous()
        host[p] = torch.empty(planes.shape, dtype=torch.uint8, pin_memory=device.type == "cuda")
        host[p].copy_(planes, non_blocking=True)
    sync(device)
    return {p: t.numpy() for p, t in host.items()}


def bench_extraction(shape: str, device: torch.device, dtype: torch.dtype, writers: int, repeats: int) -> dict:
    model = build_target(shape, device, dtype)
    *_, n_conv, budget = SHAPES[shape]
    lengths = conversation_lengths(n_conv)
    batches = pack_by_tokens(lengths, budget)
    n = len(model.model.layers)
    # r_2, r_N/2, r_N-3 (the EAGLE-3 defaults) as the inputs of those layers: written out here
    # because pipeline.conventions needs pydantic, which a GPU box may lack.
    aux = [2, n // 2, n - 3]
    points = [f"r_{k}" for k in aux] + ["final_post"]
    seqs = conversations(lengths, model.config.vocab_size)

    @torch.no_grad()
    def bare() -> None:
        for b in batches:
            packed_forward(model, model.model, [seqs[i] for i in b], device)
        sync(device)

    @torch.no_grad()
    def capture(out_dir: Path) -> dict:
        hooks = _Hooks(model, aux)
        pool = PlaneWriters(writers, out_dir, points, torch.tensor([], dtype=dtype).element_size())
        try:
            for b in batches:
                packed_forward(model, model.model, [seqs[i] for i in b], device)
                pool.put([lengths[i] for i in b], host_planes(hooks.store, points, device), b)
        finally:
            hooks.remove()
            pool.close()
        return {"bytes": pool.bytes, "writer_busy_s": pool.busy_s}

    real = sum(lengths)
    bare()  # warm-up
    runs = {"bare_forward": [], "capture": []}
    written: dict = {}
    for _ in range(repeats):  # A/B alternated
        t0 = time.perf_counter()
        bare()
        runs["bare_forward"].append(real / (time.perf_counter() - t0))
        with tempfile.TemporaryDirectory(prefix="strata-gpu-bench-") as d:
            t0 = time.perf_counter()
            written = capture(Path(d))
            runs["capture"].append(real / (time.perf_counter() - t0))
    med = {k: float(np.median(v)) for k, v in runs.items()}
    return {
        "shape": shape,
        "conversations": n_conv,
        "real_tokens": real,
        "batches": len(batches),
        "points": points,
        "writers": writers,
        "tokens_per_s": runs,
        "median_tokens_per_s": med,
        "capture_over_bare": med["capture"] / med["bare_forward"],
        "goal": 0.90,
        "written_bytes_last_run": written.get("bytes"),
        "writer_busy_s_last_run": written.get("writer_busy_s"),
    }


def draft_config(shape: str) -> DraftConfig:
    """The EAGLE-3 draft of a target of this shape: one of its decoder layers, three aux slots."""
    h, _, inter, heads, kv, vocab, *_ = SHAPES[shape]
    return DraftConfig(
        hidden_size=h,
        target_hidden_size=h,
        num_aux=3,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=h // heads,
        vocab_size=vocab,
        draft_vocab_size=min(vocab, 32000),
    )


def bench_draft_step(shape: str, device: torch.device, dtype: torch.dtype, steps: int, ttt: int) -> dict:
    cfg = draft_config(shape)
    seq = 2048 if shape == "llama-8b" else 256
    batches = synthetic_batches(cfg, 2, seq, device, dtype)
    model = make_model(cfg, device, dtype)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def tokens_per_s(unroll: int) -> float:
        step = plain_step(model, opt, unroll)
        step(*batches[0])
        sync(device)
        t0 = time.perf_counter()
        for i in range(steps):
            step(*batches[i % 2])
        sync(device)
        return steps * seq / (time.perf_counter() - t0)

    one, full = tokens_per_s(1), tokens_per_s(ttt)
    return {
        "seq": seq,
        "ttt": ttt,
        "tokens_per_s_ttt1": one,
        "tokens_per_s": full,
        "ttt_cost_ratio": one / full,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else None,
    }


TRAIN_BATCH_TOKENS = {"tiny": 512, "demo": 2048, "mid": 8192, "llama-8b": 16384}  # demo: its training config's


def demo_lengths(cap: int = 512) -> list[int]:
    """The demo's conversations as its target's tokenizer and chat template count them (before
    the demo regenerates the answers), cut at its max_length."""
    from pipeline.data.stdlib import make_conversations
    from pipeline.demo.tiny import train_tokenizer

    tok = train_tokenizer()
    texts = [tok.apply_chat_template(c["messages"], tokenize=False) for c in make_conversations()]
    return [min(cap, len(tok(t, add_special_tokens=False)["input_ids"])) for t in texts]


@dataclass
class _Sample:
    tokens: int


def planned_batches(cfg: DraftConfig, lengths: list[int], batch_tokens: int, packed: bool, n: int, device, dtype):
    """The first ``n`` batches an epoch plans for these lengths, filled with random values, in the layout."""
    plan = plan_epoch([_Sample(x) for x in lengths], batch_tokens, 1, 0, 0, packed=packed)
    g = torch.Generator().manual_seed(0)
    out = []
    for (group,) in plan[:n]:
        lens = [lengths[i] for i in group]
        B, T = (1, sum(lens)) if packed else (len(lens), max(lens))
        real = torch.zeros(B, T, dtype=torch.bool)
        for j, length in enumerate(lens):
            row, at = (0, sum(lens[:j])) if packed else (j, 0)
            real[row, at : at + length] = True
        tb = TargetBatch(
            p_draft=torch.softmax(torch.randn(B, T, cfg.draft_vocab_size, generator=g) * 3, -1).to(device),
            greedy=torch.randint(0, cfg.draft_vocab_size, (B, T), generator=g).to(device),
            in_draft_vocab=torch.ones(B, T, dtype=torch.bool, device=device),
            trained=real.to(device),
        )
        aux = torch.randn(B, T, cfg.num_aux * cfg.target_hidden_size, generator=g).to(device, dtype)
        ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g).to(device)
        out.append((aux, ids, tb, lens))
    return out


def bench_packing(shape: str, device: torch.device, dtype: torch.dtype, steps: int, ttt: int, repeats: int) -> dict:
    cfg = draft_config(shape)
    batch_tokens = TRAIN_BATCH_TOKENS[shape]
    model = make_model(cfg, device, dtype)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

    def step(aux, ids, tb, lens) -> None:
        out = model(aux, ids, tb, steps=ttt, seq_lens=lens)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()

    result: dict = {"batch_tokens": batch_tokens, "ttt": ttt, "steps": steps, "repeats": repeats}
    dists = {"demo": demo_lengths(), "chat": conversation_lengths(400, cap=min(2048, 4 * batch_tokens))}
    for name, lengths in dists.items():
        layouts = {
            layout: planned_batches(cfg, lengths, batch_tokens, layout == "packed", steps + 1, device, dtype)
            for layout in ("padded", "packed")
        }
        rates: dict[str, list[float]] = {"padded": [], "packed": []}
        for _ in range(repeats):
            for layout, batches in layouts.items():
                step(*batches[0])  # warm-up: allocator, kernels
                sync(device)
                t0 = time.perf_counter()
                for b in batches[1:]:
                    step(*b)
                sync(device)
                rates[layout].append(sum(sum(b[3]) for b in batches[1:]) / (time.perf_counter() - t0))
        epoch = {
            layout: plan_epoch([_Sample(x) for x in lengths], batch_tokens, 1, 0, 0, packed=layout == "packed")
            for layout in ("padded", "packed")
        }
        padded_positions = sum(len(g) * max(lengths[i] for i in g) for (g,) in epoch["padded"])
        med = {k: statistics.median(v) for k, v in rates.items()}
        result[name] = {
            "samples": len(lengths),
            "mean_length": sum(lengths) / len(lengths),
            "padding_fraction_padded": 1 - sum(lengths) / padded_positions,
            "steps_per_epoch": {k: len(v) for k, v in epoch.items()},
            "sequences_per_batch": {k: len(lengths) / len(v) for k, v in epoch.items()},
            "real_tokens_per_s": rates,
            "packed_over_padded": med["packed"] / med["padded"],
        }
        print(f"packing [{name}]: packed/padded real tokens/s = {result[name]['packed_over_padded']:.2f}", flush=True)
    return result


def _host_peak_reset() -> None:
    """Start a new peak-RSS window (Linux: writing 5 to clear_refs resets VmHWM)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _host_peak_gb() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return None


def bench_stream(
    shape: str, device: torch.device, dtype: torch.dtype, epochs: int, ttt: int, writers: int, repeats: int
) -> dict:
    target = build_target(shape, device, dtype)
    *_, n_conv, budget = SHAPES[shape]
    batch_tokens = TRAIN_BATCH_TOKENS[shape]
    lengths = conversation_lengths(n_conv, cap=min(2048, batch_tokens))
    seqs = conversations(lengths, target.config.vocab_size)
    n = len(target.model.layers)
    # r_2, r_N/2, r_N-3 (written out: pipeline.conventions needs pydantic); distinct ones on the tiny shape
    aux = [2, n // 2, n - 3] if n >= 8 else [1, 2, 3]
    points = [f"r_{k}" for k in aux] + ["final_post"]
    nbytes = torch.tensor([], dtype=dtype).element_size()
    cfg = draft_config(shape)
    vd = cfg.draft_vocab_size
    head = target.lm_head.weight[:vd]  # the draft vocab: the target's first vd ids (d2t all zero)
    plans = [
        [g for (g,) in plan_epoch([_Sample(x) for x in lengths], batch_tokens, 1, 0, e, packed=True)]
        for e in range(epochs)
    ]
    real = sum(sum(lengths[i] for i in g) for plan in plans for g in plan)

    def train_batch(model, opt, group: list[int], states: dict[str, torch.Tensor]) -> None:
        lens = [lengths[i] for i in group]
        ids = torch.tensor([t for i in group for t in seqs[i]], device=device)[None]
        final = states["final_post"]
        with torch.no_grad():
            logits = final.float() @ head.float().T
            tb = TargetBatch(
                p_draft=logits.softmax(-1),
                greedy=logits.argmax(-1),
                in_draft_vocab=torch.ones_like(ids, dtype=torch.bool),
                trained=torch.ones_like(ids, dtype=torch.bool),
            )
        x = torch.cat([states[p] for p in points[:-1]], dim=-1)
        out = model(x, ids, tb, steps=ttt, seq_lens=lens)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()

    def fresh_draft():
        model = make_model(cfg, device, dtype)
        with torch.no_grad():  # the target's embedding, as training uses (make_model leaves it random)
            model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    @torch.no_grad()
    def capture(hooks: _Hooks, group: list[int]) -> dict[str, torch.Tensor]:
        packed_forward(target, target.model, [seqs[i] for i in group], device)
        return {p: hooks.store[p] for p in points}  # [1, sum T, H] each

    def streamed() -> tuple[dict, Eagle3Draft]:
        model, opt = fresh_draft()
        hooks = _Hooks(target, aux)
        t0 = time.perf_counter()
        try:
            for plan in plans:
                for group in plan:
                    states = capture(hooks, group)
                    # the object store's hop: device -> host (pinned) -> device
                    host = {}
                    for p, v in states.items():
                        host[p] = torch.empty(v.shape, dtype=v.dtype, pin_memory=device.type == "cuda")
                        host[p].copy_(v, non_blocking=True)
                    sync(device)
                    train_batch(model, opt, group, {p: v.to(device, non_blocking=True) for p, v in host.items()})
            sync(device)
        finally:
            hooks.remove()
        return {"wall_s": time.perf_counter() - t0, "bytes_written": 0}, model

    def offline(out_dir: Path) -> tuple[dict, Eagle3Draft]:
        hooks = _Hooks(target, aux)
        pool = PlaneWriters(writers, out_dir, points, nbytes)
        t0 = time.perf_counter()
        try:
            for b in pack_by_tokens(lengths, budget):
                states = capture(hooks, b)
                pool.put([lengths[i] for i in b], host_planes(states, points, device), b)
        finally:
            hooks.remove()
            pool.close()
        extract_s = time.perf_counter() - t0
        model, opt = fresh_draft()
        codec = pa.Codec("zstd")
        t1 = time.perf_counter()
        for plan in plans:
            for group in plan:
                # as the training job's load_batch reads: each row group a batch needs, once for the batch
                groups: dict[tuple[Path, int], pa.Table] = {}
                rows = []
                for i in group:
                    path, rg, row = pool.index[i]
                    if (path, rg) not in groups:
                        groups[(path, rg)] = pq.ParquetFile(path).read_row_group(rg)
                    rows.append((groups[(path, rg)], row, lengths[i]))
                states = {}
                for p in points:
                    parts = []
                    for table, row, length in rows:
                        planes = []
                        for k in range(nbytes):
                            cell = table[f"{p}#b{k}"][row].as_py()
                            if k == nbytes - 1:
                                cell = codec.decompress(
                                    cell, decompressed_size=length * cfg.target_hidden_size, asbytes=True
                                )
                            planes.append(np.frombuffer(cell, np.uint8).reshape(length, -1))
                        parts.append(torch.from_numpy(np.stack(planes, -1)).view(dtype).view(length, -1))
                    buf = torch.cat(parts)[None]
                    if device.type == "cuda":
                        buf = buf.pin_memory()
                    states[p] = buf.to(device, non_blocking=True)
                train_batch(model, opt, group, states)
        sync(device)
        train_s = time.perf_counter() - t1
        written = sum(f.stat().st_size for f in out_dir.iterdir())
        return {
            "wall_s": extract_s + train_s,
            "extract_s": extract_s,
            "train_s": train_s,
            "bytes_written": written,
        }, model

    def measured(run, *args) -> tuple[dict, Eagle3Draft]:
        _host_peak_reset()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        rec, model = run(*args)
        rec["peak_host_rss_gb"] = _host_peak_gb()
        rec["peak_device_gb"] = torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else None
        rec["tokens_per_s"] = real / rec["wall_s"]
        return rec, model

    runs: dict[str, list[dict]] = {"streamed": [], "offline": []}
    drift = 0.0  # the two drafts' largest relative weight difference (packing changes float sums)
    for _ in range(repeats):  # alternated
        rec, a = measured(streamed)
        runs["streamed"].append(rec)
        with tempfile.TemporaryDirectory(prefix="strata-gpu-stream-") as d:
            rec, b = measured(offline, Path(d))
            runs["offline"].append(rec)
        for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True):
            if x.is_floating_point():
                drift = max(drift, ((x.float() - y.float()).norm() / y.float().norm().clamp(min=1e-12)).item())
    med = {k: statistics.median(r["wall_s"] for r in v) for k, v in runs.items()}
    result = {
        "epochs": epochs,
        "ttt": ttt,
        "batch_tokens": batch_tokens,
        "conversations": len(lengths),
        "real_tokens_trained": real,
        "steps": sum(len(p) for p in plans),
        "points": points,
        "runs": runs,
        "median_wall_s": med,
        "streamed_over_offline_wall": med["streamed"] / med["offline"],
        "offline_bytes_written": runs["offline"][-1]["bytes_written"],
        "draft_rel_diff": drift,
    }
    print(
        f"stream: streamed/offline wall = {result['streamed_over_offline_wall']:.2f}, offline wrote "
        f"{result['offline_bytes_written'] / 1e6:.1f} MB, drafts differ by {drift:.1e} (relative)",
        flush=True,
    )
    return result


def main(argv: list[str] | None = None) -> dict:
    a = argparse.ArgumentParser()
    a.add_argument("--shape", choices=list(SHAPES), default="llama-8b")
    a.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    a.add_argument("--writers", type=int, default=4)
    a.add_argument("--repeats", type=int, default=3)
    a.add_argument("--steps", type=int, default=10)
    a.add_argument("--ttt", type=int, default=7)
    a.add_argument("--epochs", type=int, default=2)
    a.add_argument("--sections", default="extraction,draft_step,packing,stream", help="comma-separated")
    a.add_argument("--out")
    args = a.parse_args(argv)
    sections = set(args.sections.split(","))
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    result = {
        "benchmark": "gpu",
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "load_avg": os.getloadavg(),
    }
    if "extraction" in sections:
        result["extraction"] = bench_extraction(args.shape, device, dtype, args.writers, args.repeats)
    if "draft_step" in sections:
        result["draft_step"] = bench_draft_step(args.shape, device, dtype, args.steps, args.ttt)
    if "packing" in sections:
        result["packing"] = bench_packing(args.shape, device, dtype, args.steps, args.ttt, args.repeats)
    if "stream" in sections:
        result["stream"] = bench_stream(args.shape, device, dtype, args.epochs, args.ttt, args.writers, args.repeats)
    everything = {"extraction", "draft_step", "packing", "stream"}
    suffix = "" if sections >= everything else "_" + "_".join(sorted(sections))
    save_result(result, f"gpu_{args.shape}_{device.type}{suffix}.json", args.out)
    return result


if __name__ == "__main__":
    main()
