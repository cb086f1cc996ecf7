"""The per-worker training loop: DeepSpeed step over streamed batches, metrics, checkpoints.

Distributed plumbing only; the math is in ``pipeline.draft.model``. Runs inside a Ray Train
worker (``pipeline.train.trainer``) or in a plain process with torch.distributed set up.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from tqdm import tqdm

from pipeline.draft.model import DraftConfig, Eagle3Draft, init_weights, simulated_acceptance_length
from pipeline.draft.target_head import TargetHead, load_embedding
from pipeline.store.fs import atomic_write_bytes, join, read_bytes, resolve
from pipeline.train import checkpoint
from pipeline.train.data import Batch, BatchStream, SampleRef, plan_epoch
from schemas.capture import CapturePoint
from schemas.config import TrainConfig

log = logging.getLogger(__name__)



@dataclass
class RunPlan:
    """Everything the driver decided before launching workers (JSON-serialisable)."""

    cfg: dict
    draft: dict                    # DraftConfig fields
    aux: list[str]                 # aux capture points, slot order
    final: str                     # final capture point in the dataset
    final_needs_norm: bool         # final is pre-norm: apply the target's norm
    train_refs: list[dict]
    eval_refs: list[dict]
    resume_from: str | None = None
    use_ray_data: bool = True
    extra: dict = field(default_factory=dict)


def lr_lambda(step: int, warmup: int, total: int, min_ratio: float) -> float:
    if step < warmup:
        return (step + 1) / max(warmup, 1)
    progress = min(1.0, (step - warmup) / max(total - warmup, 1))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


PLAN_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping", "train_batch_size")


def ds_config(cfg: TrainConfig) -> dict:
    out = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": {"stage": cfg.deepspeed.zero_stage},
        "bf16": {"enabled": cfg.deepspeed.dtype == "bfloat16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if cfg.deepspeed.config_file:
        extra = json.loads(Path(cfg.deepspeed.config_file).read_text())
        clash = sorted(k for k in extra if k in PLAN_KEYS)
        if clash:
            raise ValueError(f"{cfg.deepspeed.config_file}: {clash} are set by Strata's training plan "
                             "(batch_tokens, optim.grad_clip); remove them from the DeepSpeed file")
        stage = extra.get("zero_optimization", {}).get("stage", cfg.deepspeed.zero_stage)
        if stage != cfg.deepspeed.zero_stage:
            raise ValueError(f"{cfg.deepspeed.config_file}: zero_optimization.stage {stage} disagrees with "
                             f"deepspeed.zero_stage {cfg.deepspeed.zero_stage} (checkpoints record the stage)")
        for k, v in extra.items():
            out[k] = {**out[k], **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def build_model(plan: RunPlan, cfg: TrainConfig, device: torch.device) -> Eagle3Draft:
    model = Eagle3Draft(DraftConfig(**plan.draft))
    init_weights(model, seed=cfg.seed)
    model.embed_tokens.weight.data.copy_(load_embedding(cfg.target.path))
    fs, root = resolve(cfg.output, cfg.s3)
    vocab_local = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"strata-vocab-{os.getpid()}.safetensors")
    with open(vocab_local, "wb") as f:
        f.write(read_bytes(fs, join(root, "vocab.safetensors")))
    v = load_file(vocab_local)
    model.d2t.copy_(v["d2t"])
    model.t2d.copy_(v["t2d"])
    if cfg.init_from:  # warm start (checked against this run in trainer.prepare)
        from pipeline.draft.export import WEIGHTS

        start = load_file(os.path.join(cfg.init_from, WEIGHTS))
        missing, unexpected = model.load_state_dict(start, strict=False)
        if unexpected or not set(missing) <= {"embed_tokens.weight", "d2t"}:
            raise ValueError(f"init_from {cfg.init_from}: weights do not fit: missing {missing}, unexpected {unexpected}")
    return model.to(device)


class Metrics:
    """Per-TTT-position sums, all-reduced across workers when logged."""

    def __init__(self, steps: int):
        self.reset(steps)

    def reset(self, steps: int) -> None:
        self.loss = torch.zeros(steps, dtype=torch.float64)
        self.correct = torch.zeros(steps, dtype=torch.float64)
        self.counted = torch.zeros(steps, dtype=torch.float64)
        self.n = 0
        self.tokens = 0

    def add(self, out, tokens: int) -> None:
        self.loss += out.step_loss.double().cpu()
        self.correct += out.correct.double().cpu()
        self.counted += out.counted.double().cpu()
        self.n += 1
        self.tokens += tokens

    def reduce(self) -> dict:
        t = torch.cat([self.loss, self.correct, self.counted, torch.tensor([self.n, self.tokens], dtype=torch.float64)])
        if dist.is_initialized():
            dist.all_reduce(t)
        s = self.loss.numel()
        loss, correct, counted, (n, tokens) = t[:s], t[s : 2 * s], t[2 * s : 3 * s], t[3 * s :].tolist()
        acc = (correct / counted.clamp(min=1)).tolist()
        return {
            "loss": float(loss.sum() / max(n, 1)), "loss_per_pos": (loss / max(n, 1)).tolist(),
            "acc_per_pos": acc, "sim_accept_len": simulated_acceptance_length(acc), "tokens": int(tokens),
        }


def train_worker(plan_json: str, rank: int, world: int, report=None) -> dict:
    """Train on this worker's share of the plan. ``report(metrics)`` forwards to Ray Train."""
    import deepspeed

    plan = RunPlan(**json.loads(plan_json))
    cfg = TrainConfig.model_validate(plan.cfg)
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo" if not cfg.use_gpu else "nccl")
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.use_gpu and torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(cfg.seed + rank)
    model = build_model(plan, cfg, device)
    refs = [SampleRef(**r) for r in plan.train_refs]
    plans = [plan_epoch(refs, cfg.batch_tokens, world, cfg.seed, e) for e in range(cfg.epochs)]
    # Epochs pack differently, so they can differ in step count: a step's epoch comes from the
    # cumulative counts, never from step // len(first epoch).
    epoch_start = [sum(len(p) for p in plans[:e]) for e in range(cfg.epochs + 1)]
    total = min(cfg.max_steps or 10**12, epoch_start[-1])
    if total == 0:
        raise ValueError(f"the training split has too few batches for {world} workers: add data or lower batch_tokens")

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=cfg.optim.betas, weight_decay=cfg.optim.weight_decay)
    engine, _, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, config=ds_config(cfg),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: lr_lambda(s, cfg.optim.warmup_steps, total, cfg.optim.min_lr_ratio)),
    )
    compute_dtype = torch.bfloat16 if cfg.deepspeed.dtype == "bfloat16" else torch.float32
    head = TargetHead(cfg.target.path, needs_norm=plan.final_needs_norm).to(device)
    draft_ids = torch.nonzero(model.t2d).squeeze(-1).to(device)

    step = 0
    if plan.resume_from:
        state = checkpoint.load(engine, cfg.output, cfg.s3, plan.resume_from, rank, world)
        step = state["step"]
        scheduler.last_epoch = step - 1
        with warnings.catch_warnings():  # stepping the schedule to `step` before any optimizer step is intended
            warnings.simplefilter("ignore", UserWarning)
            scheduler.step()
        if rank == 0:
            log.info("resumed from %s at step %d", plan.resume_from, step)

    fs, root = resolve(cfg.output, cfg.s3)
    metrics_lines: list[str] = []
    if plan.resume_from and rank == 0:
        try:
            metrics_lines = read_bytes(fs, join(root, "metrics.jsonl")).decode().splitlines()
            metrics_lines = [ln for ln in metrics_lines if json.loads(ln).get("step", 0) <= step]
        except (OSError, FileNotFoundError):
            metrics_lines = []
    m = Metrics(cfg.ttt_steps)
    bar = tqdm(total=total, initial=step, desc="train", unit="step", disable=rank != 0)
    compute_s = 0.0
    t_window = time.perf_counter()
    aux = [CapturePoint.parse(p) for p in plan.aux]
    final = CapturePoint.parse(plan.final)
    barrier = dist.barrier if dist.is_initialized() else (lambda: None)
    last: dict = {}
    while step < total:
        epoch = bisect.bisect_right(epoch_start, step) - 1
        stream = BatchStream(cfg.dataset, cfg.s3, refs, plans[epoch], rank, step - epoch_start[epoch], aux, final,
                             use_ray=plan.use_ray_data)
        wait_before = 0.0
        for _, batch in stream:
            t0 = time.perf_counter()
            out = forward(engine, head, draft_ids, batch, cfg, device, compute_dtype)
            engine.backward(out.loss)
            engine.step()
            compute_s += time.perf_counter() - t0
            m.add(out, batch.tokens)
            step += 1
            bar.update(1)
            if rank == 0 and step == plan.extra.get("fault_crash_after_step"):
                log.error("fault injection: rank 0 dies after step %d", step)
                os._exit(17)
            if step % cfg.metrics_every == 0 or step == total:
                wall = time.perf_counter() - t_window
                wait = stream.wait_s - wait_before
                wait_before = stream.wait_s
                r = m.reduce()
                last = {"step": step, "epoch": epoch, "lr": scheduler.get_last_lr()[0], **r,
                        "tokens_per_s": r["tokens"] / max(wall, 1e-9),
                        "data_wait_fraction": wait / max(wall, 1e-9), "compute_fraction": compute_s / max(wall, 1e-9)}
                m.reset(cfg.ttt_steps)
                compute_s = 0.0
                t_window = time.perf_counter()
                if rank == 0:
                    metrics_lines.append(json.dumps(last))
                    bar.set_postfix(loss=f"{last['loss']:.3f}", acc0=f"{last['acc_per_pos'][0]:.2f}",
                                    tau=f"{last['sim_accept_len']:.2f}")
                if report:
                    report(last)
            if step % cfg.checkpoint_every == 0 or step == total:
                checkpoint.save(engine, cfg.output, cfg.s3, step, epoch, rank, world, barrier)
                if rank == 0:
                    atomic_write_bytes(fs, join(root, "metrics.jsonl"), ("\n".join(metrics_lines) + "\n").encode())
            if step >= total:  # max_steps; otherwise the epoch's stream runs out on its own, so Ray
                break          # Data's executor finishes before the next epoch's starts
    bar.close()
    ev = evaluate(engine, head, draft_ids, plan, cfg, rank, world, device, compute_dtype)
    final_metrics = {"train": last, "eval": ev, "steps": step}
    if rank == 0:
        atomic_write_bytes(fs, join(root, "final_metrics.json"), json.dumps(final_metrics, indent=1).encode())
    return final_metrics


