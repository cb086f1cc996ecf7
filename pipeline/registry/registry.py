"""The artifact registry: content-addressed drafts, validation records, channels, audit.

Layout inside the store:
    artifacts/<digest>/{config.json, model.safetensors, strata_artifact.json}
    records/<digest>/<serving key>/<record digest>.json   immutable, content-addressed
    channels/<name>/spec.json          the channel's serving configuration (write-once)
    channels/<name>/pointer.json       which artifact it serves (conditional updates only)
    audit/<timestamp>-<uuid>.json      one object per decision, never overwritten

A channel moves only to an artifact with a passing record for that channel's serving
configuration, by a conditional write on the pointer: of two concurrent promotions one
wins, the other is refused and audited. A record counts only when it is what its key says:
its body hashes to its file name, it names this artifact and exactly the channel's serving
configuration, it is not dated in the future, and -- when the registry has a signing key
(``STRATA_REGISTRY_KEY``) -- its HMAC verifies, so a writer without the key cannot forge one.
The pointer names the record it was promoted on by digest. Trust model: pipeline/registry/README.md.
"""

from __future__ import annotations

import getpass
import hashlib
import hmac
import logging
import os
import socket
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

from pipeline.store.objects import ObjectStore, PreconditionFailed
from schemas.artifact import ARTIFACT_MANIFEST, DraftArtifactManifest, content_digest
from schemas.registry import (
    AuditEntry,
    ChannelPointer,
    ChannelSpec,
    Deployment,
    ValidationRecord,
    check_channel,
    check_digest,
)

log = logging.getLogger(__name__)

ARTIFACT_FILES = ("config.json", "model.safetensors", ARTIFACT_MANIFEST)
SIGNING_KEY_ENV = "STRATA_REGISTRY_KEY"
CLOCK_SKEW = timedelta(minutes=5)


class PromotionRefused(RuntimeError):
    def __init__(self, reasons: list[str]):
        super().__init__("; ".join(reasons))
        self.reasons = reasons


def _actor() -> str:
    try:
        return f"{getpass.getuser()}@{socket.gethostname()}"
    except Exception:  # an unknown user is still auditable
        return f"unknown@{socket.gethostname()}"


