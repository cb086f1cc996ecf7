"""Registry contracts: serving configurations, validation records, channels, audit entries."""

from __future__ import annotations

import hashlib
import json
import re
from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.provenance import DType


def _now() -> str:
    return datetime.now(UTC).isoformat()


_DIGEST = re.compile(r"^[0-9a-f]{64}$")
_CHANNEL = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


class InvalidName(ValueError):
    """A channel name or digest that must not become an object key."""


def check_digest(digest: str, what: str = "artifact digest") -> str:
    """A content digest as the registry stores it: 64 lowercase hex characters, nothing else."""
    if not isinstance(digest, str) or not _DIGEST.match(digest):
        raise InvalidName(f"{what} {digest!r} is not a SHA-256 digest (64 lowercase hex characters)")
    return digest


def check_channel(channel: str) -> str:
    """Channel names become object keys: lowercase letters, digits, '-' and '_' only."""
    if not isinstance(channel, str) or not _CHANNEL.match(channel):
        raise InvalidName(
            f"channel name {channel!r} is not allowed: use 1-63 lowercase letters, digits, '-' or '_', "
            "starting with a letter or digit"
        )
    return channel


class Deployment(BaseModel):
    """How a draft will be served, resolved and pinned (engine release, family, runner, the exact
    config.json by digest, the target by identity): a validation record is valid only for
    exactly this. Built from a validation config's ``serving`` section (``ServingConfig``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: Literal["vllm", "sglang", "hf"]
    engine_version: str
    engine_family: str | None = None  # SGLang rule architecture (LlamaForCausalLM, DeepseekV3ForCausalLM)
    dtype: DType
    tp_size: int = 1
    vllm_runner: Literal["v1", "v2"] | None = None  # pinned vLLM model runner (None: vLLM's own choice)
    draft_config_sha256: str  # the config.json the engine will read
    target_key: str  # TargetIdentity.key of the served target

    @property
    def key(self) -> str:
        d = self.model_dump(mode="json")
        if d["vllm_runner"] is None:  # keys of configurations without a pinned runner stay as they were
            del d["vllm_runner"]
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


class ValidationRecord(BaseModel):
    """A validation verdict, immutable once written: stored under the SHA-256 of its body (every
    field but ``signature``), which an HMAC ``signature`` covers when the registry has a key."""

    model_config = ConfigDict(extra="forbid")

    record_id: str
    artifact_digest: str
    serving: Deployment
    decision: Literal["pass", "block"]
    reasons: list[str] = []
    created_at: str = Field(default_factory=_now)
    report_uri: str | None = None
    signature: str | None = None  # hex HMAC-SHA256 of body() with the registry's signing key

    def body(self) -> bytes:
        d = self.model_dump(mode="json", exclude={"signature"})
        return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.body()).hexdigest()


class ChannelSpec(BaseModel):
    """A channel (e.g. production) and the one serving configuration it deploys with."""

    model_config = ConfigDict(extra="forbid")

    channel: str
    serving: Deployment
    created_at: str = Field(default_factory=_now)


class ChannelPointer(BaseModel):
    model_config = ConfigDict(extra="forbid")

    channel: str
    artifact_digest: str
    record_id: str
    record_digest: str | None = None  # the content digest of the passing record it was promoted on
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
    details: dict | None = None  # retrain: the run record
