"""The artifact registry: content-addressed drafts, validation records, channels, audit.

Layout inside the store:
    artifacts/<digest>/{config.json, model.safetensors, strata_artifact.json}
    records/<digest>/<serving key>/<record id>.json
    channels/<name>/spec.json          the channel's serving configuration (write-once)
    channels/<name>/pointer.json       which artifact it serves (conditional updates only)
    audit/<timestamp>-<uuid>.json      one object per decision, never overwritten

A channel moves only to an artifact with a passing record for that channel's serving
configuration, by a conditional write on the pointer: of two concurrent promotions one
wins, the other is refused and audited.
"""

from __future__ import annotations

import getpass
import logging
import socket
import uuid
from datetime import UTC, datetime
from pathlib import Path

from pipeline.registry.store import ObjectStore, PreconditionFailed
from schemas.artifact import ARTIFACT_MANIFEST, DraftArtifactManifest
from schemas.registry import (
    AuditEntry,
    ChannelPointer,
    ChannelSpec,
    ServingConfig,
    ValidationRecord,
)

log = logging.getLogger(__name__)

ARTIFACT_FILES = ("config.json", "model.safetensors", ARTIFACT_MANIFEST)


class PromotionRefused(RuntimeError):
    def __init__(self, reasons: list[str]):
        super().__init__("; ".join(reasons))
        self.reasons = reasons


def _actor() -> str:
    try:
        return f"{getpass.getuser()}@{socket.gethostname()}"
    except Exception:  # noqa: BLE001 - an unknown user is still auditable
        return f"unknown@{socket.gethostname()}"


