"""The training job a user runs (DeepSpeed on Ray Train), next to a plain-torch loop on the same batches.

On one dataset extracted from a target of the mid shape (hidden 1024, 8 layers, vocab 32K):

A. job: ``python -m pipeline.cli train --config ...`` -- Ray Train, one worker holding every CPU,
   decoding its own batches ahead (``data_loading: worker``); and again with ``ray_data`` loading
   (Ray Data decode tasks; the worker leaves them a quarter CPU). Steady-state throughput is
   the median of the metrics windows after the first (the first holds start-up: the first
   batch's decode, DeepSpeed's first step); the whole wall time is reported too.
B. plain: the same draft, the same target head, the same batches already decoded in memory,
   plain torch (AdamW, grad clip, the same LR schedule), the same number of torch threads.
C. deepspeed: the job's own Trainer (DeepSpeed ZeRO-2) on those in-memory batches, in this
   process -- no Ray, no data loading: what DeepSpeed alone costs.
D. plain process: B as a whole script in a fresh process (imports, verifying and decoding the
   data, building the draft, the steps, exit), timed from outside like A, its steps timed in
   windows of ``metrics_every`` as the job times its own. Fixed cost = wall time minus the steps'
   tokens at the run's steady throughput (both: the median window after the first, so the first
   large batches' warm-up -- the process's memory being faulted in -- is fixed cost on both
   sides); the job's fixed cost beyond D's is what Strata adds to every run.

Runs alternate (B, C, D, A, A with ray_data) per repeat; min/median/max and the machine's load are saved.
With ``--profile-cpu``, D and A also record who used the machine's cores while their trainer computed
(every process from /proc, the trainer's threads by name): the job's own process, Ray's daemons, idle.

    python tests/benchmarks/bench_train_job.py
    python tests/benchmarks/bench_train_job.py --shape tiny --conversations 40 --repeats 1   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

from _cpu import CpuSampler  # noqa: E402
from _results import save_result  # noqa: E402
from bench_extract import build_target  # noqa: E402
from bench_extract_job import run_cli, run_script, spread  # noqa: E402


def dataset(target: Path, work: Path, n: int) -> Path:
    """The target's hidden states for n conversations, extracted once (in-process) and cached."""
    out = work / f"ds-train-{n}"
    if (out / "manifest.json").exists():
        return out
    from pipeline.data.stdlib import write_conversations
    from pipeline.extract.job import run_extract
    from schemas.extract import ExtractConfig

    write_conversations(work / f"train-conversations-{n}.jsonl", n)
    run_extract(
        ExtractConfig.model_validate(
            {
                "target": {"path": str(target)},
                "source": {"uri": str(work / f"train-conversations-{n}.jsonl")},
                "output": {"uri": str(out)},
                "engine": {"dtype": "bfloat16", "device": "cpu"},
                "fingerprint": {"probe_samples": 0},
            }
        ),
        progress=False,
        use_ray=False,
    )
    return out


def train_config(target: Path, ds: Path, out: Path, cpus: int, steps: int, loading: str = "worker") -> dict:
    """One worker holding every CPU (with ray_data loading: all but the decode task's quarter)."""
    return {
        "dataset": str(ds),
        "target": {"path": str(target)},
        "output": str(out),
        "draft_vocab_size": 2048,
        "batch_tokens": 2048,
        "epochs": 100,
        "max_steps": steps,
        "metrics_every": 4,
        "checkpoint": {"every": 10**6},
        "eval_fraction": 0.0,
        "num_workers": 1,
        "data_loading": loading,
        "cpus_per_worker": cpus - 0.25 if loading == "ray_data" else cpus,
        "resume": "none",
        "deepspeed": {"zero_stage": 2, "dtype": "float32"},
        "heldout_acceptance": {"prompts": 0},
        "export": {"engines": []},
    }


# What the CPU profile calls each process of a run (the rest by its Ray role, or "other").
ROLES = {"_WorkerProcess": "job: training worker", "pipeline.cli": "job: driver", "--plain-process": "plain script"}


def profiled(run, trainer: str | None):
    """``run()``, and with ``trainer`` (a ROLES marker) the cores each process used while the trainer
    computed (the intervals it used >= 1.2 cores, the first fifth left out as warm-up), else None."""
    if not trainer:
        return run(), None
    with CpuSampler(interval=1.0, threads_of=trainer) as cpu:
        out = run()
    return out, cpu.busy_phase(ROLES, ROLES[trainer], min_cores=1.2)