def forward(engine, head: TargetHead, draft_ids, batch: Batch, cfg: TrainConfig, device, dtype):
    b = Batch(*(t.to(device) for t in (batch.aux, batch.final, batch.input_ids, batch.loss_mask)))
    target = head.targets(b.final, b.loss_mask, draft_ids, soft_target=cfg.soft_target)
    return engine(b.aux.to(dtype), b.input_ids, target, steps=cfg.ttt_steps, decay=cfg.loss_decay)


@torch.no_grad()
def evaluate(engine, head, draft_ids, plan: RunPlan, cfg: TrainConfig, rank: int, world: int, device, dtype) -> dict:
    refs = [SampleRef(**r) for r in plan.eval_refs]
    if not refs:
        return {}
    batches = plan_epoch(refs, cfg.batch_tokens, 1, cfg.seed, 0)
    mine = [[b[0]] for i, b in enumerate(batches) if i % world == rank]
    m = Metrics(cfg.ttt_steps)
    engine.eval()
    stream = BatchStream(cfg.dataset, cfg.s3, refs, mine, 0, 0, [CapturePoint.parse(p) for p in plan.aux],
                         CapturePoint.parse(plan.final), use_ray=False)
    for _, batch in stream:
        m.add(forward(engine, head, draft_ids, batch, cfg, device, dtype), batch.tokens)
    engine.train()
    return m.reduce()
