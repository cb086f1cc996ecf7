"""Checkpoints built from parts, without pickle: safetensors for tensors, JSON for the rest.

Each part of the training state is a :class:`Stateful` (``state_dict`` / ``load_state_dict``,
as in torchtitan) that says where its state lives:

    model.safetensors    ``model``  tensors that are the same on every rank (rank 0 writes them):
                                    the full draft weights, without the frozen embedding
    rank-R.safetensors   ``rank``   tensors of rank R: its ZeRO partition and Adam moments, its
                                    RNG, its open metrics window
    state.json           ``state``  JSON that is the same on every rank: step and epoch, the LR
                                    schedule (plus the world size and ZeRO stage, checked on load)

under ``<run>/checkpoints/step-NNNNNN/``. ``<run>/checkpoints/latest.json`` points at the last
complete checkpoint; rank 0 writes it after every rank has published its file, so it is the
commit point. After each commit all but the last ``keep`` checkpoints are deleted.

DeepSpeed's own save_checkpoint pickles; :class:`OptimizerState` reads and writes its ZeRO-1/2/3
optimizer partitions directly (through :func:`zero_partitions`, the one place that touches
DeepSpeed internals), so resume needs the same world size and ZeRO stage.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from pipeline.store.fs import (
    atomic_write_bytes,
    delete_dir,
    exists,
    join,
    list_dirs,
    read_bytes,
    resolve,
)

LATEST = "latest.json"
Where = Literal["model", "rank", "state"]
log = logging.getLogger(__name__)


class Stateful(Protocol):
    where: ClassVar[Where]

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# -- DeepSpeed's ZeRO optimizer --------------------------------------------------------------------
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
    if hasattr(opt, "single_partition_of_fp32_groups"):  # ZeRO 1/2
        return ZeroPartitions(list(opt.single_partition_of_fp32_groups), None, opt.optimizer)
    if hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO 3
        return ZeroPartitions(
            list(opt.fp32_partitioned_groups_flat), list(opt.fp16_partitioned_groups_flat), opt.optimizer
        )
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


# -- the parts -------------------------------------------------------------------------------------
class ModelWeights:
    """The full draft weights. Restored below ZeRO-3 only: there the fp32 partitions are the
    truth and the compute copies are rebuilt from them (``OptimizerState``)."""

    where: ClassVar[Where] = "model"

    def __init__(self, engine):
        self.engine = engine

    @property
    def needed(self) -> bool:
        return zero_partitions(self.engine).low_precision is None

    def state_dict(self) -> dict[str, torch.Tensor]:
        return full_state_dict(self.engine)  # every rank: ZeRO-3 gathers

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing, unexpected = self.engine.module.load_state_dict(state, strict=False)
        if unexpected or any(not k.startswith("embed_tokens.") for k in missing):
            raise ValueError(f"weights do not match the draft ({missing}, {unexpected})")


class OptimizerState:
    """This rank's fp32 master partitions and their Adam moments."""

    where: ClassVar[Where] = "rank"

    def __init__(self, engine):
        self.engine = engine

    def state_dict(self) -> dict[str, torch.Tensor]:
        parts = zero_partitions(self.engine)
        out = {}
        for g, flat in enumerate(parts.fp32):
            out[f"fp32.{g}"] = flat.detach().cpu().clone()
            for key, val in parts.inner.state.get(flat, {}).items():
                out[f"state.{g}.{key}"] = (val if torch.is_tensor(val) else torch.tensor(val)).detach().cpu().clone()
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        parts = zero_partitions(self.engine)
        for g, flat in enumerate(parts.fp32):
            flat.data.copy_(state[f"fp32.{g}"])
            st = {k.split(".", 2)[2]: v for k, v in state.items() if k.startswith(f"state.{g}.")}
            if st:
                parts.inner.state[flat] = {k: v.to(flat.device) if k != "step" else v for k, v in st.items()}
        if parts.low_precision is not None:
            for low, fp32 in zip(parts.low_precision, parts.fp32, strict=True):
                low.data.copy_(fp32.data)


