"""Engines that host the target and capture typed points: HF transformers, vLLM, SGLang.

``open_engine`` builds the one an extraction config names; ``engine_ref`` says how that
engine names a point natively (for provenance) without starting it.
"""

from __future__ import annotations

from schemas.capture import CapturePoint
from schemas.config import ExtractConfig
from schemas.provenance import EngineRef


def engine_ref(cfg: ExtractConfig, point: CapturePoint, num_layers: int) -> EngineRef:
    e = cfg.engine
    if e.name == "vllm":
        from pipeline.engines.vllm_engine import vllm_engine_ref

        return vllm_engine_ref(point, num_layers, e.tp_size)
    if e.name == "sglang":
        import importlib.metadata

        from pipeline.engines.sglang_engine import family_for, sglang_engine_ref

        try:
            version = importlib.metadata.version("sglang")
        except importlib.metadata.PackageNotFoundError:
            version = "not installed"
        return sglang_engine_ref(point, num_layers, family_for(cfg.target.path), version, e.tp_size)
    from pipeline.engines.hf import hf_engine_ref

    return hf_engine_ref(point, num_layers)


def open_engine(cfg: ExtractConfig):
    """The capture engine for ``cfg`` (loads the target; seconds to a minute)."""
    e = cfg.engine
    if e.name == "vllm":
        from pipeline.engines.vllm_engine import VLLMEngine

        return VLLMEngine(cfg.target.path, cfg.capture, e.dtype, e.tp_size, e.max_model_len, e.batch_tokens)
    if e.name == "sglang":
        from pipeline.engines.sglang_engine import SGLangEngine

        return SGLangEngine(cfg.target.path, cfg.capture, e.dtype, e.tp_size, batch_tokens=e.batch_tokens)
    from pipeline.engines.hf import HFEngine

    return HFEngine(cfg.target.path, cfg.capture, e.dtype, e.device, e.attn_implementation, e.batch_tokens)
