"""Engines that host the target and capture typed points: HF transformers, vLLM, SGLang.

``open_engine`` builds the one an extraction config names; ``engine_ref`` says how that
engine names a point natively (for provenance) without starting it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.engines.base import TargetEngine
    from schemas.extract import ExtractConfig

__all__ = ["engine_ref", "installed_version", "open_engine", "same_release"]
_REFS = ("engine_ref", "installed_version", "same_release")


def __getattr__(name: str):
    """The provenance helpers, imported on first use: importing ``pipeline.engines.packing`` (the
    GPU benchmark, on a machine with torch and transformers only) must not pull in pydantic."""
    if name in _REFS:
        from pipeline.engines import refs

        return getattr(refs, name)
    raise AttributeError(f"module 'pipeline.engines' has no attribute {name!r}")


def open_engine(cfg: ExtractConfig) -> TargetEngine:
    """The capture engine for ``cfg`` (loads the target; seconds to a minute)."""
    e = cfg.engine
    if e.name == "vllm":
        from pipeline.engines.vllm.engine import VLLMEngine

        executor = "ray" if cfg.ray.nodes_per_actor > 1 else "mp"  # workers on other nodes: Ray places them
        return VLLMEngine(
            cfg.target.path, cfg.capture, e.dtype, e.tp_size, e.max_model_len, e.batch_tokens, executor=executor
        )
    if e.name == "sglang":
        from pipeline.engines.sglang.engine import SGLangEngine

        return SGLangEngine(cfg.target.path, cfg.capture, e.dtype, e.tp_size, batch_tokens=e.batch_tokens)

    from pipeline.engines.hf import HFEngine

    return HFEngine(cfg.target.path, cfg.capture, e.dtype, e.device, e.attn_implementation, e.batch_tokens)
