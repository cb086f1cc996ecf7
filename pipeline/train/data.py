"""Training data: split the dataset, and stream the decoded batches of the plan
(:func:`pipeline.train.plan.plan_epoch`), through Ray Data when running on Ray. A batch is
packed -- its sequences end to end in one row, nothing padded -- or padded, one sequence per row.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch

from pipeline.cluster import stall_guard
from pipeline.store.reader import DatasetReader, SampleRef, ShardCorrupt
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


@dataclass
class Batch:
    aux: torch.Tensor  # [B,T,A*H] float32
    final: torch.Tensor  # [B,T,H] float32
    input_ids: torch.Tensor  # [B,T] long (padding 0)
    loss_mask: torch.Tensor  # [B,T] bool (padding False)
    seq_lens: torch.Tensor  # [S] long: one per row (padded), or end to end in the one row (packed)

    FIELDS = ("aux", "final", "input_ids", "loss_mask", "seq_lens")

    @property
    def tokens(self) -> int:
        """Real tokens, padding excluded."""
        return int(self.seq_lens.sum())

    def to(self, device: torch.device) -> Batch:
        """The tensors on ``device``; ``seq_lens`` stays on the host, where the layout is planned
        (reading it back from a GPU would sync every step)."""
        return Batch(*(getattr(self, k).to(device) for k in self.FIELDS[:-1]), self.seq_lens)


class BatchArrays:
    """A batch's numpy arrays (numpy: it crosses Ray Data and the object store), filled one
    sample at a time: the one layout both the dataset reader and the streaming capture write."""

    def __init__(self, lengths: list[int], packed: bool):
        self.lengths = lengths
        B, T = (1, sum(lengths)) if packed else (len(lengths), max(lengths))
        self.starts = [(0, o) for o in accumulate(lengths[:-1], initial=0)] if packed else [(j, 0) for j in range(B)]
        self.d: dict[str, np.ndarray] = {
            "input_ids": np.zeros((B, T), np.int64),
            "loss_mask": np.zeros((B, T), np.bool_),
            "seq_lens": np.asarray(lengths, np.int64),
        }

    def put(self, j: int, input_ids, loss_mask, aux: np.ndarray, final: np.ndarray) -> None:
        """Sample ``j``'s tokens, loss mask, aux states [n, A*H] and final state [n, H]."""
        if "aux" not in self.d:
            B, T = self.d["input_ids"].shape
            self.d["aux"] = np.zeros((B, T, aux.shape[-1]), np.float32)
            self.d["final"] = np.zeros((B, T, final.shape[-1]), np.float32)
        (row, start), end = self.starts[j], self.starts[j][1] + self.lengths[j]
        for k, v in (("input_ids", input_ids), ("loss_mask", loss_mask), ("aux", aux), ("final", final)):
            self.d[k][row, start:end] = v


def load_batch(
    reader: DatasetReader, refs: list[SampleRef], aux: list[str], final: str, packed: bool = False
) -> dict[str, np.ndarray]:
    """Decode samples into a batch's numpy arrays."""
    by_group: dict[tuple[str, int], list[int]] = defaultdict(list)
    for j, r in enumerate(refs):
        by_group[(r.shard, r.row_group)].append(j)
    out = BatchArrays([r.tokens for r in refs], packed)
    for (shard, rg), js in by_group.items():
        table = reader.read_row_group(shard, rg)
        for j in js:
            i = refs[j].row
            if (got := table["sample_id"][i].as_py()) != refs[j].sample_id:
                raise ShardCorrupt(
                    f"{reader.uri}: row {i} of row group {rg} in {shard} is sample {got}, the plan expects "
                    f"{refs[j].sample_id}: the file is not the one the plan indexed"
                )
            out.put(
                j,
                table["input_ids"][i].values.to_numpy(),
                table["loss_mask"][i].values.to_numpy().astype(bool),
                torch.cat([reader.decode(table, i, p).float() for p in aux], dim=-1).numpy(),
                reader.decode(table, i, final).float().numpy(),
            )
    return out.d


def to_batch(d: dict[str, np.ndarray]) -> Batch:
    return Batch(*(torch.as_tensor(np.asarray(d[k])) for k in Batch.FIELDS))


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
        packed: bool = False,
    ):
        self.uri, self.s3, self.refs, self.rank, self.packed = dataset_uri, s3, refs, rank, packed
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
                    batch = load_batch(reader, [self.refs[i] for i in idx], self.aux, self.final, self.packed)
                    q.put((step, to_batch(batch)))
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
        uri, s3, refs, aux, final, packed = self.uri, self.s3, self.refs, self.aux, self.final, self.packed

        def decode(item: dict) -> dict:
            reader = DatasetReader(uri, s3, verify_checksums=False)
            d = load_batch(reader, [refs[i] for i in item["idx"]], aux, final, packed)
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
