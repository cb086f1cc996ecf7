"""Dataset manifest: written last; a dataset without one is not a dataset."""

from __future__ import annotations

from datetime import UTC, datetime

from pydantic import BaseModel, ConfigDict, Field

from schemas.capture import CapturePoint
from schemas.identity import TargetIdentity
from schemas.provenance import TensorProvenance

MANIFEST_NAME = "manifest.json"


class SourceInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    uri: str
    sha256: str
    rows: int
    format: str
    # the target's own responses (``strata regenerate``): its record -- target, engine, sampling
    regeneration: dict | None = None


class ShardRecord(BaseModel):
    """One committed work unit: its source rows, and the shard file if any row survived."""

    model_config = ConfigDict(extra="forbid")

    unit: int
    source_rows: tuple[int, int]  # [start, end) of source row indices
    path: str | None  # relative to the dataset root; None if no rows
    rows: int
    tokens: int
    loss_tokens: int
    quarantined: int
    bytes: int
    sha256: str | None
    quarantine_path: str | None = None
    inherited_from: str | None = None  # dataset id of the earlier version this shard belongs to
    # Rows captured and handed straight to training (streaming mode): neither stored nor quarantined.
    streamed: int = 0
    streamed_tokens: int = 0
    # Seconds this unit spent per stage (tokenize, forward, byte_split, compress, parquet, hash,
    # write, commit, writer_wait; engine_start on the first unit each capture actor commits).
    seconds: dict[str, float] = {}


class Totals(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_rows: int
    rows: int
    quarantined: int
    tokens: int
    loss_tokens: int
    bytes: int
    shards: int
    streamed: int = 0  # rows streamed to training, not stored (tokens/bytes count stored rows only)
    streamed_tokens: int = 0


class DatasetManifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format_version: int = 1
    dataset_id: str
    created_at: str = Field(default_factory=lambda: datetime.now(UTC).isoformat())
    target: TargetIdentity
    capture_points: list[CapturePoint]
    columns: list[TensorProvenance]
    extraction: dict
    software: dict[str, str]
    source: SourceInfo
    shards: list[ShardRecord]
    totals: Totals
    quarantine_path: str | None = None
    fingerprints: dict | None = None  # {"path", "sha256", "probe_samples", "dim", "seed"}
    # Wall seconds of the job that wrote this version, per stage (target_identity, source_scan,
    # ray_start, capture, manifest, fingerprints, total); per-unit stages are in each shard.
    seconds: dict[str, float] = {}
    # A dataset version built on earlier ones lists their shards (inherited_from set, paths
    # relative to this root, e.g. ../v0001/part/shards/...) instead of copying them.
    parents: list[str] = []

    def unit_seconds(self) -> dict[str, float]:
        """Per-unit stage seconds summed over the shards this version extracted (not inherited)."""
        out: dict[str, float] = {}
        for s in self.shards:
            if s.inherited_from is None:
                for k, v in s.seconds.items():
                    out[k] = out.get(k, 0.0) + v
        return out

    def time_breakdown(self) -> str:
        """One line: the job's stages, then inside capture the units' stages summed (actors and
        writer threads run concurrently, so those sums can exceed capture's wall time)."""
        job = ", ".join(f"{k} {v:.1f}s" for k, v in self.seconds.items())
        units = ", ".join(f"{k} {v:.1f}s" for k, v in sorted(self.unit_seconds().items(), key=lambda kv: -kv[1]))
        return f"{job}; units summed: {units}"

    def reconcile(self) -> None:
        """Raise unless every input row is either written, quarantined or streamed, exactly once."""
        own = [s for s in self.shards if s.inherited_from is None]
        rows = sum(s.rows for s in own)
        quar = sum(s.quarantined for s in own)
        streamed = sum(s.streamed for s in own)
        covered = sorted(s.source_rows for s in own)
        pos = 0
        for a, b in covered:
            if a != pos:
                raise ValueError(
                    f"manifest {self.dataset_id}: source rows {pos}..{a} are not covered by any shard (or covered twice)"
                )
            pos = b
        if pos != self.source.rows:
            raise ValueError(
                f"manifest {self.dataset_id}: shards cover {pos} source rows, source has {self.source.rows}"
            )
        if rows + quar + streamed != self.source.rows:
            raise ValueError(
                f"manifest {self.dataset_id}: counts do not reconcile: input {self.source.rows} != "
                f"written {rows} + quarantined {quar}" + (f" + streamed {streamed}" if streamed else "")
            )
        all_rows, all_quar = sum(s.rows for s in self.shards), sum(s.quarantined for s in self.shards)
        if all_rows != self.totals.rows or all_quar != self.totals.quarantined:
            raise ValueError(
                f"manifest {self.dataset_id}: totals ({self.totals.rows} rows, {self.totals.quarantined} "
                f"quarantined) disagree with its shards ({all_rows}, {all_quar})"
            )
        for field in ("tokens", "loss_tokens", "bytes", "streamed", "streamed_tokens"):
            summed = sum(getattr(s, field) for s in self.shards)
            if summed != getattr(self.totals, field):
                raise ValueError(
                    f"manifest {self.dataset_id}: totals.{field} {getattr(self.totals, field)} != the "
                    f"shards' sum {summed}"
                )
        unknown = {s.inherited_from for s in self.shards if s.inherited_from} - set(self.parents)
        if unknown:
            raise ValueError(f"manifest {self.dataset_id}: shards inherited from {sorted(unknown)}, not in its parents")
