"""Checkpoints without pickle: safetensors for tensors, JSON for the rest.

Layout under ``<run>/checkpoints/step-NNNNNN/``:
    model.safetensors          full draft weights (rank 0; excludes the frozen embedding)
    rank-R.safetensors         rank R's fp32 master partition, Adam moments, step, RNG state
    state.json                 step, epoch, world size, ZeRO stage (rank 0)
and ``<run>/checkpoints/latest.json`` points at the last complete one; it is written by
rank 0 after every rank has published its file, so it is the commit point.

DeepSpeed's own save_checkpoint pickles; this reads and writes its ZeRO-1/2/3 optimizer
partitions directly, so resume needs the same world size and ZeRO stage.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from pipeline.store.fs import atomic_write_bytes, exists, join, read_bytes, resolve

LATEST = "latest.json"


def _flat_partitions(opt) -> list[torch.Tensor]:
    if hasattr(opt, "single_partition_of_fp32_groups"):      # ZeRO 1/2
        return list(opt.single_partition_of_fp32_groups)
    if hasattr(opt, "fp32_partitioned_groups_flat"):         # ZeRO 3
        return list(opt.fp32_partitioned_groups_flat)
    raise TypeError(f"unsupported optimizer wrapper {type(opt).__name__}; use a ZeRO stage of 1, 2 or 3")


def full_state_dict(engine) -> dict[str, torch.Tensor]:
    """Full draft weights on every rank (ZeRO-3 gathers; all ranks must call this)."""
    import deepspeed

    module = engine.module
    params = list(module.parameters())
    if getattr(engine, "zero_optimization_stage", lambda: 0)() == 3:
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            sd = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    else:
        sd = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    return {k: v.contiguous() for k, v in sd.items() if not k.startswith("embed_tokens.")}


def save(engine, run_uri: str, s3, step: int, epoch: int, rank: int, world: int, barrier) -> str:
    fs, root = resolve(run_uri, s3)
    name = f"step-{step:06d}"
    ckpt = join(root, "checkpoints", name)
    opt = engine.optimizer
    tensors: dict[str, torch.Tensor] = {"rng": torch.get_rng_state()}
    for g, flat in enumerate(_flat_partitions(opt)):
        tensors[f"fp32.{g}"] = flat.detach().cpu().clone()
        for key, val in opt.optimizer.state.get(flat, {}).items():
            tensors[f"state.{g}.{key}"] = (val if torch.is_tensor(val) else torch.tensor(val)).detach().cpu().clone()
    # Serialized in memory and published atomically: nothing is staged under /tmp.
    atomic_write_bytes(fs, join(ckpt, f"rank-{rank}.safetensors"), st_save(tensors))
    sd = full_state_dict(engine)
    if rank == 0:
        atomic_write_bytes(fs, join(ckpt, "model.safetensors"), st_save(sd))
        state = {"step": step, "epoch": epoch, "world_size": world, "zero_stage": engine.zero_optimization_stage()}
        atomic_write_bytes(fs, join(ckpt, "state.json"), json.dumps(state).encode())
    barrier()
    if rank == 0:
        atomic_write_bytes(fs, join(root, "checkpoints", LATEST), json.dumps({"checkpoint": name, "step": step}).encode())
    barrier()
    return name


def latest(run_uri: str, s3) -> str | None:
    fs, root = resolve(run_uri, s3)
    path = join(root, "checkpoints", LATEST)
    return json.loads(read_bytes(fs, path))["checkpoint"] if exists(fs, path) else None


def load(engine, run_uri: str, s3, name: str, rank: int, world: int) -> dict:
    """Restore weights, optimizer partitions, Adam moments and RNG; returns state.json."""
    fs, root = resolve(run_uri, s3)
    ckpt = join(root, "checkpoints", name)
    state = json.loads(read_bytes(fs, join(ckpt, "state.json")))
    if state["world_size"] != world or state["zero_stage"] != engine.zero_optimization_stage():
        raise ValueError(
            f"checkpoint {name} was written by {state['world_size']} workers with ZeRO-{state['zero_stage']}; "
            f"this run has {world} with ZeRO-{engine.zero_optimization_stage()}: set num_workers/zero_stage to match"
        )
    t = st_load(read_bytes(fs, join(ckpt, f"rank-{rank}.safetensors")))  # in memory: no copy under /tmp
    opt = engine.optimizer
    flats = _flat_partitions(opt)
    if engine.zero_optimization_stage() < 3:
        weights = st_load(read_bytes(fs, join(ckpt, "model.safetensors")))
        missing, unexpected = engine.module.load_state_dict(weights, strict=False)
        if unexpected or any(not k.startswith("embed_tokens.") for k in missing):
            raise ValueError(f"checkpoint {name}: weights do not match the draft ({missing}, {unexpected})")
    for g, flat in enumerate(flats):
        flat.data.copy_(t[f"fp32.{g}"])
        st = {k.split(".", 2)[2]: v for k, v in t.items() if k.startswith(f"state.{g}.")}
        if st:
            opt.optimizer.state[flat] = {k: v.to(flat.device) if k != "step" else v for k, v in st.items()}
    if engine.zero_optimization_stage() == 3:
        for bit16, fp32 in zip(opt.fp16_partitioned_groups_flat, flats, strict=True):
            bit16.data.copy_(fp32.data)
    torch.set_rng_state(t["rng"])
    return state