class Registry:
    def __init__(self, store: ObjectStore, signing_key: str | bytes | None = None):
        """``signing_key`` (default: $STRATA_REGISTRY_KEY): records are signed when written and
        must verify to count; without one, anyone who can write the store is trusted."""
        self.store = store
        key = signing_key if signing_key is not None else os.environ.get(SIGNING_KEY_ENV) or None
        self._key = key.encode() if isinstance(key, str) else key

    def _sign(self, record: ValidationRecord) -> str:
        return hmac.new(self._key, record.body(), hashlib.sha256).hexdigest()  # type: ignore[arg-type]

    def record_problems(self, record: ValidationRecord, key: str, digest: str, serving: Deployment | None) -> list[str]:
        """Why a stored record does not vouch for ``digest`` under ``serving`` (empty: it does)."""
        problems = []
        if key.rsplit("/", 1)[-1] != f"{record.digest}.json":
            problems.append(
                f"{key} does not hold the record its name says (content digest {record.digest[:16]}): "
                "edited after it was written"
            )
        if record.artifact_digest != digest:
            problems.append(f"{key} is a record of artifact {record.artifact_digest[:16]}, not {digest[:16]}")
        if serving is not None and record.serving != serving:
            problems.append(
                f"{key} was validated for serving configuration {record.serving.key}, not exactly {serving.key}"
            )
        try:
            created = datetime.fromisoformat(record.created_at)
            if created.tzinfo is None or created > datetime.now(UTC) + CLOCK_SKEW:
                problems.append(f"{key} is dated {record.created_at}, in the future")
        except ValueError:
            problems.append(f"{key} has no valid created_at ({record.created_at!r})")
        if self._key is not None and not (
            record.signature and hmac.compare_digest(record.signature, self._sign(record))
        ):
            problems.append(
                f"{key} is {'not signed' if not record.signature else 'signed with another key'}: only a "
                f"writer holding {SIGNING_KEY_ENV} may record validations"
            )
        return problems

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
        actual = content_digest(d)
        if actual != manifest.content_digest:
            raise ValueError(
                f"{d}: content digest {actual[:16]} does not match its manifest's {manifest.content_digest[:16]}"
            )
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
            self._audit(
                AuditEntry(
                    action="add_artifact", decision="accepted", artifact_digest=manifest.content_digest, actor=_actor()
                )
            )
        return manifest

    def fetch_artifact(self, digest: str, dest: str | Path) -> Path:
        """Download an artifact into ``dest`` (a new directory) and check its content digest."""
        check_digest(digest)
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
        self._audit(
            AuditEntry(
                action="retrain",
                decision="refused" if record.outcome in ("refused", "failed") else "accepted",
                channel=record.channel,
                artifact_digest=record.artifact_digest,
                reasons=[record.message, *record.reasons],
                actor=_actor(),
                details=record.model_dump(mode="json"),
            )
        )

    def artifact(self, digest: str) -> DraftArtifactManifest | None:
        check_digest(digest)
        got = self.store.get(f"artifacts/{digest}/{ARTIFACT_MANIFEST}")
        return DraftArtifactManifest.model_validate_json(got[0]) if got else None

    def artifacts(self) -> list[str]:
        return sorted({k.split("/")[1] for k in self.store.list("artifacts/") if k.endswith(ARTIFACT_MANIFEST)})

    # -- records ------------------------------------------------------------------------------
    def add_record(self, record: ValidationRecord) -> str:
        """Write a record under its content digest (signed when the registry has a key); its key."""
        check_digest(record.artifact_digest)
        if self.artifact(record.artifact_digest) is None:
            raise ValueError(f"no artifact {record.artifact_digest[:16]} in the registry: add it before its records")
        if self._key is not None:
            record = record.model_copy(update={"signature": self._sign(record)})
        key = f"records/{record.artifact_digest}/{record.serving.key}/{record.digest}.json"
        self.store.put(key, record.model_dump_json().encode(), if_none_match=True)
        self._audit(
            AuditEntry(
                action="add_record",
                decision="accepted",
                artifact_digest=record.artifact_digest,
                serving_key=record.serving.key,
                reasons=[f"{record.decision}: {r}" for r in record.reasons],
                actor=_actor(),
            )
        )
        return key

    def records(self, digest: str, serving: Deployment | None = None) -> list[ValidationRecord]:
        """The records that vouch for ``digest`` (under ``serving``, when given), oldest first."""
        return [r for r, problems in self.all_records(digest, serving) if not problems]

    def all_records(self, digest: str, serving: Deployment | None = None) -> list[tuple[ValidationRecord, list[str]]]:
        """Every record stored under ``digest`` with what is wrong with it, oldest first."""
        check_digest(digest)
        prefix = f"records/{digest}/" + (f"{serving.key}/" if serving else "")
        out = []
        for k in self.store.list(prefix):
            got = self.store.get(k)
            if not got:
                continue
            try:
                r = ValidationRecord.model_validate_json(got[0])
            except ValueError as e:
                log.warning("unreadable validation record %s: %s", k, str(e).splitlines()[0])
                continue
            out.append((r, self.record_problems(r, k, digest, serving)))
        return sorted(out, key=lambda x: x[0].created_at)

    # -- channels -------------------------------------------------------------------------------
    def create_channel(self, channel: str, serving: Deployment) -> ChannelSpec:
        check_channel(channel)
        spec = ChannelSpec(channel=channel, serving=serving)
        try:
            self.store.put(f"channels/{channel}/spec.json", spec.model_dump_json().encode(), if_none_match=True)
        except PreconditionFailed:
            existing = self.channel_spec(channel)
            if existing is None or existing.serving != serving:
                raise ValueError(f"channel {channel!r} exists with another serving configuration") from None
            return existing
        self._audit(
            AuditEntry(
                action="create_channel", decision="accepted", channel=channel, serving_key=serving.key, actor=_actor()
            )
        )
        return spec

    def channel_spec(self, channel: str) -> ChannelSpec | None:
        check_channel(channel)
        got = self.store.get(f"channels/{channel}/spec.json")
        return ChannelSpec.model_validate_json(got[0]) if got else None

    def pointer(self, channel: str) -> tuple[ChannelPointer | None, str | None]:
        check_channel(channel)
        got = self.store.get(f"channels/{channel}/pointer.json")
        return (ChannelPointer.model_validate_json(got[0]), got[1]) if got else (None, None)

    def channels(self) -> list[str]:
        return sorted({k.split("/")[1] for k in self.store.list("channels/") if k.endswith("spec.json")})

    def promote(self, digest: str, channel: str) -> ChannelPointer:
        """Point ``channel`` at ``digest`` if a passing record covers the channel's serving config."""
        check_channel(channel)
        check_digest(digest)
        spec = self.channel_spec(channel)
        reasons: list[str] = []
        record = None
        if spec is None:
            reasons.append(f"channel {channel!r} does not exist (create it with its serving configuration first)")
        elif self.artifact(digest) is None:
            reasons.append(f"artifact {digest[:16]} is not in the registry")
        else:
            found = self.all_records(digest, spec.serving)
            recs = [r for r, problems in found if not problems]
            if not recs:
                others = self.records(digest)
                reasons.append(
                    f"no validation record of artifact {digest[:16]} for channel {channel!r}'s serving configuration "
                    f"{spec.serving.key} ({spec.serving.engine} {spec.serving.engine_version}, {spec.serving.dtype}, "
                    f"TP {spec.serving.tp_size})"
                    + (f"; records exist for {sorted({r.serving.key for r in others})}" if others else "")
                )
                reasons += [p for _, problems in found for p in problems]
            else:
                record = recs[-1]
                if record.decision != "pass":
                    reasons.append(
                        f"the latest validation of {digest[:16]} for this serving configuration blocked it: "
                        + "; ".join(record.reasons)
                    )
        if reasons:
            self._refuse(channel, digest, spec, reasons)
        current, etag = self.pointer(channel)
        new = ChannelPointer(
            channel=channel,
            artifact_digest=digest,
            record_id=record.record_id,  # type: ignore[union-attr]
            record_digest=record.digest,  # type: ignore[union-attr]
            serving_key=spec.serving.key,
            previous_digest=current.artifact_digest if current else None,
        )  # type: ignore[union-attr]
        try:
            if etag is None:
                self.store.put(f"channels/{channel}/pointer.json", new.model_dump_json().encode(), if_none_match=True)
            else:
                self.store.put(f"channels/{channel}/pointer.json", new.model_dump_json().encode(), if_match=etag)
        except PreconditionFailed:
            self._refuse(channel, digest, spec, [f"channel {channel!r} was updated concurrently; re-read it and retry"])
        self._audit(
            AuditEntry(
                action="promote",
                decision="accepted",
                channel=channel,
                artifact_digest=digest,
                serving_key=spec.serving.key,
                reasons=[f"record {record.record_id} passed"],
                actor=_actor(),
            )
        )  # type: ignore[union-attr]
        log.info("channel %s -> %s", channel, digest[:16])
        return new

    def _refuse(self, channel: str, digest: str, spec: ChannelSpec | None, reasons: list[str]) -> None:
        self._audit(
            AuditEntry(
                action="promote",
                decision="refused",
                channel=channel,
                artifact_digest=digest,
                serving_key=spec.serving.key if spec else None,
                reasons=reasons,
                actor=_actor(),
            )
        )
        raise PromotionRefused(reasons)
