"""Strata's contracts: pydantic models and the Arrow dataset schema. Never imports torch."""

from schemas.capture import CapturePoint, CapturePointError, parse_points
from schemas.config import ConfigError, load_config
from schemas.extract import ExtractConfig
from schemas.identity import FileDigest, TargetIdentity
from schemas.manifest import DatasetManifest, ShardRecord, SourceInfo, Totals
from schemas.provenance import EngineRef, TensorProvenance

__all__ = [
    "CapturePoint",
    "CapturePointError",
    "ConfigError",
    "DatasetManifest",
    "EngineRef",
    "ExtractConfig",
    "FileDigest",
    "ShardRecord",
    "SourceInfo",
    "TargetIdentity",
    "TensorProvenance",
    "Totals",
    "load_config",
    "parse_points",
]
