"""The engine contract: a host for the target model that the pipeline and the gate talk to.

Every engine (HF transformers in ``hf.py``, vLLM in ``vllm/engine.py``, SGLang in
``sglang/engine.py``) implements :class:`TargetEngine`: capture typed points (extraction and
replay), decode greedily with the target alone (the losslessness reference), serve an
EAGLE-3 draft exactly as a deployment would and return acceptance together with the draft
inputs it observed (the measured feed), and close. The extraction job, replay and acceptance
dispatch through this interface, never on an engine's name.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from pipeline.dtypes import torch_dtype
from pipeline.engines.errors import EngineUnavailable
from pipeline.engines.feed_files import FeedCall
from pipeline.store.encoding import split_planes
from schemas.acceptance import Acceptance
from schemas.capture import CapturePoint
from schemas.provenance import EngineRef


@dataclass
class CapturedBatch:
    """An engine's host-side output for a batch: tokens of all samples packed end to end
    (what the extraction writer stores)."""

    lengths: list[int]
    planes: dict[str, np.ndarray]  # capture point -> [B, sum(lengths), H] uint8 byte planes
    # seconds spent: "forward" (the target), "byte_split" (planes to host; on a GPU this
    # includes waiting for the device to finish)
    seconds: dict[str, float] = field(default_factory=dict)


@dataclass
class ServeResult:
    """A draft served through an engine: emitted tokens, acceptance as the engine counted it,
    and per prompt the draft inputs it recorded (None where the engine cannot be observed)."""

    outputs: list[list[int]]
    acceptance: Acceptance
    feed: list[list[FeedCall]] | None


@dataclass
class DecodeTiming:
    """Single-stream decoding of some prompts, timed: what a user of the deployment waits for.

    Each prompt runs alone twice -- once for one token (prefill) and once for its whole
    continuation, stopped at the end of the turn as served -- so a prompt's decode time =
    whole - prefill, and decode tokens/s (every token after the first, which comes with the
    prefill) excludes prefill. ``acceptance`` is None without a draft.
    """

    outputs: list[list[int]]
    prefill_s: list[float]  # per prompt
    total_s: list[float]  # per prompt: the whole continuation's request
    acceptance: Acceptance | None

    @property
    def new_tokens(self) -> int:
        return sum(map(len, self.outputs))

    def _decode(self) -> list[tuple[int, float]]:
        return [
            (len(o) - 1, max(t - p, 1e-9)) for o, p, t in zip(self.outputs, self.prefill_s, self.total_s, strict=True)
        ]

    @property
    def decode_tokens(self) -> int:
        """Every token after each prompt's first (which comes with the prefill)."""
        return sum(n for n, _ in self._decode())

    @property
    def decode_seconds(self) -> float:
        return sum(s for _, s in self._decode())

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / max(self.decode_seconds, 1e-9)

    @property
    def decode_tokens_per_s_se(self) -> float | None:
        """SE of the token-weighted rate with prompts as the units (ratio estimator); None with
        fewer than two prompts."""
        d = self._decode()
        if len(d) < 2:
            return None
        r, secs = self.decode_tokens_per_s, self.decode_seconds
        return math.sqrt(len(d) / (len(d) - 1) * sum((tok - r * s) ** 2 for tok, s in d)) / secs


def time_decode(
    generate, prompts: list[list[int]], max_new_tokens: int, after_each=None
) -> tuple[list[list[int]], list[float], list[float]]:
    """(outputs, prefill seconds, whole-request seconds) of ``generate([prompt], n)`` per prompt;
    ``after_each()`` runs between prompts, outside the timed spans (e.g. to read counters).
    Warm the engine up first: the first request pays one-off costs."""
    outs, prefill, total = [], [], []
    for p in prompts:
        t0 = time.perf_counter()
        generate([p], 1)
        t1 = time.perf_counter()
        outs.append(generate([p], max_new_tokens)[0])
        prefill.append(t1 - t0)
        total.append(time.perf_counter() - t1)
        if after_each is not None:
            after_each()
    return outs, prefill, total


class TargetEngine(ABC):
    name: str
    version: str
    num_layers: int
    hidden_size: int
    dtype: str
    points: list[CapturePoint]

    @abstractmethod
    def capture_tensors(self, sequences: list[list[int]]) -> dict[str, list[torch.Tensor]]:
        """Per configured point, one [T, H] tensor per sequence, in input order."""

    def capture(self, sequences: list[list[int]]) -> CapturedBatch:
        """Every configured point as host byte planes (what the extraction writer stores)."""
        return captured_batch(self.capture_tensors, sequences, self.dtype)

    @abstractmethod
    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Target-only greedy continuations."""

    @abstractmethod
    def serve_draft(
        self,
        draft_dir: str | Path,
        prompts: list[list[int]],
        max_new_tokens: int,
        k: int,
        feed_points: list[CapturePoint] | None = None,
    ) -> ServeResult:
        """Greedy speculative decoding with the draft as configured in ``draft_dir``.

        ``feed_points``: only for engines without reading rules of their own (HF), which
        feed the draft these points.
        """

    def timed_decode(
        self, draft_dir: str | Path | None, prompts: list[list[int]], max_new_tokens: int, k: int
    ) -> DecodeTiming:
        """Greedy decoding timed per prompt, without speculation (``draft_dir`` None) or with the
        draft as configured in ``draft_dir``. Engines that cannot be timed here say so."""
        raise EngineUnavailable(f"{self.name} does not time decoding here")

    def release_draft(self, draft_dir: str | Path) -> None:  # noqa: B027 - optional: engines without a pool
        """Stop serving ``draft_dir`` (a blocked configuration must not stay loaded)."""

    @abstractmethod
    def engine_ref(self, point: CapturePoint) -> EngineRef:
        """How this engine names ``point`` natively (for provenance)."""

    @abstractmethod
    def plan_batches(self, lengths: list[int]) -> list[list[int]]:
        """Group sample indices into forward batches."""

    @abstractmethod
    def close(self) -> None:
        """Release the model and every process or file the engine started."""


def captured_batch(capture_tensors, sequences: list[list[int]], dtype: str) -> CapturedBatch:
    """``capture_tensors(sequences)`` (per point, one [T, H] tensor per sequence) -> host byte
    planes in batch order, timed."""
    t0 = time.perf_counter()
    per_point = capture_tensors(sequences)
    t1 = time.perf_counter()
    planes = {k: split_planes(torch.cat(v).to(torch_dtype(dtype)).contiguous()).numpy() for k, v in per_point.items()}
    return CapturedBatch(
        lengths=[t.shape[0] for t in next(iter(per_point.values()))],
        planes=planes,
        seconds={"forward": t1 - t0, "byte_split": time.perf_counter() - t1},
    )
