"""Where a machine's CPU goes while a benchmark runs: every process's CPU time sampled from /proc.

A job on two cores is slower than a plain loop for two kinds of reason: its own process does more
per step, or other processes (Ray's raylet, GCS, agents, the driver) take CPU the step needs. The
sampler tells them apart: per interval, each process's CPU seconds (user + system, all threads),
grouped by what the process is. Linux only; elsewhere it records nothing.
"""

from __future__ import annotations

import os
import threading
import time
from itertools import pairwise
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(path: str) -> tuple[str, int, int]:
    """(name, user + system ticks, start time) from a /proc stat file (a process's or a thread's)."""
    stat = Path(path).read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return stat[stat.index("(") + 1 : stat.rindex(")")], int(fields[11]) + int(fields[12]), int(fields[19])


def _ticks(pid: str) -> tuple[str, int, int] | None:
    """(command line, user + system ticks, start time) of one process, None if it is gone. The
    start time tells a reused pid from the same process (kernel threads rename themselves)."""
    try:
        name, ticks, start = _stat(f"/proc/{pid}/stat")
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    return cmd or name, ticks, start


def snapshot() -> dict[int, tuple[str, int, int]]:
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (t := _ticks(d)):
            out[int(d)] = t
    return out


def threads(pid: int) -> dict[str, int]:
    """Ticks per thread name of one process ("main" for its first thread; same-named threads summed)."""
    out: dict[str, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            name, ticks, _ = _stat(f"/proc/{pid}/task/{tid}/stat")
        except OSError:
            continue
        name = "main" if int(tid) == pid else name
        out[name] = out.get(name, 0) + ticks
    return out


def category(cmd: str, roles: dict[str, str]) -> str:
    """The first role whose marker is in the command line, else the process's Ray role, else other."""
    for marker, role in roles.items():
        if marker in cmd:
            return role
    for marker, role in (
        ("gcs_server", "ray: gcs_server"),
        ("raylet", "ray: raylet"),
        ("dashboard/agent.py", "ray: dashboard agent"),
        ("runtime_env/agent", "ray: runtime env agent"),
        ("log_monitor.py", "ray: log monitor"),
        ("autoscaler/_private/monitor.py", "ray: autoscaler monitor"),
        ("dashboard.py", "ray: dashboard / api server"),
        ("ray::", "ray: other worker"),
        ("default_worker.py", "ray: idle worker"),
    ):
        if marker in cmd:
            return role
    return "other"


class CpuSampler:
    """Samples every process's CPU every ``interval`` seconds from start() to stop()."""

    def __init__(self, interval: float = 1.0, threads_of: str | None = None):
        self.interval, self.threads_of = interval, threads_of
        self.samples: list[tuple[float, dict[int, tuple[str, int, int]]]] = []
        self.thread_samples: list[dict[str, int]] = []  # per sample: the threads_of process's threads
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="cpu-sampler")

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)
        self._sample()

    def _sample(self) -> None:
        t, procs = time.perf_counter(), snapshot()
        self.samples.append((t, procs))
        pids = [pid for pid, (cmd, *_) in procs.items() if self.threads_of and self.threads_of in cmd]
        self.thread_samples.append(threads(pids[0]) if pids else {})

    def __enter__(self) -> CpuSampler:
        if os.path.isdir("/proc"):
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def intervals(self, roles: dict[str, str]) -> list[dict]:
        """Per interval: its length and the cores each category used (CPU seconds / wall seconds)."""
        out = []
        for (t0, a), (t1, b) in pairwise(self.samples):
            dt = t1 - t0
            used: dict[str, float] = {}
            for pid, (cmd, ticks, start) in b.items():
                before = a[pid][1] if pid in a and a[pid][2] == start else 0  # else new (or a reused pid)
                d = (ticks - before) / TICK
                if d > 0:
                    k = category(cmd, roles)
                    used[k] = used.get(k, 0.0) + d / dt
            out.append({"seconds": dt, "cores": used})
        return out

    def busy_phase(self, roles: dict[str, str], role: str, min_cores: float, skip: float = 0.2) -> dict:
        """Mean cores per category over the intervals where ``role`` used at least ``min_cores``
        (its compute phase), leaving out the first ``skip`` of them (warm-up); "idle" is what no
        process used; with ``threads_of``, that process's cores per thread name over the same intervals."""
        ivs = self.intervals(roles)
        busy = [i for i, iv in enumerate(ivs) if iv["cores"].get(role, 0.0) >= min_cores]
        busy = busy[int(len(busy) * skip) :]
        wall = sum(ivs[i]["seconds"] for i in busy)
        if not wall:
            return {"seconds": 0.0, "cores": {}}
        cores: dict[str, float] = {}
        for i in busy:
            for k, v in ivs[i]["cores"].items():
                cores[k] = cores.get(k, 0.0) + v * ivs[i]["seconds"] / wall
        cores["idle"] = (os.cpu_count() or 1) - sum(cores.values())
        out = {"seconds": round(wall, 1), "cores": _rounded(cores)}
        if self.threads_of:
            per: dict[str, float] = {}
            for i in busy:
                a, b = self.thread_samples[i], self.thread_samples[i + 1]
                for name, ticks in b.items():
                    per[name] = per.get(name, 0.0) + max(ticks - a.get(name, 0), 0) / TICK / wall
            out["threads"] = _rounded(per)
        return out


def _rounded(cores: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in sorted(cores.items(), key=lambda x: -x[1]) if round(v, 3)}
