"""Checkpoints without pickle: safetensors for tensors, JSON for the rest.

Layout under ``<run>/checkpoints/step-NNNNNN/``:
    model.safetensors          full draft weights (rank 0; excludes the frozen embedding)
    rank-R.safetensors         rank R's fp32 master partition, Adam moments, RNG state
    state.json                 step, epoch, world size, ZeRO stage, LR schedule (rank 0)
and ``<run>/checkpoints/latest.json`` points at the last complete one; it is written by
rank 0 after every rank has published its file, so it is the commit point.

DeepSpeed's own save_checkpoint pickles; this reads and writes its ZeRO-1/2/3 optimizer
partitions directly (through :func:`zero_partitions`, the one place that touches DeepSpeed
internals), so resume needs the same world size and ZeRO stage.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from pipeline.store.fs import atomic_write_bytes, exists, join, read_bytes, resolve

LATEST = "latest.json"


@dataclass
class ZeroPartitions:
    """This rank's share of a DeepSpeed ZeRO optimizer: the fp32 master partitions (one per
    param group), the bf16/fp16 copies ZeRO-3 computes with (None below stage 3, where the
    module's own parameters are restored instead), and the torch optimizer whose state is
    keyed by the fp32 partitions."""

    fp32: list[torch.Tensor]
    low_precision: list[torch.Tensor] | None
    inner: torch.optim.Optimizer


def zero_partitions(engine) -> ZeroPartitions:
    """DeepSpeed has no public API for a ZeRO optimizer's partitions, so this is the one function
    that reads its private attributes; ``test_zero_partitions_match_deepspeed`` fails when a
    DeepSpeed release renames them."""
    opt = engine.optimizer
    if hasattr(opt, "single_partition_of_fp32_groups"):      # ZeRO 1/2
        return ZeroPartitions(list(opt.single_partition_of_fp32_groups), None, opt.optimizer)
    if hasattr(opt, "fp32_partitioned_groups_flat"):         # ZeRO 3
        return ZeroPartitions(list(opt.fp32_partitioned_groups_flat), list(opt.fp16_partitioned_groups_flat),
                              opt.optimizer)
    raise TypeError(f"unsupported optimizer wrapper {type(opt).__name__}; use a ZeRO stage of 1, 2 or 3")


def full_state_dict(engine) -> dict[str, torch.Tensor]:
    """Full draft weights on every rank (ZeRO-3 gathers; all ranks must call this)."""
    import deepspeed

    module = engine.module
    if engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            sd = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    else:
        sd = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    return {k: v.contiguous() for k, v in sd.items() if not k.startswith("embed_tokens.")}


def latest(run_uri: str, s3) -> str | None:
    """The last committed checkpoint of a run, None before the first."""
    fs, root = resolve(run_uri, s3)
    path = join(root, "checkpoints", LATEST)
    return json.loads(read_bytes(fs, path))["checkpoint"] if exists(fs, path) else None


class CheckpointManager:
    """Saves every ``every`` steps (and at the end), finds the latest, resumes from it: draft
    weights, optimizer partitions and Adam moments, the LR schedule and the RNG."""

    def __init__(self, run_uri: str, s3, every: int, rank: int, world: int, barrier: Callable[[], None]):
        self.fs, self.root = resolve(run_uri, s3)
        self.run_uri, self.s3 = run_uri, s3
        self.every, self.rank, self.world, self.barrier = every, rank, world, barrier

    def due(self, step: int, total: int) -> bool:
        return step % self.every == 0 or step == total

    def latest(self) -> str | None:
        return latest(self.run_uri, self.s3)

    def save(self, engine, scheduler, step: int, epoch: int) -> str:
        name = f"step-{step:06d}"
        ckpt = join(self.root, "checkpoints", name)
        parts = zero_partitions(engine)
        tensors: dict[str, torch.Tensor] = {"rng": torch.get_rng_state()}
        for g, flat in enumerate(parts.fp32):
            tensors[f"fp32.{g}"] = flat.detach().cpu().clone()
            for key, val in parts.inner.state.get(flat, {}).items():
                tensors[f"state.{g}.{key}"] = (val if torch.is_tensor(val) else torch.tensor(val)).detach().cpu().clone()
        # Serialized in memory and published atomically: nothing is staged under /tmp.
        atomic_write_bytes(self.fs, join(ckpt, f"rank-{self.rank}.safetensors"), st_save(tensors))
        sd = full_state_dict(engine)
        if self.rank == 0:
            atomic_write_bytes(self.fs, join(ckpt, "model.safetensors"), st_save(sd))
            state = {"step": step, "epoch": epoch, "world_size": self.world,
                     "zero_stage": engine.zero_optimization_stage(), "lr_scheduler": scheduler.state_dict()}
            atomic_write_bytes(self.fs, join(ckpt, "state.json"), json.dumps(state).encode())
        self.barrier()
        if self.rank == 0:
            atomic_write_bytes(self.fs, join(self.root, "checkpoints", LATEST),
                               json.dumps({"checkpoint": name, "step": step}).encode())
        self.barrier()
        return name

    def resume(self, engine, scheduler, name: str) -> dict:
        """Restore checkpoint ``name`` into ``engine`` and ``scheduler``; returns its state.json."""
        ckpt = join(self.root, "checkpoints", name)
        state = json.loads(read_bytes(self.fs, join(ckpt, "state.json")))
        stage = engine.zero_optimization_stage()
        if state["world_size"] != self.world or state["zero_stage"] != stage:
            raise ValueError(
                f"checkpoint {name} was written by {state['world_size']} workers with ZeRO-{state['zero_stage']}; "
                f"this run has {self.world} with ZeRO-{stage}: set num_workers/zero_stage to match")
        if "lr_scheduler" not in state:
            raise ValueError(f"checkpoint {name} has no LR schedule state (written by an older Strata): "
                             "train from scratch (resume: never) or with init_from its export")
        t = st_load(read_bytes(self.fs, join(ckpt, f"rank-{self.rank}.safetensors")))  # in memory: no copy under /tmp
        parts = zero_partitions(engine)
        if parts.low_precision is None:
            weights = st_load(read_bytes(self.fs, join(ckpt, "model.safetensors")))
            missing, unexpected = engine.module.load_state_dict(weights, strict=False)
            if unexpected or any(not k.startswith("embed_tokens.") for k in missing):
                raise ValueError(f"checkpoint {name}: weights do not match the draft ({missing}, {unexpected})")
        for g, flat in enumerate(parts.fp32):
            flat.data.copy_(t[f"fp32.{g}"])
            st = {k.split(".", 2)[2]: v for k, v in t.items() if k.startswith(f"state.{g}.")}
            if st:
                parts.inner.state[flat] = {k: v.to(flat.device) if k != "step" else v for k, v in st.items()}
        if parts.low_precision is not None:
            for low, fp32 in zip(parts.low_precision, parts.fp32, strict=True):
                low.data.copy_(fp32.data)
        scheduler.load_state_dict(state["lr_scheduler"])
        # load_state_dict restores the schedule's position, not the rate the next step uses; that
        # rate is this run's schedule at that position (max_steps may have grown since the save).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # get_lr outside scheduler.step() is intended
            rates = scheduler.get_lr()
        for group, lr in zip(scheduler.optimizer.param_groups, rates, strict=True):
            group["lr"] = lr
        torch.set_rng_state(t["rng"])
        return state