class LRSchedule:
    where: ClassVar[Where] = "state"

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return {"lr_scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "lr_scheduler" not in state:
            raise ValueError(
                "no LR schedule state (written by an older Strata): train from scratch (resume: none) "
                "or with init_from its export"
            )
        self.scheduler.load_state_dict(state["lr_scheduler"])
        # load_state_dict restores the schedule's position, not the rate the next step uses; that
        # rate is this run's schedule at that position (max_steps may have grown since the save).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # get_lr outside scheduler.step() is intended
            rates = self.scheduler.get_lr()
        for group, lr in zip(self.scheduler.optimizer.param_groups, rates, strict=True):
            group["lr"] = lr


class RNGState:
    """This rank's torch RNG, CPU and (where there is one) CUDA."""

    where: ClassVar[Where] = "rank"

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {"rng": torch.get_rng_state()}
        if torch.cuda.is_available():
            out["rng.cuda"] = torch.cuda.get_rng_state()
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        torch.set_rng_state(state["rng"])
        if "rng.cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["rng.cuda"])


@dataclass
class TrainState:
    """Where the run is: the next step to take and its epoch."""

    step: int = 0
    epoch: int = 0
    where: ClassVar[Where] = "state"

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.epoch = int(state["step"]), int(state["epoch"])


# -- saving and loading them all --------------------------------------------------------------------
def latest(run_uri: str, s3) -> str | None:
    """The last committed checkpoint of a run, None before the first."""
    fs, root = resolve(run_uri, s3)
    path = join(root, "checkpoints", LATEST)
    return json.loads(read_bytes(fs, path))["checkpoint"] if exists(fs, path) else None


class CheckpointManager:
    """Saves ``states`` every ``every`` steps (and at the end), keeps the last ``keep``, finds the
    latest and restores every part from it."""

    def __init__(
        self,
        run_uri: str,
        s3,
        states: dict[str, Stateful],
        every: int,
        keep: int,
        rank: int,
        world: int,
        barrier: Callable[[], None],
        zero_stage: int,
    ):
        self.fs, self.root = resolve(run_uri, s3)
        self.run_uri, self.s3, self.states = run_uri, s3, states
        self.every, self.keep, self.rank, self.world, self.barrier = every, keep, rank, world, barrier
        self.zero_stage = zero_stage

    def due(self, step: int, total: int) -> bool:
        return step % self.every == 0 or step == total

    def latest(self) -> str | None:
        return latest(self.run_uri, self.s3)

    def _gather(self) -> dict[Where, dict[str, Any]]:
        out: dict[Where, dict[str, Any]] = {"model": {}, "rank": {}, "state": {}}
        for name, part in self.states.items():
            sd = part.state_dict()
            clash = set(sd) & set(out[part.where])
            if clash:
                raise ValueError(f"checkpoint part {name!r} reuses the keys {sorted(clash)} of another part")
            out[part.where].update(sd)
        return out

    def save(self, step: int) -> str:
        name = f"step-{step:06d}"
        ckpt = join(self.root, "checkpoints", name)
        got = self._gather()  # every rank: the model part gathers under ZeRO-3
        # Serialized in memory and published atomically: nothing is staged under /tmp.
        atomic_write_bytes(self.fs, join(ckpt, f"rank-{self.rank}.safetensors"), st_save(got["rank"]))
        if self.rank == 0:
            atomic_write_bytes(self.fs, join(ckpt, "model.safetensors"), st_save(got["model"]))
            state = {"world_size": self.world, "zero_stage": self.zero_stage, **got["state"]}
            atomic_write_bytes(self.fs, join(ckpt, "state.json"), json.dumps(state).encode())
        self.barrier()
        if self.rank == 0:
            atomic_write_bytes(
                self.fs, join(self.root, "checkpoints", LATEST), json.dumps({"checkpoint": name, "step": step}).encode()
            )
            self._prune(name)
        self.barrier()
        return name

    def _prune(self, newest: str) -> None:
        """Delete all but the last ``keep`` committed checkpoints (never the one just committed)."""
        names = sorted(d.rsplit("/", 1)[-1] for d in list_dirs(self.fs, join(self.root, "checkpoints")))
        old = [d for d in names if d.startswith("step-") and d <= newest][: -self.keep]
        for d in old:
            delete_dir(self.fs, join(self.root, "checkpoints", d))
        if old:
            log.info("checkpoints: kept the last %d, deleted %s", self.keep, ", ".join(old))

    def load(self, name: str) -> None:
        """Restore every part from checkpoint ``name``."""
        ckpt = join(self.root, "checkpoints", name)
        state = json.loads(read_bytes(self.fs, join(ckpt, "state.json")))
        if state["world_size"] != self.world or state["zero_stage"] != self.zero_stage:
            raise ValueError(
                f"checkpoint {name} was written by {state['world_size']} workers with ZeRO-{state['zero_stage']}; "
                f"this run has {self.world} with ZeRO-{self.zero_stage}: set num_workers/zero_stage to match"
            )
        files: dict[Where, Callable[[], dict[str, Any]]] = {
            "state": lambda: state,
            "rank": lambda: st_load(read_bytes(self.fs, join(ckpt, f"rank-{self.rank}.safetensors"))),  # in memory
            "model": lambda: st_load(read_bytes(self.fs, join(ckpt, "model.safetensors"))),
        }
        loaded: dict[Where, dict[str, Any]] = {}
        for part_name, part in self.states.items():  # in order: weights before the partitions rebuilt from them
            if not getattr(part, "needed", True):
                continue
            if part.where not in loaded:
                loaded[part.where] = files[part.where]()
            try:
                part.load_state_dict(loaded[part.where])
            except (KeyError, ValueError) as e:
                raise ValueError(f"checkpoint {name}: its {part_name} part cannot be restored: {e}") from e
