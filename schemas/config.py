"""Job configurations (the YAML files users write), with errors that name the field."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from schemas.capture import CapturePoint, parse_points
from schemas.provenance import DType, TrainDType


class ConfigError(ValueError):
    """A configuration file that cannot be used; the message names the file and field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TargetConfig(_Strict):
    path: str = Field(description="local HF-format model directory (no downloads)")
    name: str | None = Field(None, description="display name; defaults to the directory name")
    revision: str | None = None


class SourceConfig(_Strict):
    uri: str = Field(description="conversations file: JSONL or Parquet, local or s3://")
    format: Literal["auto", "jsonl", "parquet"] = "auto"


class EngineConfig(_Strict):
    name: Literal["hf", "vllm", "sglang"] = Field(
        "hf", description="hf: forward hooks; vllm: extract_hidden_states (CPU or GPU); sglang: GPU clusters")
    dtype: DType = "bfloat16"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    attn_implementation: Literal["sdpa", "eager"] = Field("sdpa", description="hf only")
    batch_tokens: int = Field(16384, gt=0, description="tokens per forward batch (hf: padded)")
    tp_size: int = Field(1, ge=1, description="tensor parallel GPUs per extraction actor (vllm, sglang)")
    max_model_len: int = Field(4096, gt=1, description="vllm/sglang context length; >= max_length + 1")


class OutputConfig(_Strict):
    uri: str = Field(description="dataset directory: local path or s3://bucket/prefix")
    rows_per_shard: int = Field(64, gt=0, description="source rows per unit; each unit is one shard")
    dataset_id: str | None = None


class S3Config(_Strict):
    """Endpoint settings, one object for datasets, runs and registries; credentials come only from
    the environment (never written)."""

    endpoint_url: str | None = Field(None, description="None: AWS_ENDPOINT_URL if set, else AWS's own")
    region: str = "us-east-1"

    def endpoint(self) -> str | None:
        return self.endpoint_url or os.environ.get("AWS_ENDPOINT_URL")


class RayConfig(_Strict):
    address: str | None = Field(None, description="None: RAY_ADDRESS if set, else a local Ray")
    num_actors: int = Field(1, ge=1)
    cpus_per_actor: float = Field(1.0, gt=0)
    gpus_per_actor: float = Field(0, ge=0)
    cpus_per_tokenize_task: float = Field(0.25, gt=0)


class FingerprintConfig(_Strict):
    probe_samples: int = Field(16, ge=0, description="samples fingerprinted for validation (0: none)")
    dim: int = Field(64, ge=8, description="random-projection width per token")
    seed: int = 0


class ExtractConfig(_Strict):
    target: TargetConfig
    source: SourceConfig
    output: OutputConfig
    capture: list[CapturePoint] = Field(
        default_factory=lambda: [
            CapturePoint.layer_output(1),
            CapturePoint.layer_output(2),
            CapturePoint.layer_output(3),
            CapturePoint.final("post"),
        ],
        description="typed capture points, e.g. ['layer_output:1', 'final:post_norm']",
    )
    max_length: int = Field(2048, gt=1)
    length_policy: Literal["truncate", "drop"] = "truncate"
    engine: EngineConfig = EngineConfig()
    fingerprint: FingerprintConfig = FingerprintConfig()
    ray: RayConfig = RayConfig()
    s3: S3Config = S3Config()

    @model_validator(mode="after")
    def _engine_fits(self) -> ExtractConfig:
        e = self.engine
        if e.name == "hf" and e.tp_size > 1:
            raise ValueError("engine.tp_size > 1 needs engine vllm or sglang; the hf engine splits a large target "
                             "layer-wise over the actor's GPUs instead (set ray.gpus_per_actor)")
        if e.tp_size > 1 and self.ray.gpus_per_actor != e.tp_size:
            raise ValueError(f"ray.gpus_per_actor must equal engine.tp_size ({e.tp_size}): each extraction actor "
                             f"hosts one tensor-parallel replica of the target, got {self.ray.gpus_per_actor}")
        if e.name != "hf" and e.max_model_len < self.max_length + 1:
            raise ValueError(f"engine.max_model_len {e.max_model_len} must exceed max_length {self.max_length}")
        if e.name != "hf":
            post = [str(p) for p in self.capture if p.kind == "final" and p.norm == "post"]
            if post:
                raise ValueError(f"engine {e.name} captures the residual stream only (pre-norm); it cannot capture "
                                 f"{post}: drop it or use engine hf")
        return self

    @field_validator("capture", mode="before")
    @classmethod
    def _parse_capture(cls, v: Any) -> Any:
        if not isinstance(v, list) or not v:
            raise ValueError("must be a non-empty list of capture points")
        out = []
        for i, item in enumerate(v):
            try:
                out.extend(parse_points([item]))
            except ValueError as e:
                raise ValueError(f"item {i}: {e}") from None
        return out

    @field_validator("capture")
    @classmethod
    def _unique(cls, v: list[CapturePoint]) -> list[CapturePoint]:
        seen = [str(p) for p in v]
        dup = {s for s in seen if seen.count(s) > 1}
        if dup:
            raise ValueError(f"capture point listed twice: {sorted(dup)}")
        return v


