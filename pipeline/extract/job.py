"""The extraction job: source -> tokenize (Ray tasks) -> engine actor pool -> shards -> manifest.

Resumable and exactly-once: units already committed (``_units/*.json``) are skipped,
a unit's shard only becomes visible through an atomic publish, and the manifest is
written last, after the counts reconcile.
"""

from __future__ import annotations

import json
import logging
import platform
import time

import pyarrow as pa
import torch
from tqdm import tqdm

import pipeline
from pipeline import fingerprint
from pipeline.cluster import init_ray, require_resources, stall_guard
from pipeline.conventions import boundary_label, describe_point
from pipeline.data.source import scan_source
from pipeline.engines import engine_ref, open_engine
from pipeline.errors import UnusableInput
from pipeline.extract import layout
from pipeline.extract.worker import TokenizedUnit, UnitWriter, tokenize_unit
from pipeline.identity import target_identity
from pipeline.registry.lease import Lease, LeaseHeld
from pipeline.registry.store import open_store
from pipeline.stopwatch import Stopwatch
from pipeline.store.fs import atomic_write_bytes, exists, join, list_files, read_bytes, resolve
from pipeline.store.reader import DatasetReader, load_manifest
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
    import pyarrow
    import transformers

    out = {
        "strata": pipeline.__version__, "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "pyarrow": pyarrow.__version__,
    }
    try:
        import ray

        out["ray"] = ray.__version__
    except ImportError:
        pass
    return out


