"""Registry contracts: serving configurations, validation records, channels, audit entries."""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


def _now() -> str:
    return datetime.now(UTC).isoformat()


class ServingConfig(BaseModel):
    """How a draft will be served: a validation record is valid only for exactly this."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: Literal["vllm", "sglang", "hf"]
    engine_version: str
    engine_family: str | None = None       # SGLang capture rule (llama, deepseek_v2, gpt_oss)
    dtype: Literal["bfloat16", "float16", "float32"]
    tp_size: int = 1
    vllm_runner: Literal["v1", "v2"] | None = None  # pinned vLLM model runner (None: vLLM's own choice)
    draft_config_sha256: str               # the config.json the engine will read
    target_key: str                        # TargetIdentity.key of the served target

    @property
    def key(self) -> str:
        d = self.model_dump(mode="json")
        if d["vllm_runner"] is None:  # keys of configurations without a pinned runner stay as they were
            del d["vllm_runner"]
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


class ValidationRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    record_id: str
    artifact_digest: str
    serving: ServingConfig
    decision: Literal["pass", "block"]
    reasons: list[str] = []
    created_at: str = Field(default_factory=_now)
    report_uri: str | None = None


class ChannelSpec(BaseModel):
    """A channel (e.g. production) and the one serving configuration it deploys with."""

    model_config = ConfigDict(extra="forbid")

    channel: str
    serving: ServingConfig
    created_at: str = Field(default_factory=_now)


class ChannelPointer(BaseModel):
    model_config = ConfigDict(extra="forbid")

    channel: str
    artifact_digest: str
    record_id: str
    serving_key: str
    previous_digest: str | None = None
    updated_at: str = Field(default_factory=_now)


class AuditEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    at: str = Field(default_factory=_now)
    action: Literal["promote", "create_channel", "add_record", "add_artifact", "retrain"]
    decision: Literal["accepted", "refused"]
    channel: str | None = None
    artifact_digest: str | None = None
    serving_key: str | None = None
    reasons: list[str] = []
    actor: str
    details: dict | None = None            # retrain: the run record
