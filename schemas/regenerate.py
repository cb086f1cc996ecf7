"""The regeneration job's configuration and its provenance record.

A draft is served on the target's own continuations, so it should be trained on them:
regeneration replaces each conversation's assistant turns with the target's responses
(greedy, or sampled with a seed) and writes a conversations file extraction reads like any
other, with ``regeneration.json`` beside it saying which target, engine and sampling wrote it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.config import S3Config, Strict, TargetConfig
from schemas.extract import RayConfig, SourceConfig
from schemas.identity import TargetIdentity
from schemas.provenance import DType

CONVERSATIONS_FILE = "conversations.jsonl"
RECORD_FILE = "regeneration.json"


class GenerateEngineConfig(Strict):
    name: Literal["hf", "vllm", "sglang"] = "hf"
    dtype: DType = "bfloat16"
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="hf only")
    tp_size: int = Field(1, ge=1, description="vllm/sglang tensor-parallel GPUs per actor")
    max_model_len: int = Field(4096, gt=1, description="vllm/sglang context length; >= max_length + max_new_tokens")


class SamplingConfig(Strict):
    temperature: float = Field(0.0, ge=0, description="0: greedy (deterministic)")
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int = Field(0, description="sampled responses: each turn's seed comes from this, the row and the turn")


class RegenerateOutputConfig(Strict):
    uri: str = Field(description=f"directory: {CONVERSATIONS_FILE} and {RECORD_FILE} (local or s3://)")
    rows_per_unit: int = Field(64, ge=1, description="conversations per committed unit (the resume granularity)")


class RegenerateConfig(Strict):
    target: TargetConfig
    source: SourceConfig
    output: RegenerateOutputConfig
    engine: GenerateEngineConfig = GenerateEngineConfig()
    sampling: SamplingConfig = SamplingConfig()
    max_new_tokens: int = Field(512, ge=1, description="per assistant turn; a turn that reaches it is kept, cut")
    max_length: int = Field(
        2048, gt=1, description="a turn whose prompt is longer is dropped with the rest of the conversation"
    )
    ray: RayConfig = RayConfig()
    s3: S3Config = S3Config()

    @model_validator(mode="after")
    def _fits(self) -> RegenerateConfig:
        e = self.engine
        if e.name != "hf" and e.max_model_len < self.max_length + self.max_new_tokens:
            raise ValueError(
                f"engine.max_model_len {e.max_model_len} must hold max_length {self.max_length} + "
                f"max_new_tokens {self.max_new_tokens}"
            )
        if self.ray.nodes_per_actor > 1:
            raise ValueError(
                f"ray.nodes_per_actor {self.ray.nodes_per_actor}: regeneration runs each actor inside one node "
                "(only extraction spans nodes): set it to 1"
            )
        if e.name == "sglang" and self.sampling.temperature > 0:
            raise ValueError(
                "sampling.temperature > 0 with engine sglang: seeded sampling is supported on hf and "
                "vllm; use one of those or temperature 0 (greedy)"
            )
        return self


class UnitRecord(BaseModel):
    """One committed unit of regenerated conversations."""

    model_config = ConfigDict(extra="forbid")

    unit: int
    start: int
    rows: int  # source rows in the unit
    written: int  # conversations written (quarantined rows are not)
    quarantined: int
    turns: int  # assistant turns regenerated
    cut_turns: int  # turns that reached max_new_tokens
    dropped_turns: int  # turns dropped (empty response, prompt over max_length) with what followed
    generated_tokens: int
    path: str
    sha256: str
    quarantine: list[dict] = []


class RegenerationRecord(BaseModel):
    """Provenance of a regenerated conversations file (``regeneration.json``, written last)."""

    model_config = ConfigDict(extra="forbid")

    job: str  # fingerprint of what decided the output (config, target, source)
    target: TargetIdentity
    engine: dict  # name, version, dtype
    sampling: SamplingConfig
    max_new_tokens: int
    max_length: int
    source: dict  # uri, sha256, rows of the original conversations
    output_sha256: str  # of conversations.jsonl: extraction checks it before trusting this record
    totals: dict  # rows, written, quarantined, turns, cut_turns, dropped_turns, generated_tokens
    quarantine: list[dict] = []
