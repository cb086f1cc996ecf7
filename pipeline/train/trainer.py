"""The trainer: the draft, its DeepSpeed engine and LR schedule, and what one step does.

Distributed plumbing only; the math is in ``pipeline.draft.model``. The loop that drives it
over epochs is ``pipeline.train.loop``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from safetensors.torch import load, load_file

from pipeline.draft.export import WEIGHTS
from pipeline.draft.model import DraftConfig, Eagle3Draft, init_weights
from pipeline.draft.target_head import TargetHead, load_embedding
from pipeline.dtypes import torch_dtype
from pipeline.store.fs import join, read_bytes, resolve
from pipeline.train.data import Batch, BatchStream, SampleRef
from pipeline.train.metrics import StepSums
from pipeline.train.plan import RunPlan, plan_epoch
from schemas.capture import CapturePoint
from schemas.train import TrainConfig

PLAN_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping", "train_batch_size")


def import_deepspeed():
    """DeepSpeed, minus the CPU shared-memory all-reduce it compiles with the C++ compiler
    whenever it sets up communication on CPU (25 s on a machine's first run, ~1 s to load
    after): only its inference all-reduce uses that op; training reduces through gloo or NCCL."""
    import importlib

    import deepspeed

    # The module, not ``deepspeed.comm``'s attribute ``torch`` (which is torch itself); the
    # function is looked up there when DeepSpeed creates its communication backend.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = _no_shm_op
    return deepspeed


def _no_shm_op() -> None:
    return None


def lr_lambda(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup, then cosine decay to ``min_ratio`` of the peak rate."""
    if step < warmup:
        return (step + 1) / max(warmup, 1)
    progress = min(1.0, (step - warmup) / max(total - warmup, 1))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def ds_config(cfg: TrainConfig) -> dict:
    """DeepSpeed's config: Strata's plan, merged with the user's file where they do not clash."""
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
            raise ValueError(
                f"{cfg.deepspeed.config_file}: {clash} are set by Strata's training plan "
                "(batch_tokens, optim.grad_clip); remove them from the DeepSpeed file"
            )
        stage = extra.get("zero_optimization", {}).get("stage", cfg.deepspeed.zero_stage)
        if stage != cfg.deepspeed.zero_stage:
            raise ValueError(
                f"{cfg.deepspeed.config_file}: zero_optimization.stage {stage} disagrees with "
                f"deepspeed.zero_stage {cfg.deepspeed.zero_stage} (checkpoints record the stage)"
            )
        for k, v in extra.items():
            out[k] = {**out[k], **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def build_model(plan: RunPlan, cfg: TrainConfig, device: torch.device) -> Eagle3Draft:
    """A fresh (or warm-started) draft with the target's embedding and the run's draft vocab."""
    model = Eagle3Draft(DraftConfig(**plan.draft))
    init_weights(model, seed=cfg.seed)
    model.embed_tokens.weight.data.copy_(load_embedding(cfg.target.path))
    fs, root = resolve(cfg.output, cfg.s3)
    v = load(read_bytes(fs, join(root, "vocab.safetensors")))
    model.d2t.copy_(v["d2t"])
    model.t2d.copy_(v["t2d"])
    if cfg.init_from:  # warm start (checked against this run in job.prepare)
        start = load_file(os.path.join(cfg.init_from, WEIGHTS))
        missing, unexpected = model.load_state_dict(start, strict=False)
        if unexpected or not set(missing) <= {"embed_tokens.weight", "d2t"}:
            raise ValueError(
                f"init_from {cfg.init_from}: weights do not fit: missing {missing}, unexpected {unexpected}"
            )
    return model.to(device)


class Trainer:
    """Owns the DeepSpeed engine over the draft, the frozen target head and the LR schedule."""

    def __init__(self, plan: RunPlan, cfg: TrainConfig, total_steps: int):
        deepspeed = import_deepspeed()
        self.plan, self.cfg = plan, cfg
        use_cuda = cfg.use_gpu and torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        model = build_model(plan, cfg, self.device)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            params, lr=cfg.optim.lr, betas=cfg.optim.betas, weight_decay=cfg.optim.weight_decay
        )
        o = cfg.optim
        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            config=ds_config(cfg),
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
                opt, lambda s: lr_lambda(s, o.warmup_steps, total_steps, o.min_lr_ratio)
            ),
        )
        self.dtype = torch_dtype(cfg.deepspeed.dtype)
        self.head = TargetHead(cfg.target.path, needs_norm=plan.final_needs_norm).to(self.device)
        self.draft_ids = torch.nonzero(model.t2d).squeeze(-1).to(self.device)
        self.aux = [CapturePoint.parse(p) for p in plan.aux]
        self.final = CapturePoint.parse(plan.final)

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def forward(self, batch: Batch):
        b = batch.to(self.device)
        target = self.head.targets(b.final, b.loss_mask, self.draft_ids, soft_target=self.cfg.soft_target)
        return self.engine(
            b.aux.to(self.dtype),
            b.input_ids,
            target,
            steps=self.cfg.ttt_steps,
            decay=self.cfg.loss_decay,
            seq_lens=b.seq_lens.tolist(),
        )

    def step(self, batch: Batch):
        """Forward, backward, optimizer and schedule step; returns the draft's output."""
        out = self.forward(batch)
        self.engine.backward(out.loss)
        self.engine.step()
        return out

    @torch.no_grad()
    def evaluate(self, rank: int, world: int) -> dict:
        """The held-out split's metrics (each rank takes every world-th batch), reduced."""
        refs = [SampleRef(**r) for r in self.plan.eval_refs]
        if not refs:
            return {}
        packed = self.cfg.packing
        batches = plan_epoch(refs, self.cfg.batch_tokens, 1, self.cfg.seed, 0, packed=packed)
        mine = [[b[0]] for i, b in enumerate(batches) if i % world == rank]
        sums = StepSums(self.cfg.ttt_steps, self.device)
        self.engine.eval()
        stream = BatchStream(
            self.cfg.dataset, self.cfg.s3, refs, mine, 0, 0, self.aux, self.final, use_ray=False, packed=packed
        )
        for _, batch in stream:
            sums.add(self.forward(batch), batch.tokens)
        self.engine.train()
        return sums.reduce()