def run_job(cfg: dict, work: Path, profile: bool = False) -> dict:
    wall, cpu = profiled(lambda: run_cli("train", cfg, work), profile and "_WorkerProcess")
    windows = [json.loads(x) for x in (Path(cfg["output"]) / "metrics.jsonl").read_text().splitlines()]
    steady = windows[1:] or windows
    return {
        "wall_s": wall,
        "steps": windows[-1]["step"],
        "tokens_per_s": statistics.median(w["tokens_per_s"] for w in steady),
        "first_window_tokens_per_s": windows[0]["tokens_per_s"],
        "steps_s": steps_seconds(windows),
        "timing": json.loads((Path(cfg["output"]) / "timing.json").read_text()),  # where the job says it went
        "data_wait_fraction": statistics.median(w["data_wait_fraction"] for w in steady),
        "first_window_data_wait_fraction": windows[0]["data_wait_fraction"],
        "compute_fraction": statistics.median(w["compute_fraction"] for w in steady),
        **({"cpu_while_training": cpu} if cpu else {}),
    }


def steps_seconds(windows: list[dict]) -> float:
    """The seconds the run spent in its training steps: its metrics windows cover every step."""
    return sum(w["tokens"] / w["tokens_per_s"] for w in windows)


class InProcess:
    """The plain loop and DeepSpeed alone, on batches decoded once into memory."""

    def __init__(self, cfg: dict, threads: int):
        import torch

        from pipeline.train.data import BatchStream, SampleRef
        from pipeline.train.job import prepare
        from pipeline.train.loop import epoch_plans
        from schemas.train import TrainConfig

        torch.set_num_threads(threads)
        self.cfg = TrainConfig.model_validate(cfg)
        self.plan = prepare(self.cfg)
        plans, _, self.total = epoch_plans(self.plan, self.cfg, 1)
        refs = [SampleRef(**r) for r in self.plan.train_refs]
        from schemas.capture import CapturePoint

        aux, final = [CapturePoint.parse(p) for p in self.plan.aux], CapturePoint.parse(self.plan.final)
        self.batches = []
        for epoch_plan in plans:
            stream = BatchStream(
                self.cfg.dataset, None, refs, epoch_plan, 0, 0, aux, final, use_ray=False, packed=self.cfg.packing
            )
            for _, b in stream:
                self.batches.append(b)
                if len(self.batches) == self.total:
                    break
            if len(self.batches) == self.total:
                break
        self.tokens = sum(b.tokens for b in self.batches)

    def plain(self) -> float:
        """Plain torch: same model, head, schedule and batches; tokens/s after one warm-up step."""
        return self._timed(self.plain_step())

    def plain_windows(self, every: int) -> list[dict]:
        """The plain loop timed as the job times itself: a window of ``every`` steps, from the first."""
        step, windows = self.plain_step(), []
        for i in range(0, len(self.batches), every):
            t0 = time.perf_counter()
            for b in self.batches[i : i + every]:
                step(b)
            tokens = sum(b.tokens for b in self.batches[i : i + every])
            windows.append({"tokens": tokens, "tokens_per_s": tokens / (time.perf_counter() - t0)})
        return windows

    def plain_step(self):
        """One plain-torch training step on a batch, on a fresh draft and optimizer."""
        import torch

        from pipeline.draft.target_head import TargetHead
        from pipeline.train.trainer import build_model, lr_lambda

        cfg, o = self.cfg, self.cfg.optim
        model = build_model(self.plan, cfg, torch.device("cpu"))
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: lr_lambda(s, o.warmup_steps, self.total, o.min_lr_ratio)
        )
        target_head = TargetHead(cfg.target.path, needs_norm=self.plan.final_needs_norm)
        draft_ids = torch.nonzero(model.t2d).squeeze(-1)

        def step(b) -> None:
            target = target_head.targets(b.final, b.loss_mask, draft_ids, soft_target=cfg.soft_target)
            out = model(
                b.aux.to(torch.float32),
                b.input_ids,
                target,
                steps=cfg.ttt_steps,
                decay=cfg.loss_decay,
                seq_lens=b.seq_lens.tolist(),
            )
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
            opt.step()
            sched.step()

        return step

    def deepspeed(self) -> float:
        import torch.distributed as dist

        from pipeline.train.job import init_single_process
        from pipeline.train.trainer import Trainer, import_deepspeed

        if not dist.is_initialized():
            init_single_process()
            import_deepspeed().init_distributed(dist_backend="gloo")
        trainer = Trainer(self.plan, self.cfg, self.total)
        return self._timed(trainer.step)

    def _timed(self, step) -> float:
        step(self.batches[0])  # warm-up (the job's first window holds its own)
        t0 = time.perf_counter()
        for b in self.batches[1:]:
            step(b)
        return (self.tokens - self.batches[0].tokens) / (time.perf_counter() - t0)


