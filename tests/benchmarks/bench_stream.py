"""Streaming mode against extract-then-train, on the same conversations, as a user runs them.

A. offline: ``strata extract`` (one capture actor holding every CPU), then ``strata train`` on
   that dataset (one worker holding every CPU): two jobs, one after the other.
B. streaming: ``strata train`` with ``data: {stream: extract.yaml}`` -- one capture actor and one
   worker at once, the CPUs split between them; each epoch captures its batches again.
C. streaming_cached: B with ``data.cache``: the first epoch's batches are kept as shards and the
   later epochs read them (``--no-cached`` leaves it out).

Both train every sample ``--epochs`` times with the same plan. Reported per run: wall seconds,
bytes written (everything under the dataset and run directories, checkpoints included; and the
data alone: the dataset vs the streaming run's held-out samples), and the peak resident memory
of each process -- the CLI's driver, the capture actor, the training worker, Ray's own processes
-- sampled from /proc every 0.2 s (Linux; RSS counts the object-store pages a process maps), plus
the peak of their sum. Runs alternate (A, B, C) per repeat.

    python tests/benchmarks/bench_stream.py
    python tests/benchmarks/bench_stream.py --shape tiny --conversations 40 --repeats 1   # smoke
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

from _results import save_result  # noqa: E402
from bench_extract import build_target  # noqa: E402

POINTS = ["layer_output:1", "layer_output:3", "layer_output:5", "final:post_norm"]
ROLES = {
    "ray::StreamCaptureActor": "capture_actor",
    "ray::CaptureActor": "capture_actor",
    "ray::_WorkerProcess": "training_worker",
    "pipeline.cli": "driver",
}


def _children(root: int) -> dict[int, str]:
    """``root`` and every process below it: pid -> command line."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
                parent[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        try:
            out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        todo += [c for c, p in parent.items() if p == pid]
    return out


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def role(cmdline: str) -> str:
    return next((r for k, r in ROLES.items() if k in cmdline), "ray_and_other")


class MemorySampler(threading.Thread):
    """Peak RSS per role (the largest process of that role) and of all processes together."""

    def __init__(self, root: int):
        super().__init__(daemon=True)
        self.root, self.stop, self.peaks, self.total = root, False, {}, 0

    def run(self) -> None:
        while not self.stop:
            procs = _children(self.root)
            sizes = {pid: _rss(pid) for pid in procs}
            for pid, cmd in procs.items():
                r = role(cmd)
                self.peaks[r] = max(self.peaks.get(r, 0), sizes[pid])
            self.total = max(self.total, sum(sizes.values()))
            time.sleep(0.2)


def run_cli(command: str, cfg: dict, work: Path) -> dict:
    """``strata <command>`` in a fresh process with its own local Ray: wall seconds and memory."""
    import yaml

    path = work / f"{command}-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", command, "--config", str(path), "--no-progress"],
        cwd=ROOT,
        env={**os.environ, "RAY_ADDRESS": ""},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    sampler = MemorySampler(proc.pid)
    sampler.start()
    _, err = proc.communicate(timeout=3600)
    wall = time.perf_counter() - t0
    sampler.stop = True
    sampler.join()
    if proc.returncode:
        raise SystemExit(f"strata {command} failed ({proc.returncode}):\n{err[-4000:]}")
    return {"wall_s": wall, "peak_rss_bytes": sampler.peaks, "peak_total_rss_bytes": sampler.total}


def du(*paths: Path) -> int:
    return sum(f.stat().st_size for p in paths if p.exists() for f in p.rglob("*") if f.is_file())


def extract_config(target: Path, conv: Path, out: Path, cpus: float) -> dict:
    return {
        "target": {"path": str(target)},
        "source": {"uri": str(conv)},
        "output": {"uri": str(out)},
        "capture": POINTS,
        "max_length": 512,
        "engine": {"dtype": "bfloat16", "device": "cpu"},
        "ray": {"num_actors": 1, "cpus_per_actor": cpus},
        "fingerprint": {"probe_samples": 8},
    }


def train_config(target: Path, out: Path, cpus: float, epochs: int, **data) -> dict:
    return {
        **data,
        "target": {"path": str(target)},
        "output": str(out),
        "draft_vocab_size": 2048,
        "batch_tokens": 2048,
        "epochs": epochs,
        "metrics_every": 4,
        "checkpoint": {"every": 10**6, "keep": 1},
        "eval_fraction": 0.0,
        "num_workers": 1,
        "cpus_per_worker": cpus,
        "resume": "none",
        "deepspeed": {"zero_stage": 2, "dtype": "float32"},
        "heldout_acceptance": {"prompts": 0},
        "export": {"engines": []},
    }


