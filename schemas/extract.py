"""The extraction job's configuration: target, conversations, capture points, engine, output."""

from __future__ import annotations

import warnings
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from schemas.capture import CapturePoint, parse_points
from schemas.config import S3Config, Strict, TargetConfig
from schemas.provenance import DType


class SourceConfig(Strict):
    uri: str = Field(description="conversations file: JSONL or Parquet, local or s3://")
    format: Literal["auto", "jsonl", "parquet"] = "auto"


class EngineConfig(Strict):
    name: Literal["hf", "vllm", "sglang"] = Field(
        "hf", description="hf: forward hooks; vllm: extract_hidden_states (CPU or GPU); sglang: GPU clusters"
    )
    dtype: DType = "bfloat16"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    attn_implementation: Literal["sdpa", "eager"] = Field("sdpa", description="hf only")
    batch_tokens: int = Field(
        16384, gt=0, description="tokens per forward batch: samples packed end to end, never padded"
    )
    tp_size: int = Field(
        1, ge=1, description="tensor-parallel ranks per extraction actor (vllm, sglang): its GPUs, or its cores on CPU"
    )
    max_model_len: int = Field(4096, gt=1, description="vllm/sglang context length; >= max_length + 1")


class OutputConfig(Strict):
    uri: str = Field(description="dataset directory: local path or s3://bucket/prefix")
    rows_per_shard: int = Field(64, gt=0, description="source rows per unit; each unit is one shard")
    dataset_id: str | None = None


class RayConfig(Strict):
    address: str | None = Field(None, description="None: RAY_ADDRESS if set, else a local Ray")
    num_actors: int = Field(1, ge=1)
    cpus_per_actor: float = Field(1.0, gt=0)
    gpus_per_actor: float = Field(0, ge=0)
    nodes_per_actor: int = Field(
        1,
        ge=1,
        description="nodes one capture actor spans, for a target larger than a node: its gpus_per_actor "
        "(= engine.tp_size) are a placement group over this many nodes, filled by vLLM's Ray executor",
    )
    resource_wait_s: float = Field(
        600,
        ge=0,
        description="on a cluster the job was submitted to: how long to wait for the autoscaler to "
        "provide the actors' CPUs/GPUs before refusing (a local Ray is checked at once)",
    )
    stall_timeout_s: float | None = Field(
        3600,
        ge=0,
        description="stop with an error when no unit is committed for this long (the first unit "
        "includes loading the target); Ray otherwise waits forever on work it cannot schedule. 0 or null: no limit",
    )
    writer_threads: int | None = Field(
        None,
        ge=1,
        description="threads per capture actor that compress and write byte planes while the engine "
        "computes the next batch; None: one per CPU the actor holds beyond the first, at least one",
    )

    @model_validator(mode="before")
    @classmethod
    def _retired_keys(cls, data: Any) -> Any:
        """``cpus_per_tokenize_task`` is gone (the capture actors tokenize their own units): a config
        that still sets it runs, with a warning, since it never changed the data."""
        if isinstance(data, dict) and "cpus_per_tokenize_task" in data:
            warnings.warn(
                "ray.cpus_per_tokenize_task is ignored: capture actors tokenize their own units; "
                "remove it from the config",
                FutureWarning,
                stacklevel=2,
            )
            data = {k: v for k, v in data.items() if k != "cpus_per_tokenize_task"}
        return data

    def writer_threads_per_actor(self) -> int:
        return self.writer_threads or max(1, round(self.cpus_per_actor) - 1)


class FingerprintConfig(Strict):
    probe_samples: int = Field(32, ge=0, description="samples fingerprinted for validation (0: none)")
    dim: int = Field(64, ge=8, description="random-projection width per token")
    seed: int = 0


class ExtractConfig(Strict):
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
            raise ValueError(
                "engine.tp_size > 1 needs engine vllm or sglang; the hf engine splits a large target "
                "layer-wise over the actor's GPUs instead (set ray.gpus_per_actor)"
            )
        if e.tp_size > 1 and self.ray.gpus_per_actor not in (0, e.tp_size):
            raise ValueError(
                f"ray.gpus_per_actor must equal engine.tp_size ({e.tp_size}): each extraction actor "
                f"hosts one tensor-parallel replica of the target, got {self.ray.gpus_per_actor}"
            )
        if e.tp_size > 1 and self.ray.gpus_per_actor == 0 and self.ray.cpus_per_actor < e.tp_size:
            raise ValueError(
                f"engine.tp_size {e.tp_size} on CPU (ray.gpus_per_actor 0) runs one engine worker per core: "
                f"ray.cpus_per_actor must be at least {e.tp_size}, got {self.ray.cpus_per_actor:g}"
            )
        r = self.ray
        if r.nodes_per_actor > 1:
            if e.name != "vllm":
                raise ValueError(
                    f"ray.nodes_per_actor {r.nodes_per_actor} needs engine vllm (its Ray executor spans nodes); "
                    f"engine {e.name} runs inside one node"
                )
            if (
                not r.gpus_per_actor
                or r.gpus_per_actor % r.nodes_per_actor
                or r.gpus_per_actor != int(r.gpus_per_actor)
            ):
                raise ValueError(
                    f"ray.nodes_per_actor {r.nodes_per_actor} spreads the actor's GPUs evenly over its nodes: "
                    f"ray.gpus_per_actor (= engine.tp_size) must be a whole multiple of it, got {r.gpus_per_actor:g} "
                    "(vLLM's CPU build has no Ray executor, so a spanning actor needs GPUs)"
                )
        if e.name != "hf" and e.max_model_len < self.max_length + 1:
            raise ValueError(f"engine.max_model_len {e.max_model_len} must exceed max_length {self.max_length}")
        if e.name != "hf":
            post = [str(p) for p in self.capture if p.kind == "final" and p.norm == "post"]
            if post:
                raise ValueError(
                    f"engine {e.name} captures the residual stream only (pre-norm); it cannot capture "
                    f"{post}: drop it or use engine hf"
                )
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