class Registry:
    def __init__(self, store: ObjectStore):
        self.store = store

    # -- audit ----------------------------------------------------------------------------
    def _audit(self, entry: AuditEntry) -> None:
        ts = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
        self.store.put(f"audit/{ts}-{uuid.uuid4().hex[:8]}.json", entry.model_dump_json().encode(), if_none_match=True)

    def history(self, channel: str | None = None) -> list[AuditEntry]:
        out = []
        for key in self.store.list("audit/"):
            got = self.store.get(key)
            if got:
                e = AuditEntry.model_validate_json(got[0])
                if channel is None or e.channel == channel:
                    out.append(e)
        return out

    # -- artifacts --------------------------------------------------------------------------
    def add_artifact(self, directory: str | Path) -> DraftArtifactManifest:
        """Upload an exported draft under its content digest (idempotent; manifest last)."""
        d = Path(directory)
        manifest = DraftArtifactManifest.model_validate_json((d / ARTIFACT_MANIFEST).read_text())
        from pipeline.draft.export import content_digest

        actual = content_digest(d)
        if actual != manifest.content_digest:
            raise ValueError(f"{d}: content digest {actual[:16]} does not match its manifest's {manifest.content_digest[:16]}")
        base = f"artifacts/{manifest.content_digest}"
        if self.store.get(f"{base}/{ARTIFACT_MANIFEST}") is None:
            extra = [manifest.fingerprints["path"]] if manifest.fingerprints else []
            for name in [*ARTIFACT_FILES, *extra]:
                if name != ARTIFACT_MANIFEST:
                    self.store.put(f"{base}/{name}", (d / name).read_bytes())
            try:
                self.store.put(f"{base}/{ARTIFACT_MANIFEST}", (d / ARTIFACT_MANIFEST).read_bytes(), if_none_match=True)
            except PreconditionFailed:
                pass  # a concurrent upload of the same content won; identical bytes
            self._audit(AuditEntry(action="add_artifact", decision="accepted", artifact_digest=manifest.content_digest,
                                   actor=_actor()))
        return manifest

    def fetch_artifact(self, digest: str, dest: str | Path) -> Path:
        """Download an artifact into ``dest`` (a new directory) and check its content digest."""
        from pipeline.draft.export import content_digest

        m = self.artifact(digest)
        if m is None:
            raise KeyError(f"artifact {digest[:16]} is not in the registry")
        d = Path(dest)
        d.mkdir(parents=True, exist_ok=True)
        extra = [m.fingerprints["path"]] if m.fingerprints else []
        for name in [*ARTIFACT_FILES, *extra]:
            got = self.store.get(f"artifacts/{digest}/{name}")
            if got is None:
                raise FileNotFoundError(f"artifact {digest[:16]} lacks {name} in the registry")
            (d / name).write_bytes(got[0])
        if content_digest(d) != digest:
            raise ValueError(f"artifact {digest[:16]} fetched from the registry does not match its digest")
        return d

    def record_run(self, record) -> None:
        """A retrain pass's run record (schemas.retrain.RunRecord), in the audit log."""
        self._audit(AuditEntry(action="retrain", decision="refused" if record.outcome in ("refused", "failed") else
                               "accepted", channel=record.channel, artifact_digest=record.artifact_digest,
                               reasons=[record.message, *record.reasons], actor=_actor(),
                               details=record.model_dump(mode="json")))

    def artifact(self, digest: str) -> DraftArtifactManifest | None:
        got = self.store.get(f"artifacts/{digest}/{ARTIFACT_MANIFEST}")
        return DraftArtifactManifest.model_validate_json(got[0]) if got else None

    def artifacts(self) -> list[str]:
        return sorted({k.split("/")[1] for k in self.store.list("artifacts/") if k.endswith(ARTIFACT_MANIFEST)})

    # -- records ------------------------------------------------------------------------------
    def add_record(self, record: ValidationRecord) -> None:
        if self.artifact(record.artifact_digest) is None:
            raise ValueError(f"no artifact {record.artifact_digest[:16]} in the registry: add it before its records")
        key = f"records/{record.artifact_digest}/{record.serving.key}/{record.record_id}.json"
        self.store.put(key, record.model_dump_json().encode(), if_none_match=True)
        self._audit(AuditEntry(action="add_record", decision="accepted", artifact_digest=record.artifact_digest,
                               serving_key=record.serving.key, reasons=[f"{record.decision}: {r}" for r in record.reasons],
                               actor=_actor()))

    def records(self, digest: str, serving: ServingConfig | None = None) -> list[ValidationRecord]:
        prefix = f"records/{digest}/" + (f"{serving.key}/" if serving else "")
        out = []
        for k in self.store.list(prefix):
            got = self.store.get(k)
            if got:
                out.append(ValidationRecord.model_validate_json(got[0]))
        return sorted(out, key=lambda r: r.created_at)

    # -- channels -------------------------------------------------------------------------------
    def create_channel(self, channel: str, serving: ServingConfig) -> ChannelSpec:
        spec = ChannelSpec(channel=channel, serving=serving)
        try:
            self.store.put(f"channels/{channel}/spec.json", spec.model_dump_json().encode(), if_none_match=True)
        except PreconditionFailed:
            existing = self.channel_spec(channel)
            if existing is None or existing.serving != serving:
                raise ValueError(f"channel {channel!r} exists with another serving configuration") from None
            return existing
        self._audit(AuditEntry(action="create_channel", decision="accepted", channel=channel, serving_key=serving.key,
                               actor=_actor()))
        return spec

    def channel_spec(self, channel: str) -> ChannelSpec | None:
        got = self.store.get(f"channels/{channel}/spec.json")
        return ChannelSpec.model_validate_json(got[0]) if got else None

    def pointer(self, channel: str) -> tuple[ChannelPointer | None, str | None]:
        got = self.store.get(f"channels/{channel}/pointer.json")
        return (ChannelPointer.model_validate_json(got[0]), got[1]) if got else (None, None)

    def channels(self) -> list[str]:
        return sorted({k.split("/")[1] for k in self.store.list("channels/") if k.endswith("spec.json")})

    def promote(self, digest: str, channel: str) -> ChannelPointer:
        """Point ``channel`` at ``digest`` if a passing record covers the channel's serving config."""
        spec = self.channel_spec(channel)
        reasons: list[str] = []
        record = None
        if spec is None:
            reasons.append(f"channel {channel!r} does not exist (create it with its serving configuration first)")
        elif self.artifact(digest) is None:
            reasons.append(f"artifact {digest[:16]} is not in the registry")
        else:
            recs = self.records(digest, spec.serving)
            if not recs:
                others = self.records(digest)
                reasons.append(
                    f"no validation record of artifact {digest[:16]} for channel {channel!r}'s serving configuration "
                    f"{spec.serving.key} ({spec.serving.engine} {spec.serving.engine_version}, {spec.serving.dtype}, "
                    f"TP {spec.serving.tp_size})" + (f"; records exist for {sorted({r.serving.key for r in others})}" if others else "")
                )
            else:
                record = recs[-1]
                if record.decision != "pass":
                    reasons.append(f"the latest validation of {digest[:16]} for this serving configuration blocked it: "
                                   + "; ".join(record.reasons))
        if reasons:
            self._refuse(channel, digest, spec, reasons)
        current, etag = self.pointer(channel)
        new = ChannelPointer(channel=channel, artifact_digest=digest, record_id=record.record_id,  # type: ignore[union-attr]
                             serving_key=spec.serving.key, previous_digest=current.artifact_digest if current else None)  # type: ignore[union-attr]
        try:
            if etag is None:
                self.store.put(f"channels/{channel}/pointer.json", new.model_dump_json().encode(), if_none_match=True)
            else:
                self.store.put(f"channels/{channel}/pointer.json", new.model_dump_json().encode(), if_match=etag)
        except PreconditionFailed:
            self._refuse(channel, digest, spec, [f"channel {channel!r} was updated concurrently; re-read it and retry"])
        self._audit(AuditEntry(action="promote", decision="accepted", channel=channel, artifact_digest=digest,
                               serving_key=spec.serving.key, reasons=[f"record {record.record_id} passed"], actor=_actor()))  # type: ignore[union-attr]
        log.info("channel %s -> %s", channel, digest[:16])
        return new

    def _refuse(self, channel: str, digest: str, spec: ChannelSpec | None, reasons: list[str]) -> None:
        self._audit(AuditEntry(action="promote", decision="refused", channel=channel, artifact_digest=digest,
                               serving_key=spec.serving.key if spec else None, reasons=reasons, actor=_actor()))
        raise PromotionRefused(reasons)