def plain_process(cfg: dict, work: Path, threads: int, profile: bool = False) -> dict:
    """D: the plain loop as a script of its own; its wall seconds and steady tokens/s."""
    path = work / "plain-process.json"
    path.write_text(json.dumps(cfg))
    argv = [__file__, "--plain-process", str(path), "--threads", str(threads)]
    out, cpu = profiled(lambda: run_script(argv, "the plain process", 3600), profile and "--plain-process")
    return {**out, **({"cpu_while_training": cpu} if cpu else {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["tiny", "mid"], default="mid")
    ap.add_argument("--conversations", type=int, default=200)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", default=None, help="directory for the target and dataset (cached) and outputs")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--loadings",
        default="worker,ray_data",
        help="the job's data loadings to time, comma-separated (worker, ray_data)",
    )
    ap.add_argument(
        "--profile-cpu",
        action="store_true",
        help="sample every process's CPU (/proc, 1 s) during the plain script and the job: who used the cores",
    )
    ap.add_argument("--plain-process", default=None, help=argparse.SUPPRESS)  # D's own process: a config file
    ap.add_argument("--threads", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.plain_process:
        local = InProcess(json.loads(Path(a.plain_process).read_text()), a.threads)
        windows = local.plain_windows(local.cfg.metrics_every)
        steady = windows[1:] or windows  # exactly as run_job reads the job's metrics windows
        print(
            json.dumps(
                {
                    "tokens_per_s": statistics.median(w["tokens_per_s"] for w in steady),
                    "first_window_tokens_per_s": windows[0]["tokens_per_s"],
                    "tokens": local.tokens,
                    "steps_s": steps_seconds(windows),
                }
            )
        )
        return
    loadings = a.loadings.split(",")
    if not loadings or not set(loadings) <= {"worker", "ray_data"}:
        ap.error(f"--loadings {a.loadings!r}: pick from worker, ray_data")
    work = Path(a.work or Path(tempfile.gettempdir()) / "strata-bench-train-job")
    work.mkdir(parents=True, exist_ok=True)
    cpus = os.cpu_count() or 2
    target = build_target(a.shape, work)
    ds = dataset(target, work, a.conversations)
    threads = max(1, round(cpus - 0.25))  # what the job's worker computes with

    def cfg(tag: str, loading: str = "worker") -> dict:
        out = Path(tempfile.mkdtemp(prefix=f"run-{tag}-", dir=work))
        return train_config(target, ds, out, cpus, a.steps, loading)

    local = InProcess(cfg("local"), threads)
    load_before = os.getloadavg()
    plain, ds_alone, jobs, ray_data_jobs, processes = [], [], [], [], []
    for r in range(a.repeats):  # alternated, so drift in the machine hits all alike
        plain.append(local.plain())
        ds_alone.append(local.deepspeed())
        processes.append(plain_process(cfg(f"p{r}"), work, threads, a.profile_cpu))
        if "worker" in loadings:
            jobs.append(run_job(cfg(f"r{r}"), work, a.profile_cpu))
        if "ray_data" in loadings:
            ray_data_jobs.append(run_job(cfg(f"rd{r}", "ray_data"), work, a.profile_cpu))
        print(
            f"repeat {r}: plain {plain[-1]:.0f} tok/s, deepspeed {ds_alone[-1]:.0f}, "
            f"plain process {processes[-1]['wall_s']:.1f} s"
            + "".join(
                f", {name} {runs[-1]['tokens_per_s']:.0f}"
                for name, runs in (("job", jobs), ("job with ray_data loading", ray_data_jobs))
                if runs
            ),
            flush=True,
        )
    med = statistics.median
    timed = {name: runs for name, runs in (("job", jobs), ("job_ray_data_loading", ray_data_jobs)) if runs}
    for p in processes:  # the same steps at its own steady rate; the rest of its wall is fixed
        p["fixed_s"] = p["wall_s"] - p["tokens"] / p["tokens_per_s"]
        p["outside_steps_s"] = p["wall_s"] - p["steps_s"]
    for runs in timed.values():
        for j in runs:
            j["fixed_s"] = j["wall_s"] - local.tokens / j["tokens_per_s"]
            j["outside_steps_s"] = j["wall_s"] - j["steps_s"]
    plain_fixed = med(p["fixed_s"] for p in processes)
    plain_outside = med(p["outside_steps_s"] for p in processes)
    result = {
        "benchmark": "train_job",
        "host": platform.node(),
        "cpu_count": cpus,
        "shape": a.shape,
        "conversations": a.conversations,
        "steps": a.steps,
        "tokens_per_step": local.tokens / len(local.batches),
        "torch_threads": threads,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "plain_tokens_per_s": spread(plain),
        "deepspeed_tokens_per_s": spread(ds_alone),
        "plain_process_wall_s": spread([p["wall_s"] for p in processes]),
        "plain_process_fixed_s": spread([p["fixed_s"] for p in processes]),
        "plain_process_outside_steps_s": spread([p["outside_steps_s"] for p in processes]),
        "plain_process_runs": processes,
        **{f"{name}_fixed_s": spread([j["fixed_s"] for j in runs]) for name, runs in timed.items()},
        **{f"{name}_outside_steps_s": spread([j["outside_steps_s"] for j in runs]) for name, runs in timed.items()},
        **{f"{name}_tokens_per_s": spread([j["tokens_per_s"] for j in runs]) for name, runs in timed.items()},
        **{f"{name}_wall_s": spread([j["wall_s"] for j in runs]) for name, runs in timed.items()},
        **{f"{name}_windows": runs for name, runs in timed.items()},
        "ratios": {
            **{f"{name}_over_plain": med(j["tokens_per_s"] for j in runs) / med(plain) for name, runs in timed.items()},
            "deepspeed_over_plain": med(ds_alone) / med(plain),
            # the same steady windows of a fresh process (D): no warm heap from earlier repeats, as the job has none
            **{
                f"{name}_over_plain_process": med(j["tokens_per_s"] for j in runs)
                / med(p["tokens_per_s"] for p in processes)
                for name, runs in timed.items()
            },
            **{
                f"{name}_fixed_beyond_plain_process_s": med(j["fixed_s"] for j in runs) - plain_fixed
                for name, runs in timed.items()
            },
            # the same, read without a steady rate: wall minus the seconds inside the steps
            **{
                f"{name}_outside_steps_beyond_plain_process_s": med(j["outside_steps_s"] for j in runs) - plain_outside
                for name, runs in timed.items()
            },
            **{
                f"plain_process_wall_over_{name}_wall": med(p["wall_s"] for p in processes)
                / med(j["wall_s"] for j in runs)
                for name, runs in timed.items()
            },
            **(
                {
                    "job_over_deepspeed": med(j["tokens_per_s"] for j in jobs) / med(ds_alone),
                    # what a user pays for the whole run against the plain loop's compute for the same steps
                    "plain_compute_over_job_wall": (a.steps * local.tokens / len(local.batches) / med(plain))
                    / med(j["wall_s"] for j in jobs),
                }
                if jobs
                else {}
            ),
        },
        "note": "job: python -m pipeline.cli train (1 worker: one Ray actor), steady state = median of "
        "metrics windows after the first; plain and deepspeed: same batches decoded in memory, this process, "
        "same torch threads; plain process: the plain loop as its own script, timed from outside; fixed = wall "
        "minus the steps' tokens at the run's steady rate; outside_steps = wall minus the seconds inside the "
        "steps (the metrics windows), which steady-rate noise does not move; the job's wall includes imports, "
        "Ray start, vocab, verification, export off.",
    }
    save_result(result, f"train_job_{a.shape}_cpu.json", a.out)


if __name__ == "__main__":
    main()
