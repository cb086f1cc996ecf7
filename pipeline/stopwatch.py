"""Wall-clock seconds per named stage of a job, for the breakdown a job reports."""

from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager


class Stopwatch:
    """Sums wall seconds per stage; ``totals()`` adds ``total`` since the stopwatch was made."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()
        self._seconds: Counter[str] = Counter()
        self._running: dict[str, float] = {}

    def start(self, stage: str) -> None:
        self._running[stage] = time.perf_counter()

    def stop(self, stage: str) -> None:
        self._seconds[stage] += time.perf_counter() - self._running.pop(stage)

    @contextmanager
    def __call__(self, stage: str):
        self.start(stage)
        try:
            yield
        finally:
            self.stop(stage)

    def totals(self) -> dict[str, float]:
        return {**{k: round(v, 4) for k, v in self._seconds.items()}, "total": round(time.perf_counter() - self._t0, 4)}