M = TypeVar("M", bound=BaseModel)


def format_validation_error(err: ValidationError, where: str) -> str:
    lines = [f"{where}: invalid configuration"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        got = e.get("input")
        got_s = f" (got {got!r})" if got is not None and not isinstance(got, dict) else ""
        lines.append(f"  {loc}: {e['msg']}{got_s}")
    return "\n".join(lines)


def load_config(path: str | Path, model: type[M]) -> M:
    """Read a YAML config and validate it; relative paths stay as written."""
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: expected a mapping at the top level, got {type(raw).__name__}")
    return validate_config(raw, model, where=str(p))


def validate_config(raw: dict, model: type[M], where: str = "config") -> M:
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, where)) from None


class OptimConfig(_Strict):
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = Field(20, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    grad_clip: float = Field(0.5, gt=0)


class DeepSpeedConfig(_Strict):
    zero_stage: Literal[1, 2, 3] = 2
    dtype: TrainDType = "bfloat16"
    config_file: str | None = Field(
        None, description="DeepSpeed JSON (e.g. infra/deepspeed/zero3-offload.json) merged over Strata's settings; "
        "batch size, accumulation and clipping stay Strata's (they are part of the training plan)")


class ExportConfig(_Strict):
    engines: list[Literal["sglang", "vllm"]] = ["sglang", "vllm"]
    engine_family: str = Field("auto", validation_alias=AliasChoices("engine_family", "sglang_family"),
                               description="SGLang capture rule; auto = from the target's model_type")
    engine_versions: dict[Literal["sglang", "vllm"], str] = Field(
        default_factory=dict, description="write ids for these engine releases (default: the newest with a known rule)")
    dtype: DType = "bfloat16"


class HeldoutAcceptanceConfig(_Strict):
    """Acceptance of the finished draft on held-out prompts (prefixes of the dataset's probe
    samples, never trained on), by Strata's reference speculative decoding on the target."""

    prompts: int = Field(6, ge=0, description="0 skips the measurement (it loads the target once)")
    speculative_tokens: int = Field(3, ge=1)
    max_new_tokens: int = Field(32, ge=1)


class TrainConfig(_Strict):
    dataset: str = Field(description="extracted dataset URI (local or s3://)")
    target: TargetConfig
    output: str = Field(description="run directory: checkpoints, metrics.jsonl, exported drafts")
    aux: list[CapturePoint] | None = Field(None, description="aux slots; default: every residual point of the dataset")
    draft_vocab_size: int = Field(32000, gt=0)
    ttt_steps: int = Field(7, ge=1)
    loss_decay: float = Field(0.8, gt=0, le=1)
    soft_target: Literal["draft_vocab", "full_vocab"] = Field(
        "draft_vocab", description="draft_vocab: the target renormalised over the draft vocabulary (SpecForge, "
        "EAGLE); full_vocab: its full-vocabulary probabilities of the draft tokens (positions weighted by the "
        "target mass inside the draft vocab)")
    batch_tokens: int = Field(4096, gt=0, description="padded tokens per worker per step")
    epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1)
    eval_fraction: float = Field(0.05, ge=0, lt=1)
    metrics_every: int = Field(10, ge=1)
    checkpoint_every: int = Field(50, ge=1)
    resume: Literal["latest", "none"] = "latest"
    init_from: str | None = Field(
        None, description="warm start: an exported draft directory (same target, capture points and draft shape); "
        "its weights and draft vocab are the starting point")
    seed: int = 0
    optim: OptimConfig = OptimConfig()
    deepspeed: DeepSpeedConfig = DeepSpeedConfig()
    num_workers: int = Field(2, ge=1)
    cpus_per_worker: float = Field(1.0, gt=0)
    use_gpu: bool = False
    ray_address: str | None = None
    export: ExportConfig = ExportConfig()
    heldout_acceptance: HeldoutAcceptanceConfig = HeldoutAcceptanceConfig()
    s3: S3Config = S3Config()

    @field_validator("aux", mode="before")
    @classmethod
    def _parse_aux(cls, v: Any) -> Any:
        return None if v is None else parse_points(v)