def offline(target: Path, conv: Path, work: Path, cpus: int, epochs: int) -> dict:
    ds, run = work / "offline-ds", work / "offline-run"
    shutil.rmtree(ds, ignore_errors=True)
    shutil.rmtree(run, ignore_errors=True)
    ex = run_cli("extract", extract_config(target, conv, ds, cpus), work)
    tr = run_cli("train", train_config(target, run, cpus, epochs, dataset=str(ds)), work)
    return {
        "wall_s": ex["wall_s"] + tr["wall_s"],
        "extract": ex,
        "train": tr,
        "bytes_written": du(ds, run),
        "data_bytes": du(ds),  # the hidden states (and their manifest, fingerprints)
    }


def streaming(target: Path, conv: Path, work: Path, cpus: int, epochs: int, cached: bool = False) -> dict:
    import yaml

    run, cache = work / "stream-run", work / "stream-cache"
    for d in (run, cache):
        shutil.rmtree(d, ignore_errors=True)
    x = work / "stream-extract.yaml"
    x.write_text(yaml.safe_dump(extract_config(target, conv, work / "unused", cpus / 2)))
    data = {"stream": str(x), **({"cache": str(cache)} if cached else {})}
    r = run_cli("train", train_config(target, run, cpus / 2, epochs, data=data), work)
    # the held-out samples, and the first epoch's batches when cached
    return {**r, "bytes_written": du(run, cache), "data_bytes": du(run / "data", cache)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["tiny", "mid"], default="mid")
    ap.add_argument("--conversations", type=int, default=100)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-cached", action="store_true", help="leave out run C (data.cache)")
    ap.add_argument("--work", default=None, help="directory for the target (cached) and outputs")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from pipeline.data.stdlib import write_conversations

    work = Path(a.work or Path(tempfile.gettempdir()) / "strata-bench-stream")
    work.mkdir(parents=True, exist_ok=True)
    cpus = os.cpu_count() or 2
    target = build_target(a.shape, work)
    conv = work / f"conversations-{a.conversations}.jsonl"
    write_conversations(conv, a.conversations)
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {"offline": [], "streaming": []} | ({} if a.no_cached else {"streaming_cached": []})
    for r in range(a.repeats):  # alternated, so drift in the machine hits all alike
        runs["offline"].append(offline(target, conv, work, cpus, a.epochs))
        runs["streaming"].append(streaming(target, conv, work, cpus, a.epochs))
        if "streaming_cached" in runs:
            runs["streaming_cached"].append(streaming(target, conv, work, cpus, a.epochs, cached=True))
        print(
            f"repeat {r}: "
            + ", ".join(
                f"{k} {v[-1]['wall_s']:.1f} s ({v[-1]['bytes_written'] / 1e6:.1f} MB written)" for k, v in runs.items()
            ),
            flush=True,
        )
    med = statistics.median
    walls = {k: [x["wall_s"] for x in v] for k, v in runs.items()}
    result = {
        "benchmark": "stream",
        "host": platform.node(),
        "cpu_count": cpus,
        "shape": a.shape,
        "conversations": a.conversations,
        "epochs": a.epochs,
        "repeats": a.repeats,
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
        "wall_s": {k: {"min": min(v), "median": med(v), "max": max(v), "runs": v} for k, v in walls.items()},
        "bytes_written": {k: runs[k][-1]["bytes_written"] for k in runs},
        "data_bytes": {k: runs[k][-1]["data_bytes"] for k in runs},
        "peak_rss_bytes": {
            "offline_extract": runs["offline"][-1]["extract"]["peak_rss_bytes"],
            "offline_train": runs["offline"][-1]["train"]["peak_rss_bytes"],
            **{k: runs[k][-1]["peak_rss_bytes"] for k in runs if k != "offline"},
        },
        "peak_total_rss_bytes": {
            "offline_extract": runs["offline"][-1]["extract"]["peak_total_rss_bytes"],
            "offline_train": runs["offline"][-1]["train"]["peak_total_rss_bytes"],
            **{k: runs[k][-1]["peak_total_rss_bytes"] for k in runs if k != "offline"},
        },
        "ratios": {
            r: v
            for k in runs
            if k != "offline"
            for r, v in {
                f"{k}_wall_over_offline": med(walls[k]) / med(walls["offline"]),
                f"{k}_bytes_over_offline": runs[k][-1]["bytes_written"] / runs["offline"][-1]["bytes_written"],
                f"{k}_data_bytes_over_offline": runs[k][-1]["data_bytes"] / runs["offline"][-1]["data_bytes"],
            }.items()
        },
        "runs": runs,
    }
    save_result(result, f"stream_{a.shape}_cpu.json", a.out)
    r = result["ratios"]
    for k in runs:
        if k != "offline":
            print(
                f"{k} / offline: wall {r[f'{k}_wall_over_offline']:.2f}, bytes written "
                f"{r[f'{k}_bytes_over_offline']:.3f} (data alone {r[f'{k}_data_bytes_over_offline']:.3f})"
            )


if __name__ == "__main__":
    main()
