"""The per-worker training loop: epochs of streamed batches through the trainer, a metrics
window every ``metrics_every`` steps and a checkpoint every ``checkpoint.every`` (the last
``checkpoint.keep`` kept).

Runs inside a Ray Train worker (``pipeline.train.job``) or in a plain process with
torch.distributed set up.
"""

from __future__ import annotations

import bisect
import json
import logging
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from pipeline.stopwatch import Stopwatch
from pipeline.store.fs import atomic_write_bytes, join, resolve
from pipeline.train.checkpoint import (
    CheckpointManager,
    LRSchedule,
    ModelWeights,
    OptimizerState,
    RNGState,
    TrainState,
)
from pipeline.train.data import BatchStream, SampleRef
from pipeline.train.metrics import MetricsLog, MetricsWindow
from pipeline.train.plan import RunPlan, plan_epoch
from pipeline.train.stream import FeedStream, StreamSample
from pipeline.train.trainer import Trainer, import_deepspeed
from schemas.train import TrainConfig

log = logging.getLogger(__name__)

FINAL_METRICS = "final_metrics.json"


def epoch_plans(plan: RunPlan, cfg: TrainConfig, world: int) -> tuple[list[list], list[int], int]:
    """Each epoch's batches, the step each epoch starts at, and the run's total steps.

    Epochs pack differently, so they can differ in step count: a step's epoch comes from the
    cumulative counts, never from step // len(first epoch)."""
    refs = train_refs(plan)
    plans = [plan_epoch(refs, cfg.batch_tokens, world, cfg.seed, e, packed=cfg.packing) for e in range(cfg.epochs)]
    epoch_start = [sum(len(p) for p in plans[:e]) for e in range(cfg.epochs + 1)]
    total = min(cfg.max_steps or 10**12, epoch_start[-1])
    if total == 0:
        raise ValueError(f"the training split has too few batches for {world} workers: add data or lower batch_tokens")
    return plans, epoch_start, total


def train_refs(plan: RunPlan) -> list[SampleRef] | list[StreamSample]:
    """The training samples: where they are in the dataset, or (streaming) in the stream."""
    cls = StreamSample if plan.extra.get("stream") else SampleRef
    return [cls(**r) for r in plan.train_refs]


def train_worker(plan_json: str, rank: int, world: int, report=None, stream_source=None) -> dict:
    """Train on this worker's share of the plan. ``report(metrics)`` forwards to Ray Train;
    ``stream_source``: a streaming run's :class:`~pipeline.train.stream.StreamSource`."""
    clock = Stopwatch()  # where the worker's time went, in final_metrics.json and the job's timing.json
    clock.start("setup")  # imports, DeepSpeed, the draft, the target head, a checkpoint to resume from
    deepspeed = import_deepspeed()
    plan = RunPlan(**json.loads(plan_json))
    cfg = TrainConfig.model_validate(plan.cfg)
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo" if not cfg.use_gpu else "nccl")
    torch.manual_seed(cfg.seed + rank)
    plans, epoch_start, total = epoch_plans(plan, cfg, world)
    trainer = Trainer(plan, cfg, total)
    barrier = dist.barrier if dist.is_initialized() else (lambda: None)
    window = MetricsWindow(cfg.ttt_steps, trainer.device)
    progress = TrainState()
    ckpt = CheckpointManager(
        cfg.output,
        cfg.s3,
        {
            "model": ModelWeights(trainer.engine),
            "optimizer": OptimizerState(trainer.engine),
            "lr_schedule": LRSchedule(trainer.scheduler),
            "rng": RNGState(),
            "train": progress,
            "metrics": window,
        },
        cfg.checkpoint.every,
        cfg.checkpoint.keep,
        rank,
        world,
        barrier,
        trainer.engine.zero_optimization_stage(),
    )
    if plan.resume_from:
        ckpt.load(plan.resume_from)
        if rank == 0:
            log.info("resumed from %s at step %d", plan.resume_from, progress.step)
    step = progress.step
    history = MetricsLog(cfg.output, cfg.s3, step if plan.resume_from else None)
    refs = train_refs(plan)
    if plan.extra.get("stream") and stream_source is None:
        raise ValueError("a streaming run's plan needs its stream_source (the capture actors and the samples' tokens)")

    def plan_step(g: int) -> list[int]:
        """This worker's samples at global step ``g``."""
        e = bisect.bisect_right(epoch_start, g) - 1
        return plans[e][g - epoch_start[e]][rank]

    clock.stop("setup")
    clock.start("steps")
    bar = tqdm(total=total, initial=step, desc="train", unit="step", disable=rank != 0)
    last: dict = {}
    fed = {"captured": 0, "from_cache": 0}  # a streaming run's batches by where they came from (this rank)
    while step < total:
        epoch = bisect.bisect_right(epoch_start, step) - 1
        if stream_source is not None:
            stream = FeedStream(
                stream_source, rank, step, min(epoch_start[epoch + 1], total), plan_step, cfg.stall_timeout_s, plans[0]
            )
        else:
            stream = BatchStream(
                cfg.dataset,
                cfg.s3,
                refs,
                plans[epoch],
                rank,
                step - epoch_start[epoch],
                trainer.aux,
                trainer.final,
                use_ray=plan.use_ray_data,
                stall_timeout_s=cfg.stall_timeout_s,
                packed=cfg.packing,
            )
        for _, batch in stream:
            t0 = time.perf_counter()
            out = trainer.step(batch)
            window.add(out, batch.tokens, time.perf_counter() - t0)
            step += 1
            bar.update(1)
            if step % cfg.metrics_every == 0 or step == total:
                last = window.close(stream.wait_s, step=step, epoch=epoch, lr=trainer.lr)
                if rank == 0:
                    history.append(last)
                    bar.set_postfix(
                        loss=f"{last['loss']:.3f}",
                        acc0=f"{last['acc_per_pos'][0]:.2f}",
                        tau=f"{last['sim_accept_len']:.2f}",
                    )
                if report:
                    report(last)
            if ckpt.due(step, total):
                progress.step, progress.epoch = step, epoch
                with clock("checkpoints"):
                    ckpt.save(step)
                if rank == 0:
                    history.flush()
            if step >= total:  # max_steps; otherwise the epoch's stream runs out on its own, so Ray
                break  # Data's executor finishes before the next epoch's starts
        window.wait_at_start -= stream.wait_s  # the next epoch's stream counts its waits from zero
        if isinstance(stream, FeedStream):
            fed["captured"] += stream.captured
            fed["from_cache"] += stream.from_cache
    bar.close()
    clock.stop("steps")
    with clock("eval"):
        evaluated = trainer.evaluate(rank, world)
    seconds = clock.totals()
    seconds["steps"] -= seconds.get("checkpoints", 0.0)
    final_metrics = {"train": last, "eval": evaluated, "steps": step, "seconds": seconds}
    if stream_source is not None:
        final_metrics["stream_batches"] = fed
    if rank == 0:
        fs, root = resolve(cfg.output, cfg.s3)
        atomic_write_bytes(fs, join(root, FINAL_METRICS), json.dumps(final_metrics, indent=1).encode())
    return final_metrics
