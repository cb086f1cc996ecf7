"""Retraining contracts: the scheduler's config, dataset versions, and the run record."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.config import S3Config, TargetConfig
from schemas.extract import ExtractConfig, SourceConfig
from schemas.train import TrainConfig
from schemas.validation import ValidateConfig

_PLACEHOLDER = "/placeholder"


class RetrainConfig(BaseModel):
    """One idempotent pass: new rows -> dataset version -> train -> validate -> gate.

    ``extract``, ``train`` and ``validate`` hold the fields of those jobs' configs that the
    scheduler does not decide itself (it fills target, source, output paths, the dataset, the
    warm start and the artifact). They are validated as full configs when this one loads.
    """

    model_config = ConfigDict(extra="forbid")

    name: str = Field("default", pattern=r"^[A-Za-z0-9_.-]+$", description="lease and run-record namespace")
    target: TargetConfig
    source: SourceConfig
    data_root: str = Field(description="dataset versions live under here (local or s3://)")
    registry: str = Field(description="registry: local dir or s3://bucket/prefix")
    channel: str = Field(description="the channel this scheduler keeps fresh (must exist)")
    extract: dict[str, Any] = {}
    train: dict[str, Any] = {}
    validate_: dict[str, Any] = Field(default_factory=dict, alias="validate")
    warm_start: bool = Field(True, description="start from the channel's draft when target and points are unchanged")
    lease_ttl_s: float = Field(3600, gt=0, description="a crashed scheduler's lease is taken over after this")
    use_ray: bool = True
    s3: S3Config = S3Config()

    def extract_config(self, source_uri: str, output_uri: str) -> ExtractConfig:
        return ExtractConfig.model_validate(
            {
                **self.extract,
                "target": self.target.model_dump(),
                "source": {"uri": source_uri, "format": "jsonl"},
                "output": {**self.extract.get("output", {}), "uri": output_uri},
                "s3": self.s3.model_dump(),
            }
        )

    def train_config(self, dataset_uri: str, output: str, init_from: str | None) -> TrainConfig:
        return TrainConfig.model_validate(
            {
                **self.train,
                "dataset": dataset_uri,
                "target": self.target.model_dump(),
                "output": output,
                "init_from": init_from,
                "resume": "none",
                "s3": self.s3.model_dump(),
            }
        )

    def validate_config(self, artifact: str, report_dir: str | None = None) -> ValidateConfig:
        serving = {"target": self.target.model_dump(), **self.validate_.get("serving", {})}
        return ValidateConfig.model_validate(
            {
                **self.validate_,
                "serving": serving,
                "artifact": artifact,
                "registry": self.registry,
                "report_dir": report_dir,
            }
        )

    @model_validator(mode="after")
    def _sub_configs_valid(self) -> RetrainConfig:
        for section, build in (
            ("extract", lambda: self.extract_config(_PLACEHOLDER, _PLACEHOLDER)),
            ("train", lambda: self.train_config(_PLACEHOLDER, _PLACEHOLDER, None)),
            ("validate", lambda: self.validate_config(_PLACEHOLDER)),
        ):
            try:
                build()
            except ValueError as e:
                raise ValueError(f"section {section!r}: {e}") from None
        return self


class DatasetVersion(BaseModel):
    """``<data_root>/<lineage>/vNNNN/version.json``: what this version added."""

    model_config = ConfigDict(extra="forbid")

    version: int
    dataset_id: str
    target_key: str
    parent: str | None  # dataset id of the previous version
    source_uri: str
    source_rows: int  # rows in the source when this version was made
    new_rows: int  # of which were new (extracted here)
    seen_rows: int  # distinct row digests handled up to this version
    created_at: str


class RunRecord(BaseModel):
    """What one retrain pass found and did; stored in the registry's audit log."""

    model_config = ConfigDict(extra="forbid")

    run_id: str
    name: str
    channel: str
    target_key: str
    outcome: Literal["noop", "promoted", "blocked", "refused", "failed"]
    message: str
    source_rows: int = 0
    new_rows: int = 0
    identity_changed: bool = False
    recipe_changes: list[str] = []  # extraction settings/provenance that differ from the latest version's
    dataset_id: str | None = None
    dataset_version: int | None = None
    extracted_rows: int = 0
    trained: bool = False
    warm_start_from: str | None = None
    artifact_digest: str | None = None
    decision: str | None = None
    reasons: list[str] = []
