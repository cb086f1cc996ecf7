"""One retrain pass, and the loop that repeats it.

Under a lease (one scheduler per name): find the source rows not yet extracted for this
target identity, extract only those into a new dataset version (a new target revision
starts a new lineage, a changed extraction -- engine release, dtype, capture points -- a new
base version: everything is re-extracted and neither is ever mixed), train --
warm from the channel's draft when target and capture points are unchanged -- validate
against the channel's serving configuration, and promote only through the gate. Every pass
writes a run record to the registry's audit log, including the ones that do nothing.
"""

from __future__ import annotations

import logging
import posixpath
import shutil
import signal
import tempfile
import threading
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from pipeline.errors import UnusableInput
from pipeline.identity import target_identity
from pipeline.registry.registry import PromotionRefused, Registry
from pipeline.retrain import versions
from pipeline.store.fs import list_files, read_bytes, resolve
from pipeline.store.lease import Lease, LeaseHeld
from pipeline.store.objects import open_store
from pipeline.store.reader import load_manifest
from pipeline.train.job import run_train
from pipeline.validate.job import run_validate
from schemas.artifact import DraftArtifactManifest
from schemas.retrain import RetrainConfig, RunRecord

log = logging.getLogger(__name__)


class RetrainError(UnusableInput):
    pass


def _completed_runs(reg: Registry, cfg: RetrainConfig) -> list[dict]:
    return [
        e.details
        for e in reg.history(cfg.channel)
        if e.action == "retrain"
        and e.details
        and e.details.get("name") == cfg.name
        and e.details.get("outcome") in ("promoted", "blocked", "refused")
    ]


def run_retrain(cfg: RetrainConfig, progress: bool = True) -> RunRecord:
    """One idempotent pass. Raises LeaseHeld when another scheduler is running."""
    reg = Registry(open_store(cfg.registry, cfg.s3))
    spec = reg.channel_spec(cfg.channel)
    if spec is None:
        raise RetrainError(
            f"channel {cfg.channel!r} does not exist in {cfg.registry}: create it with "
            "`strata registry create-channel` (its serving configuration) first"
        )
    run_id = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6]
    with Lease(reg.store, f"retrain-{cfg.name}", cfg.lease_ttl_s, run_id) as lease:
        try:
            record = _pass(cfg, reg, spec, run_id, lease, progress)
        except Exception as e:
            reg.record_run(
                RunRecord(
                    run_id=run_id,
                    name=cfg.name,
                    channel=cfg.channel,
                    target_key="",
                    outcome="failed",
                    message=f"{type(e).__name__}: {e}",
                )
            )
            raise
        reg.record_run(record)
    log.info("retrain %s: %s - %s", run_id, record.outcome, record.message)
    return record


@dataclass
class _Survey:
    """What the channel serves and what the source holds now, for this target identity."""

    current: DraftArtifactManifest | None  # the channel's artifact
    changed: bool  # the target identity differs from the channel's
    lineage: str
    latest: tuple | None  # (DatasetVersion, uri) of the lineage's newest version
    changes: list[str]  # how the extraction recipe differs from the latest's
    base: tuple | None  # the version new rows are added to (None: start over)
    source_rows: int
    fresh: list
    digests: list


def _survey(cfg: RetrainConfig, reg: Registry, identity) -> _Survey:
    pointer, _ = reg.pointer(cfg.channel)
    current = reg.artifact(pointer.artifact_digest) if pointer else None
    lineage = versions.lineage_uri(cfg.data_root, identity)
    latest = versions.latest_version(lineage, cfg.s3)
    changes = (
        versions.recipe_changes(
            versions.manifest_recipe(load_manifest(latest[1], cfg.s3)), versions.config_recipe(cfg, identity)
        )
        if latest
        else []
    )
    base = None if changes else latest  # a version only inherits rows extracted the same way
    seen = versions.seen_digests(base[1], cfg.s3) if base else set()
    source_rows, fresh, digests = versions.new_rows(cfg, seen)
    return _Survey(
        current,
        current is not None and current.target.key != identity.key,
        lineage,
        latest,
        changes,
        base,
        source_rows,
        fresh,
        digests,
    )


