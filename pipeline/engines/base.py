"""The engine interface: a host for the target model that captures typed points.

HF transformers lives beside this file; vLLM and SGLang engines implement the same
interface so the extraction job and the validator do not care which one runs.
"""

from __future__ import annotations

from typing import Protocol

import torch

from pipeline.store.encoding import TORCH_DTYPES, split_planes
from pipeline.store.writer import CapturedBatch
from schemas.capture import CapturePoint
from schemas.provenance import EngineRef


class CaptureEngine(Protocol):
    name: str
    version: str
    num_layers: int
    hidden_size: int
    dtype: str
    points: list[CapturePoint]

    def engine_ref(self, point: CapturePoint) -> EngineRef:
        """How this engine names ``point`` natively (for provenance)."""
        ...

    def plan_batches(self, lengths: list[int]) -> list[list[int]]:
        """Group sample indices into forward batches."""
        ...

    def capture(self, sequences: list[list[int]]) -> CapturedBatch:
        """Run one batch and return every configured point as host byte planes."""
        ...


def captured_batch(per_point: dict[str, list[torch.Tensor]], dtype: str) -> CapturedBatch:
    """Per point, one [T, H] tensor per sequence -> host byte planes in batch order."""
    planes = {k: split_planes(torch.cat(v).to(TORCH_DTYPES[dtype]).contiguous()).numpy() for k, v in per_point.items()}
    return CapturedBatch(lengths=[t.shape[0] for t in next(iter(per_point.values()))], planes=planes)


def plan_by_tokens(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Longest first; each batch's padded size (count x longest) stays within the budget."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        longest = lengths[cur[0]] if cur else lengths[i]
        if cur and longest * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches
