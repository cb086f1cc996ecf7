"""Training data: index the dataset, plan length-bucketed batches deterministically, and
stream decoded batches (through Ray Data when running on Ray).

The plan is a pure function of (dataset, seed, epoch, world size), so a resumed run
continues at exactly the step where it stopped.
"""

from __future__ import annotations

import hashlib
import queue
import random
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.cluster import stall_guard
from pipeline.store.reader import DatasetReader, SampleRef
from schemas.capture import CapturePoint


def split_eval(
    refs: list[SampleRef], fraction: float, always: frozenset[str] = frozenset()
) -> tuple[list[SampleRef], list[SampleRef]]:
    """Deterministic by sample id, so the held-out set never changes between runs. The
    ``always`` ids (the dataset's probe samples, whose prefixes are the acceptance prompts)
    are held out whatever the fraction."""

    def held_out(r: SampleRef) -> bool:
        return (
            r.sample_id in always
            or int(hashlib.sha256(r.sample_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < fraction
        )

    train = [r for r in refs if not held_out(r)]
    return train, [r for r in refs if held_out(r)]


def plan_epoch(
    refs: list[SampleRef],
    batch_tokens: int,
    world: int,
    seed: int,
    epoch: int,
    window: int = 256,
) -> list[list[list[int]]]:
    """steps x workers x sample indices. Length bucketing: shuffle, sort within windows,
    pack each batch up to ``batch_tokens`` padded tokens, shuffle batches."""
    rng = random.Random(seed * 100_003 + epoch)
    order = list(range(len(refs)))
    rng.shuffle(order)
    batches: list[list[int]] = []
    for w in range(0, len(order), window):
        chunk = sorted(order[w : w + window], key=lambda i: -refs[i].tokens)
        cur: list[int] = []
        for i in chunk:
            if cur and refs[cur[0]].tokens * (len(cur) + 1) > batch_tokens:
                batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            batches.append(cur)
    rng.shuffle(batches)
    steps = len(batches) // world
    return [[batches[s * world + r] for r in range(world)] for s in range(steps)]


@dataclass
class Batch:
    aux: torch.Tensor  # [B,T,A*H] float32
    final: torch.Tensor  # [B,T,H] float32
    input_ids: torch.Tensor  # [B,T] long (padding 0)
    loss_mask: torch.Tensor  # [B,T] bool (padding False)

    @property
    def tokens(self) -> int:
        return int(self.loss_mask.numel())


def load_batch(reader: DatasetReader, refs: list[SampleRef], aux: list[str], final: str) -> dict[str, np.ndarray]:
    """Decode samples into padded numpy arrays (numpy: it crosses Ray Data)."""
    by_group: dict[tuple[str, int], list[int]] = defaultdict(list)
    for j, r in enumerate(refs):
        by_group[(r.shard, r.row_group)].append(j)
    T = max(r.tokens for r in refs)
    B = len(refs)
    h = reader.provenance(final).hidden_size
    out = {
        "aux": np.zeros((B, T, len(aux) * h), np.float32),
        "final": np.zeros((B, T, h), np.float32),
        "input_ids": np.zeros((B, T), np.int64),
        "loss_mask": np.zeros((B, T), np.bool_),
    }
    for (shard, rg), js in by_group.items():
        table = reader.read_row_group(shard, rg)
        for j in js:
            i, n = refs[j].row, refs[j].tokens
            out["input_ids"][j, :n] = table["input_ids"][i].values.to_numpy()
            out["loss_mask"][j, :n] = table["loss_mask"][i].values.to_numpy().astype(bool)
            out["aux"][j, :n] = torch.cat([reader.decode(table, i, p).float() for p in aux], dim=-1).numpy()
            out["final"][j, :n] = reader.decode(table, i, final).float().numpy()
    return out


def to_batch(d: dict[str, np.ndarray]) -> Batch:
    return Batch(*(torch.as_tensor(np.asarray(d[k])) for k in ("aux", "final", "input_ids", "loss_mask")))


class BatchStream:
    """This worker's batches from ``start_step`` on; records time spent waiting for data."""

    def __init__(
        self,
        dataset_uri: str,
        s3,
        refs: list[SampleRef],
        plan: list[list[list[int]]],
        rank: int,
        start_step: int,
        aux: list[CapturePoint],
        final: CapturePoint,
        use_ray: bool,
        cpus_per_task: float = 0.25,
        stall_timeout_s: float | None = None,
    ):
        self.uri, self.s3, self.refs, self.rank = dataset_uri, s3, refs, rank
        self.items = [(s, plan[s][rank]) for s in range(start_step, len(plan))]
        self.aux, self.final = [str(p) for p in aux], str(final)
        self.use_ray, self.cpus, self.stall_timeout_s = use_ray, cpus_per_task, stall_timeout_s
        self.wait_s = 0.0

    def __iter__(self) -> Iterator[tuple[int, Batch]]:
        it = self._ray() if self.use_ray else self._local()
        while True:
            t0 = time.perf_counter()
            try:
                step, b = next(it)
            except StopIteration:
                return
            self.wait_s += time.perf_counter() - t0
            yield step, b

    def _local(self) -> Iterator[tuple[int, Batch]]:
        """In-process decoding on a background thread, two batches ahead."""
        reader = DatasetReader(self.uri, self.s3, verify_checksums=False)
        q: queue.Queue = queue.Queue(maxsize=2)
        done = object()

        def produce() -> None:
            try:
                for step, idx in self.items:
                    q.put((step, to_batch(load_batch(reader, [self.refs[i] for i in idx], self.aux, self.final))))
            except BaseException as e:  # re-raised in the consumer
                q.put(e)
            q.put(done)

        threading.Thread(target=produce, name="batch-prefetch", daemon=True).start()
        while (item := q.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item

    def _ray(self) -> Iterator[tuple[int, Batch]]:
        import ray

        if not self.items:
            return
        uri, s3, refs, aux, final = self.uri, self.s3, self.refs, self.aux, self.final

        def decode(item: dict) -> dict:
            reader = DatasetReader(uri, s3, verify_checksums=False)
            d = load_batch(reader, [refs[i] for i in item["idx"]], aux, final)
            return {"step": item["step"], **{k: v for k, v in d.items()}}

        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True
        ctx.enable_progress_bars = False  # the training loop reports progress
        ctx.print_on_execution_start = False
        ds = ray.data.from_items(
            [{"step": s, "idx": list(i)} for s, i in self.items], override_num_blocks=len(self.items)
        )
        ds = ds.map(decode, num_cpus=self.cpus)
        rows = stall_guard(
            ds.iter_rows(),
            self.stall_timeout_s,
            f"rank {self.rank}'s Ray Data decode tasks",
            "free or add CPUs for them, use data_loading: worker, or raise stall_timeout_s",
        )
        for row in rows:
            yield int(row["step"]), to_batch(row)