def _pass(cfg: RetrainConfig, reg: Registry, spec, run_id: str, lease: Lease, progress: bool) -> RunRecord:
    """Survey, extract what is new, train, then validate and promote through the gate."""
    identity = target_identity(cfg.target.path, cfg.target.name, cfg.target.revision)
    sv = _survey(cfg, reg, identity)
    rec = RunRecord(
        run_id=run_id,
        name=cfg.name,
        channel=cfg.channel,
        target_key=identity.key,
        outcome="noop",
        message="",
        source_rows=sv.source_rows,
        new_rows=len(sv.fresh),
        identity_changed=sv.changed,
        recipe_changes=sv.changes,
    )
    if sv.changed:
        log.info(
            "target identity changed (%s -> %s): a new lineage, everything is extracted again",
            sv.current.target.key[:12],
            identity.key[:12],
        )  # type: ignore[union-attr]
    if sv.changes:
        log.info(
            "extraction changed since %s (%s): a new base version, everything is extracted again",
            sv.latest[0].dataset_id,
            "; ".join(sv.changes),
        )  # type: ignore[index]
    if not sv.fresh and sv.base is None:
        rec.message = f"the source {cfg.source.uri} has no rows to extract"
        return rec
    done = {r.get("dataset_id") for r in _completed_runs(reg, cfg)}
    if not sv.fresh and sv.latest is not None and sv.latest[0].dataset_id in done:
        rec.dataset_id, rec.dataset_version = sv.latest[0].dataset_id, sv.latest[0].version
        rec.message = (
            f"nothing new: all {sv.source_rows} source rows are in {sv.latest[0].dataset_id}, which a "
            "previous run already trained and validated; no extraction, no training"
        )
        return rec
    if sv.fresh:
        number = sv.latest[0].version + 1 if sv.latest else 1
        version, uri = versions.build_version(
            cfg, identity, sv.lineage, number, sv.base, sv.fresh, sv.source_rows, sv.digests, progress
        )
        rec.extracted_rows = len(sv.fresh)
    else:
        version, uri = sv.latest  # type: ignore[misc]  # extracted by a run that did not finish training
    rec.dataset_id, rec.dataset_version = version.dataset_id, version.version
    out = posixpath.join(cfg.data_root.rstrip("/"), "runs", run_id)
    _train(cfg, reg, sv, uri, out, rec)
    return _validate_and_promote(cfg, reg, spec, out, lease, rec)


def _train(cfg: RetrainConfig, reg: Registry, sv: _Survey, dataset_uri: str, out: str, rec: RunRecord) -> None:
    """Train on the version, warm from the channel's draft when target and aux points are unchanged."""
    init_from = None
    with tempfile.TemporaryDirectory(prefix="strata-warm-") as tmp:
        if cfg.warm_start and sv.current is not None and not sv.changed:
            tcfg = cfg.train_config(dataset_uri, out, None)
            wanted = [str(p) for p in tcfg.aux] if tcfg.aux else None
            if wanted is None or wanted == [str(p) for p in sv.current.aux_capture_points]:
                init_from = str(reg.fetch_artifact(sv.current.content_digest, Path(tmp) / "start"))
                rec.warm_start_from = sv.current.content_digest
        run_train(cfg.train_config(dataset_uri, out, init_from), use_ray=cfg.use_ray)
    rec.trained = True


def _validate_and_promote(cfg: RetrainConfig, reg: Registry, spec, out: str, lease: Lease, rec: RunRecord) -> RunRecord:
    artifact = _local_artifact(out, spec.serving.engine, cfg)
    try:
        report = run_validate(cfg.validate_config(str(artifact)))
    finally:
        if out.startswith("s3://"):  # a downloaded copy: validation is done with it
            shutil.rmtree(artifact, ignore_errors=True)
    rec.artifact_digest, rec.decision = report.artifact_digest, report.decision
    rec.reasons = list(report.reasons)
    lease.check()
    if report.decision != "pass":
        rec.outcome = "blocked"
        rec.message = f"validation blocked {report.artifact_digest[:16]}; channel {cfg.channel} unchanged"
        return rec
    try:
        reg.promote(report.artifact_digest, cfg.channel)
    except PromotionRefused as e:
        rec.outcome, rec.reasons = "refused", list(e.reasons)
        rec.message = f"the gate refused {report.artifact_digest[:16]} for {cfg.channel}; channel unchanged"
        return rec
    rec.outcome = "promoted"
    rec.message = (
        f"{cfg.channel} -> {report.artifact_digest[:16]}: {rec.extracted_rows} rows extracted, trained "
        f"{'warm from ' + rec.warm_start_from[:16] if rec.warm_start_from else 'from scratch'} on "
        f"{rec.dataset_id}"
    )
    return rec


def _local_artifact(run_out: str, engine: str, cfg: RetrainConfig) -> Path:
    """The exported draft for the channel's engine, as a local directory (validation reads it)."""
    if not run_out.startswith("s3://"):
        return Path(run_out) / "export" / engine

    fs, root = resolve(posixpath.join(run_out, "export", engine), cfg.s3)
    dest = Path(tempfile.mkdtemp(prefix="strata-artifact-"))
    for path in list_files(fs, root):
        (dest / posixpath.basename(path)).write_bytes(read_bytes(fs, path))
    return dest


def parse_every(text: str) -> float:
    """'6h', '30m', '45s', '1d' -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        value = float(text[:-1]) * units[text[-1]]
    except (KeyError, ValueError, IndexError):
        raise ValueError(f"--every {text!r}: expected a number and a unit s/m/h/d, e.g. 6h") from None
    if value <= 0:
        raise ValueError(f"--every {text!r}: must be positive")
    return value


def run_forever(cfg: RetrainConfig, every_s: float, progress: bool = False, max_runs: int | None = None) -> int:
    """Repeat passes every ``every_s``; SIGTERM/SIGINT finish the current pass, then stop."""
    stop = threading.Event()

    def on_signal(signum, _frame):
        log.info("signal %d: stopping after the current pass", signum)
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    runs = 0
    try:
        while not stop.is_set():
            try:
                run_retrain(cfg, progress)
            except LeaseHeld as e:
                log.warning("skipping this pass: %s", e)
            except Exception:  # a scheduler survives a failed pass and tries again
                log.exception("retrain pass failed; next pass in %.0f s", every_s)
            runs += 1
            if max_runs is not None and runs >= max_runs:
                break
            stop.wait(every_s)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    log.info("retrain scheduler stopped after %d passes", runs)
    return 0