def build_schema(cfg: ExtractConfig, identity: TargetIdentity) -> tuple[pa.Schema, list[TensorProvenance]]:
    n = identity.num_layers
    provs = [
        TensorProvenance(
            capture_point=p, boundary=boundary_label(p, n), dtype=cfg.engine.dtype, hidden_size=identity.hidden_size,
            encoding=ENCODING, engine=engine_ref(cfg, p, n), target_model=identity.model_name, target_key=identity.key,
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
        for b in cfg.capture[i + 1:]:
            if a.same_tensor(b, n):
                raise ExtractionError(f"capture points {a} and {b} name the same tensor ({boundary_label(a, n)}) on "
                                      f"this {n}-layer target: keep one")
    if cfg.engine.name != "hf":
        for p in cfg.capture:
            if engine_ref(cfg, p, n).native_id is None:
                raise ExtractionError(f"engine {cfg.engine.name} cannot capture {p}, {describe_point(p, n)}, on this "
                                      f"target: drop it or use engine hf")
    if identity.chat_template_sha256 is None:
        raise ExtractionError(f"target {cfg.target.path} has no chat template (chat_template.jinja or "
                              "tokenizer_config.json chat_template): conversations cannot be rendered")


def _committed(fs, root: str) -> dict[int, ShardRecord]:
    """The committed units. Only ``unit-NNNNN.json`` is a commit record: a writer killed while
    publishing leaves a ``.unit-NNNNN.json.tmp-*`` sibling, which is removed here."""
    out = {}
    for path in list_files(fs, join(root, layout.UNITS_DIR)):
        name = path.rsplit("/", 1)[-1]
        if name.startswith("."):
            log.info("removing %s: a commit record that was never published", path)
            fs.delete_file(path)
            continue
        try:
            rec = ShardRecord.model_validate_json(read_bytes(fs, path))
        except ValueError as e:
            raise ExtractionError(f"{path}: unreadable commit record ({str(e).splitlines()[0]}); it was not written by "
                                  "Strata's atomic commit: delete it to re-extract that unit") from None
        out[rec.unit] = rec
    return out


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
    atomic_write_bytes(fs, path, json.dumps({"fingerprint": fingerprint, "extraction": json.loads(extraction_json(cfg))}).encode())


def run_extract(cfg: ExtractConfig, progress: bool = True, use_ray: bool = True) -> DatasetManifest:
    """Extract ``cfg.source`` into ``cfg.output``; resumes a crashed run of the same job.

    ``use_ray=False`` runs the same steps in this process (tests, and benchmarks on a GPU
    box without Ray).
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
    fingerprint = layout.job_fingerprint(json.loads(extraction_json(cfg)), identity.key, scan.sha256)
    if exists(fs, join(root, MANIFEST_NAME)):
        m = load_manifest(cfg.output.uri, cfg.s3)
        if m.dataset_id.endswith(fingerprint):
            log.info("dataset %s is already complete: nothing to do", m.dataset_id)
            return m
        raise ExtractionError(f"output.uri {cfg.output.uri} already holds dataset {m.dataset_id}; choose another output.uri")
    if use_ray:  # before anything is written (a finished dataset needs no cluster)
        clock.start("ray_start")
        init_ray(cfg.ray.address, dashboard=False)
        r = cfg.ray
        actor = {"CPU": r.cpus_per_actor, **({"GPU": r.gpus_per_actor} if r.gpus_per_actor else {})}
        require_resources(f"ray: {r.num_actors} capture actors x cpus_per_actor {r.cpus_per_actor:g} + "
                          f"cpus_per_tokenize_task {r.cpus_per_tokenize_task:g}",
                          [actor] * r.num_actors + [{"CPU": r.cpus_per_tokenize_task}],
                          "lower ray.cpus_per_actor or ray.num_actors", r.resource_wait_s)
        clock.stop("ray_start")
    # One job per output at a time: a second one started on it refuses instead of racing.
    lease = Lease(open_store(cfg.output.uri, cfg.s3), "extract", ttl_s=LEASE_TTL_S)
    try:
        lease.acquire()
    except LeaseHeld as e:
        raise ExtractionError(f"output.uri {cfg.output.uri} is being extracted by {e.holder.describe()}: wait for "
                              "it (once it finishes, this job is a no-op) or use another output.uri") from None
    try:
        if exists(fs, join(root, MANIFEST_NAME)):  # finished while this job waited for the lease
            return load_manifest(cfg.output.uri, cfg.s3)
        _check_job_file(fs, root, fingerprint, cfg)
        return _extract(cfg, identity, fs, root, scan, fingerprint, progress, use_ray, clock)
    finally:
        lease.release()


def _extract(cfg: ExtractConfig, identity: TargetIdentity, fs, root: str, scan, fingerprint: str, progress: bool,
             use_ray: bool, clock: Stopwatch) -> DatasetManifest:
    """Extract every uncommitted unit, then publish the manifest (the lease is held)."""
    schema, provs = build_schema(cfg, identity)
    units = layout.plan_units(len(scan.rows), cfg.output.rows_per_shard)
    done = _committed(fs, root)
    pending = [u for u in units if u.unit not in done]
    log.info(
        "source %s: %d rows in %d units; %d already committed, %d to extract",
        cfg.source.uri, len(scan.rows), len(units), len(done), len(pending),
    )
    if pending:
        payload = [{"unit": u.unit, "start": u.start, "rows": [r.data for r in scan.rows[u.start : u.end]]} for u in pending]
        run = _run_pipeline if use_ray else _run_in_process
        with clock("capture"):
            for rec in run(cfg, schema, payload, progress):
                done[rec.unit] = rec
    done = _committed(fs, root)
    missing = [u.unit for u in units if u.unit not in done]
    if missing:
        raise RuntimeError(f"units {missing[:10]} were not committed; re-run the job to resume")

    clock.start("manifest")
    shards = [done[u.unit] for u in units]
    quarantine = b"".join(read_bytes(fs, join(root, s.quarantine_path)) for s in shards if s.quarantine_path)
    atomic_write_bytes(fs, join(root, layout.QUARANTINE_FILE), quarantine)
    manifest = DatasetManifest(
        dataset_id=f"{identity.model_name}-{fingerprint}",
        target=identity,
        capture_points=cfg.capture,
        columns=provs,
        extraction=json.loads(extraction_json(cfg)),
        software=software_versions(),
        source=SourceInfo(uri=cfg.source.uri, sha256=scan.sha256, rows=len(scan.rows), format=scan.format),
        shards=shards,
        totals=Totals(
            input_rows=len(scan.rows), rows=sum(s.rows for s in shards), quarantined=sum(s.quarantined for s in shards),
            tokens=sum(s.tokens for s in shards), loss_tokens=sum(s.loss_tokens for s in shards),
            bytes=sum(s.bytes for s in shards), shards=sum(1 for s in shards if s.path),
        ),
        quarantine_path=layout.QUARANTINE_FILE,
    )
    manifest.reconcile()
    clock.stop("manifest")
    if cfg.fingerprint.probe_samples:
        with clock("fingerprints"):
            manifest.fingerprints = fingerprint_dataset(cfg, manifest)
    manifest.seconds = clock.totals()
    atomic_write_bytes(fs, join(root, MANIFEST_NAME), manifest.model_dump_json(indent=1).encode())
    _cleanup_tmp(fs, root)
    t = manifest.totals
    dt = manifest.seconds["total"]
    log.info(
        "extracted %s: input rows %d = written %d + quarantined %d; %d shards, %d tokens, %.1f MB, %.0f tok/s (%.1fs)",
        manifest.dataset_id, t.input_rows, t.rows, t.quarantined, t.shards, t.tokens, t.bytes / 1e6, t.tokens / dt, dt,
    )
    log.info("where the time went: %s", manifest.time_breakdown())
    return manifest


def fingerprint_dataset(cfg: ExtractConfig, manifest: DatasetManifest) -> dict:
    """Fingerprint probe samples from the committed shards (the values training will read)."""
    t0 = time.perf_counter()
    reader = DatasetReader(cfg.output.uri, cfg.s3, verify_checksums=False, manifest=manifest)
    fp = fingerprint.compute(reader, cfg.fingerprint.probe_samples, cfg.fingerprint.dim, cfg.fingerprint.seed)
    path, digest = fp.save(cfg.output.uri, cfg.s3)
    dt = time.perf_counter() - t0
    log.info("fingerprinted %d probe samples x %d capture points in %.2fs", len(fp.sample_ids), len(fp.points), dt)
    return {"path": path, "sha256": digest, "probe_samples": len(fp.sample_ids), "dim": fp.dim, "seed": fp.seed,
            "seconds": dt}


def _cleanup_tmp(fs, root: str) -> None:
    import pyarrow.fs as pafs

    if isinstance(fs, pafs.LocalFileSystem) and exists(fs, join(root, "_tmp")):
        fs.delete_dir(join(root, "_tmp"))


def _run_pipeline(cfg: ExtractConfig, schema: pa.Schema, payload: list[dict], progress: bool):
    import ray  # run_extract started or joined it

    cfg_json = cfg.model_dump_json()

    def tokenize(item: dict) -> dict:
        c = ExtractConfig.model_validate_json(cfg_json)
        tu = tokenize_unit(c, int(item["unit"]), int(item["start"]), list(item["rows"]))
        return {"unit": tu.unit, "tokenized": tu.to_json()}

    ds = ray.data.from_items(payload, override_num_blocks=len(payload))
    ds = ds.map(tokenize, num_cpus=cfg.ray.cpus_per_tokenize_task)
    ds = ds.map_batches(
        CaptureActor,
        fn_constructor_kwargs={"cfg_json": cfg_json, "schema": schema},
        batch_size=1,
        compute=ray.data.ActorPoolStrategy(size=cfg.ray.num_actors),
        num_cpus=cfg.ray.cpus_per_actor,
        num_gpus=cfg.ray.gpus_per_actor or None,
    )
    bar = tqdm(total=len(payload), desc="extract", unit="shard", disable=not progress)
    tokens = 0
    rows = stall_guard(ds.iter_rows(), cfg.ray.stall_timeout_s, f"extraction of {len(payload)} units",
                       "re-run to resume (committed units are kept), after freeing or adding resources or raising "
                       "ray.stall_timeout_s")
    for row in rows:
        rec = ShardRecord.model_validate_json(row["record"])
        tokens += rec.tokens
        bar.update(1)
        bar.set_postfix(tokens=tokens, quarantined=rec.quarantined)
        yield rec
    bar.close()


def _run_in_process(cfg: ExtractConfig, schema: pa.Schema, payload: list[dict], progress: bool):
    actor = CaptureActor(cfg.model_dump_json(), schema, in_ray=False)
    try:
        for item in tqdm(payload, desc="extract", unit="shard", disable=not progress):
            tu = tokenize_unit(cfg, item["unit"], item["start"], item["rows"])
            yield actor.writer.process(tu)
    finally:
        actor.close()


class CaptureActor:
    """Ray Data actor: loads the engine once, then commits one unit per call."""

    def __init__(self, cfg_json: str, schema: pa.Schema, in_ray: bool = True):
        cfg = ExtractConfig.model_validate_json(cfg_json)
        if in_ray and not cfg.ray.gpus_per_actor:
            # Ray sets one OMP thread for a fractional or 1-CPU actor; compute with what it holds.
            torch.set_num_threads(max(1, round(cfg.ray.cpus_per_actor)))
        t0 = time.perf_counter()
        engine = open_engine(cfg)
        self.engine = engine
        self.writer = UnitWriter(cfg, schema, engine, compress_threads=cfg.ray.writer_threads_per_actor(),
                                 engine_start_s=time.perf_counter() - t0)

    def close(self) -> None:
        """Release the engine (vLLM/SGLang run their own processes)."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    def __call__(self, batch: dict) -> dict:
        records = []
        for data in batch["tokenized"]:
            rec = self.writer.process(TokenizedUnit.from_json(bytes(data)))
            records.append(rec.model_dump_json())
        return {"record": records}
