"""The extraction job: source -> capture actors (tokenize, capture, write) -> shards -> manifest.

Resumable and exactly-once: units already committed (``_units/*.json``) are skipped,
a unit's shard only becomes visible through an atomic publish, and the manifest is
written last, after the counts reconcile.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import platform

import pyarrow as pa

import pipeline
from pipeline import placement
from pipeline.cluster import init_ray, require_resources
from pipeline.conventions import boundary_label, describe_point, same_tensor
from pipeline.data.source import regeneration_of, scan_source
from pipeline.engines import engine_ref
from pipeline.errors import UnusableInput
from pipeline.extract import layout
from pipeline.extract.pool import CapturePool
from pipeline.identity import target_identity
from pipeline.stopwatch import Stopwatch
from pipeline.store.fs import atomic_write_bytes, exists, join, read_bytes, resolve
from pipeline.store.lease import Lease, LeaseHeld
from pipeline.store.objects import open_store
from pipeline.unitpool import committed
from schemas.dataset import ENCODING, dataset_schema
from schemas.extract import ExtractConfig
from schemas.identity import TargetIdentity
from schemas.manifest import MANIFEST_NAME, DatasetManifest, ShardRecord, SourceInfo, Totals
from schemas.provenance import TensorProvenance

log = logging.getLogger(__name__)
LEASE_TTL_S = 120.0  # renewed every 40 s; a crashed holder on this host is taken over at once


class ExtractionError(UnusableInput):
    pass


def software_versions() -> dict[str, str]:
    """Read from package metadata: the job's own process never imports torch or transformers
    (seconds of start-up); the engines that compute live in the capture actors."""
    out = {"strata": pipeline.__version__, "python": platform.python_version(), "pyarrow": pa.__version__}
    for dist in ("torch", "transformers", "ray"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def build_schema(cfg: ExtractConfig, identity: TargetIdentity) -> tuple[pa.Schema, list[TensorProvenance]]:
    n = identity.num_layers
    provs = [
        TensorProvenance(
            capture_point=p,
            boundary=boundary_label(p, n),
            dtype=cfg.engine.dtype,
            hidden_size=identity.hidden_size,
            encoding=ENCODING,
            engine=engine_ref(cfg, p, n),
            target_model=identity.model_name,
            target_key=identity.key,
        )
        for p in cfg.capture
    ]
    schema = dataset_schema(provs, identity.model_dump_json(), extraction_json(cfg), software_versions())
    return schema, provs


def extraction_json(cfg: ExtractConfig) -> str:
    """The parts of the config that determine the data (not where or how fast it runs)."""
    return json.dumps(cfg.model_dump(mode="json", exclude={"ray", "s3"}), sort_keys=True)


def check_plan(cfg: ExtractConfig, identity: TargetIdentity) -> None:
    """Refuse, in one line and before any engine or Ray task starts, what would fail later:
    points outside the target, two points naming one tensor, points the engine cannot
    capture, a target without a chat template."""
    n = identity.num_layers
    for p in cfg.capture:
        p.validate_for(n)
    for i, a in enumerate(cfg.capture):
        for b in cfg.capture[i + 1 :]:
            if same_tensor(a, b, n):
                raise ExtractionError(
                    f"capture points {a} and {b} name the same tensor ({boundary_label(a, n)}) on "
                    f"this {n}-layer target: keep one"
                )
    if cfg.engine.name != "hf":
        for p in cfg.capture:
            if engine_ref(cfg, p, n).native_id is None:
                raise ExtractionError(
                    f"engine {cfg.engine.name} cannot capture {p}, {describe_point(p, n)}, on this "
                    f"target: drop it or use engine hf"
                )
    if identity.chat_template_sha256 is None:
        raise ExtractionError(
            f"target {cfg.target.path} has no chat template (chat_template.jinja or "
            "tokenizer_config.json chat_template): conversations cannot be rendered"
        )


def _check_job_file(fs, root: str, fingerprint: str, cfg: ExtractConfig) -> None:
    path = join(root, layout.JOB_FILE)
    if exists(fs, path):
        prev = json.loads(read_bytes(fs, path))
        if prev["fingerprint"] != fingerprint:
            raise ExtractionError(
                f"output.uri {cfg.output.uri} holds a partial extraction with another configuration, target "
                f"or source (job {prev['fingerprint']}, this job {fingerprint}); use a new output.uri or delete it"
            )
        return
    atomic_write_bytes(
        fs, path, json.dumps({"fingerprint": fingerprint, "extraction": json.loads(extraction_json(cfg))}).encode()
    )


def run_extract(
    cfg: ExtractConfig,
    progress: bool = True,
    use_ray: bool = True,
    keep: set[int] | None = None,
    pool: CapturePool | None = None,
) -> DatasetManifest:
    """Extract ``cfg.source`` into ``cfg.output``; resumes a crashed run of the same job.

    ``use_ray=False`` runs the same steps in this process (tests, and benchmarks on a GPU
    box without Ray). A streaming training run stores only the source rows in ``keep`` (its
    held-out samples; the manifest counts the others as streamed) on the capture actors of
    its own ``pool``, which it keeps using afterwards.
    """
    clock = Stopwatch()
    with clock("target_identity"):
        identity = target_identity(cfg.target.path, cfg.target.name, cfg.target.revision)
    check_plan(cfg, identity)
    log.info("target %s", identity.describe())
    fs, root = resolve(cfg.output.uri, cfg.s3)
    with clock("source_scan"):
        scan = scan_source(cfg.source.uri, cfg.source.format, cfg.s3)
    if not scan.rows:
        raise ExtractionError(f"source.uri {cfg.source.uri} has no rows: nothing to extract")
    fingerprint = layout.job_fingerprint(json.loads(extraction_json(cfg)), identity.key, scan.sha256, keep)
    if exists(fs, join(root, MANIFEST_NAME)):
        from pipeline.store.reader import load_manifest

        m = load_manifest(cfg.output.uri, cfg.s3)
        if m.dataset_id.endswith(fingerprint):
            log.info("dataset %s is already complete: nothing to do", m.dataset_id)
            return m
        raise ExtractionError(
            f"output.uri {cfg.output.uri} already holds dataset {m.dataset_id}; choose another output.uri"
        )
    if use_ray and pool is None:  # before anything is written (a finished dataset needs no cluster)
        clock.start("ray_start")
        init_ray(cfg.ray.address, dashboard=False)
        r = cfg.ray
        gpus = f" x gpus_per_actor {r.gpus_per_actor:g}" if r.gpus_per_actor else ""
        require_resources(
            f"ray: {r.num_actors} capture actors x cpus_per_actor {r.cpus_per_actor:g}{gpus}",
            placement.plan_bundles(r),
            "lower ray.cpus_per_actor or ray.num_actors",
            r.resource_wait_s,
        )
        placement.check_nodes(r)
        clock.stop("ray_start")
    # One job per output at a time: a second one started on it refuses instead of racing.
    lease = Lease(open_store(cfg.output.uri, cfg.s3), "extract", ttl_s=LEASE_TTL_S)
    try:
        lease.acquire()
    except LeaseHeld as e:
        raise ExtractionError(
            f"output.uri {cfg.output.uri} is being extracted by {e.holder.describe()}: wait for "
            "it (once it finishes, this job is a no-op) or use another output.uri"
        ) from None
    try:
        if exists(fs, join(root, MANIFEST_NAME)):  # finished while this job waited for the lease
            from pipeline.store.reader import load_manifest

            return load_manifest(cfg.output.uri, cfg.s3)
        _check_job_file(fs, root, fingerprint, cfg)
        return _extract(cfg, identity, fs, root, scan, fingerprint, progress, use_ray, clock, keep, pool)
    finally:
        lease.release()


def _extract(
    cfg: ExtractConfig,
    identity: TargetIdentity,
    fs,
    root: str,
    scan,
    fingerprint: str,
    progress: bool,
    use_ray: bool,
    clock: Stopwatch,
    keep: set[int] | None = None,
    pool: CapturePool | None = None,
) -> DatasetManifest:
    """Extract every uncommitted unit, then publish the manifest (the lease is held)."""
    schema, provs = build_schema(cfg, identity)
    units = layout.plan_units(len(scan.rows), cfg.output.rows_per_shard)
    done = committed(fs, root, layout.UNITS_DIR, ShardRecord, ExtractionError, "re-extract")
    pending = [u for u in units if u.unit not in done]
    log.info(
        "source %s: %d rows in %d units; %d already committed, %d to extract",
        cfg.source.uri,
        len(scan.rows),
        len(units),
        len(done),
        len(pending),
    )
    own_pool = pool is None
    pool = pool or CapturePool(cfg, schema, len(pending), use_ray)
    ok = False
    try:
        if pending:
            payload = [
                {"unit": u.unit, "start": u.start, "rows": [r.data for r in scan.rows[u.start : u.end]]}
                | ({} if keep is None else {"keep": [r for r in range(u.start, u.end) if r in keep]})
                for u in pending
            ]
            with clock("capture"):
                for rec in pool.run(payload, progress):
                    done[rec.unit] = rec
        done = committed(fs, root, layout.UNITS_DIR, ShardRecord, ExtractionError, "re-extract")
        missing = [u.unit for u in units if u.unit not in done]
        if missing:
            raise RuntimeError(f"units {missing[:10]} were not committed; re-run the job to resume")
        manifest = _publish(
            cfg, identity, fs, root, scan, fingerprint, [done[u.unit] for u in units], provs, pool, clock
        )
        ok = True
        return manifest
    finally:
        if own_pool:
            pool.close(graceful=ok)


def _publish(
    cfg: ExtractConfig,
    identity: TargetIdentity,
    fs,
    root: str,
    scan,
    fingerprint: str,
    shards: list[ShardRecord],
    provs: list[TensorProvenance],
    pool,
    clock: Stopwatch,
) -> DatasetManifest:
    """Reconcile the counts, fingerprint, and publish the manifest: the dataset's commit point."""
    clock.start("manifest")
    quarantine = b"".join(read_bytes(fs, join(root, s.quarantine_path)) for s in shards if s.quarantine_path)
    atomic_write_bytes(fs, join(root, layout.QUARANTINE_FILE), quarantine)
    manifest = DatasetManifest(
        dataset_id=f"{identity.model_name}-{fingerprint}",
        target=identity,
        capture_points=cfg.capture,
        columns=provs,
        extraction=json.loads(extraction_json(cfg)),
        software=software_versions(),
        source=SourceInfo(
            uri=cfg.source.uri,
            sha256=scan.sha256,
            rows=len(scan.rows),
            format=scan.format,
            regeneration=regeneration_of(cfg.source.uri, scan.sha256, cfg.s3),
        ),
        shards=shards,
        totals=Totals(
            input_rows=len(scan.rows),
            rows=sum(s.rows for s in shards),
            quarantined=sum(s.quarantined for s in shards),
            tokens=sum(s.tokens for s in shards),
            loss_tokens=sum(s.loss_tokens for s in shards),
            bytes=sum(s.bytes for s in shards),
            shards=sum(1 for s in shards if s.path),
            streamed=sum(s.streamed for s in shards),
            streamed_tokens=sum(s.streamed_tokens for s in shards),
        ),
        quarantine_path=layout.QUARANTINE_FILE,
    )
    manifest.reconcile()
    clock.stop("manifest")
    if cfg.fingerprint.probe_samples:
        with clock("fingerprints"):
            manifest.fingerprints = pool.fingerprint(manifest)
    manifest.seconds = clock.totals()
    atomic_write_bytes(fs, join(root, MANIFEST_NAME), manifest.model_dump_json(indent=1).encode())
    _cleanup_tmp(fs, root)
    t = manifest.totals
    dt = manifest.seconds["total"]
    log.info(
        "extracted %s: input rows %d = written %d + quarantined %d%s; %d shards, %d tokens, %.1f MB, %.0f tok/s (%.1fs)",
        manifest.dataset_id,
        t.input_rows,
        t.rows,
        t.quarantined,
        f" + streamed to training {t.streamed}" if t.streamed else "",
        t.shards,
        t.tokens,
        t.bytes / 1e6,
        t.tokens / dt,
        dt,
    )
    log.info("where the time went: %s", manifest.time_breakdown())
    return manifest


def _cleanup_tmp(fs, root: str) -> None:
    import pyarrow.fs as pafs

    if isinstance(fs, pafs.LocalFileSystem) and exists(fs, join(root, "_tmp")):
        fs.delete_dir(join(root, "_tmp"))
