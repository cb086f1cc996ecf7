"""The metrics window: what one ``metrics_every`` stretch of training did, reduced across
workers, and the run's ``metrics.jsonl`` that holds one line per window."""

from __future__ import annotations

import json
import time

import torch
import torch.distributed as dist

from pipeline.draft.model import simulated_acceptance_length
from pipeline.store.fs import atomic_write_bytes, join, read_bytes, resolve

METRICS_FILE = "metrics.jsonl"


class StepSums:
    """Per-TTT-position sums of loss and accuracy, kept on the training device (copying them to the
    host every step would make each step wait for the GPU) and all-reduced across workers when read."""

    def __init__(self, steps: int, device: torch.device | str = "cpu"):
        self.sums = torch.zeros(3, steps, dtype=torch.float64, device=device)  # loss, correct, counted
        self.n = 0
        self.tokens = 0

    def add(self, out, tokens: int) -> None:
        self.sums += torch.stack([out.step_loss.detach(), out.correct, out.counted]).double()
        self.n += 1
        self.tokens += tokens

    def reduce(self) -> dict:
        extra = torch.tensor([self.n, self.tokens], dtype=torch.float64, device=self.sums.device)
        t = torch.cat([self.sums.flatten(), extra])
        if dist.is_initialized():
            dist.all_reduce(t)
        t = t.cpu()  # the window's one host copy
        s = self.sums.shape[1]
        loss, correct, counted, (n, tokens) = t[:s], t[s : 2 * s], t[2 * s : 3 * s], t[3 * s :].tolist()
        acc = (correct / counted.clamp(min=1)).tolist()
        return {
            "loss": float(loss.sum() / max(n, 1)),
            "loss_per_pos": (loss / max(n, 1)).tolist(),
            "acc_per_pos": acc,
            "sim_accept_len": simulated_acceptance_length(acc),
            "tokens": int(tokens),
        }


class MetricsWindow:
    """Sums and timings since the last report: throughput, and how the wall time split between
    computing and waiting for data."""

    def __init__(self, ttt_steps: int, device: torch.device | str = "cpu"):
        self.ttt_steps, self.device = ttt_steps, device
        self._start(data_wait_s=0.0)

    def _start(self, data_wait_s: float) -> None:
        self.sums = StepSums(self.ttt_steps, self.device)
        self.compute_s = 0.0
        self.t0 = time.perf_counter()
        self.wait_at_start = data_wait_s

    def add(self, out, tokens: int, compute_s: float) -> None:
        self.sums.add(out, tokens)
        self.compute_s += compute_s

    # A checkpoint part (``where = "rank"``): a window open at a checkpoint is resumed with the
    # sums of the steps it already holds, so its record equals an uninterrupted run's.
    where = "rank"

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {
            "metrics.sums": self.sums.sums.cpu(),
            "metrics.counts": torch.tensor([self.sums.n, self.sums.tokens], dtype=torch.int64),
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if "metrics.sums" not in state:  # a checkpoint from before metrics were a part: an empty window
            return
        self.sums.sums.copy_(state["metrics.sums"].to(self.sums.sums.device))
        self.sums.n, self.sums.tokens = (int(x) for x in state["metrics.counts"].tolist())

    def close(self, data_wait_s: float, **fields) -> dict:
        """The window's record (``fields`` first), then a new window; all ranks must call this."""
        wall = max(time.perf_counter() - self.t0, 1e-9)
        r = self.sums.reduce()
        rec = {
            **fields,
            **r,
            "tokens_per_s": r["tokens"] / wall,
            "data_wait_fraction": (data_wait_s - self.wait_at_start) / wall,
            "compute_fraction": self.compute_s / wall,
        }
        self._start(data_wait_s)
        return rec


class MetricsLog:
    """``metrics.jsonl``: rewritten whole at each checkpoint, so after a resume it holds exactly
    the windows up to the checkpoint's step."""

    def __init__(self, run_uri: str, s3, resume_step: int | None):
        self.fs, self.root = resolve(run_uri, s3)
        self.lines: list[str] = []
        if resume_step is not None:
            try:
                old = read_bytes(self.fs, join(self.root, METRICS_FILE)).decode().splitlines()
            except (OSError, FileNotFoundError):
                old = []
            self.lines = [ln for ln in old if json.loads(ln).get("step", 0) <= resume_step]

    def append(self, record: dict) -> None:
        self.lines.append(json.dumps(record))

    def flush(self) -> None:
        atomic_write_bytes(self.fs, join(self.root, METRICS_FILE), ("\n".join(self.lines) + "\n").encode())
