"""Dataset versions per target identity: what is new, and a version that references the
earlier shards instead of copying them.

Layout under ``data_root``::

    <model>-<identity key[:12]>/          one lineage per target identity: never mixed
        v0001/part/...                    a normal dataset: the rows new in this version
        v0001/new-rows.jsonl              those rows, as extracted (the part's source)
        v0001/seen.json                   digests of every source row handled so far
        v0001/version.json                DatasetVersion (written before the manifest)
        v0001/manifest.json               the version: inherited shards (../v0000/...) + the part's
        v0001/fingerprints.safetensors    probe fingerprints over the whole version

A version made another way than the latest (engine release, dtype, capture points, max length:
``recipe``) is a base version: it inherits nothing and re-extracts every row, so no version
mixes rows captured differently. A row is identified by the SHA-256 of its bytes; quarantined
rows count as handled, so a bad row is reported once, not re-extracted on every run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import posixpath
import re
from datetime import UTC, datetime

from pipeline.cluster import init_ray
from pipeline.data.conversations import row_digest
from pipeline.data.source import scan_source
from pipeline.extract.job import build_schema, extraction_json, run_extract
from pipeline.extract.worker import fingerprint_dataset
from pipeline.store.fs import atomic_write_bytes, exists, join, read_bytes, resolve
from pipeline.store.reader import DatasetReader, load_manifest
from schemas.identity import TargetIdentity
from schemas.manifest import MANIFEST_NAME, DatasetManifest, Totals
from schemas.provenance import TensorProvenance
from schemas.retrain import DatasetVersion, RetrainConfig

log = logging.getLogger(__name__)
VERSION_FILE, SEEN_FILE, NEW_ROWS_FILE = "version.json", "seen.json", "new-rows.jsonl"
_V = re.compile(r"v(\d{4,})$")


def lineage_uri(data_root: str, identity: TargetIdentity) -> str:
    return posixpath.join(data_root.rstrip("/"), f"{identity.model_name}-{identity.key[:12]}")


def version_uri(lineage: str, v: int) -> str:
    return posixpath.join(lineage, f"v{v:04d}")


def latest_version(lineage: str, s3=None) -> tuple[DatasetVersion, str] | None:
    """The newest complete version (its manifest exists) of a lineage."""
    import pyarrow.fs as pafs

    fs, root = resolve(lineage, s3)
    found = []
    for info in fs.get_file_info(pafs.FileSelector(root, allow_not_found=True, recursive=False)):
        m = _V.match(posixpath.basename(info.path))
        if m and info.type == pafs.FileType.Directory and exists(fs, join(info.path, MANIFEST_NAME)):
            found.append(int(m.group(1)))
    if not found:
        return None
    uri = version_uri(lineage, max(found))
    fs, vroot = resolve(uri, s3)
    return DatasetVersion.model_validate_json(read_bytes(fs, join(vroot, VERSION_FILE))), uri


def recipe(extraction: dict, columns: list[TensorProvenance]) -> dict:
    """What decides a version's values besides the target: extraction settings (not paths)
    and each column's provenance (engine and release, dtype, encoding)."""
    settings = {k: v for k, v in extraction.items() if k not in ("target", "source", "output", "fingerprint")}
    return {
        "extraction": settings,
        "columns": {str(c.capture_point): c.model_dump(mode="json", exclude={"capture_point"}) for c in columns},
    }


def manifest_recipe(m: DatasetManifest) -> dict:
    return recipe(m.extraction, m.columns)


def config_recipe(cfg: RetrainConfig, identity: TargetIdentity) -> dict:
    ecfg = cfg.extract_config(cfg.source.uri, cfg.data_root)
    return recipe(json.loads(extraction_json(ecfg)), build_schema(ecfg, identity)[1])


def recipe_changes(old: dict, new: dict) -> list[str]:
    """``extraction.engine.dtype: float32 -> bfloat16``-style lines, one per setting that differs."""
    a, b = _flat(old), _flat(new)
    return [
        f"{k}: {a.get(k, '(none)')} -> {b.get(k, '(none)')}"
        for k in sorted(a.keys() | b.keys())
        if a.get(k) != b.get(k)
    ]


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        out.update(_flat(v, key) if isinstance(v, dict) else {key: v})
    return out


def seen_digests(uri: str, s3=None) -> set[str]:
    fs, root = resolve(uri, s3)
    return set(json.loads(read_bytes(fs, join(root, SEEN_FILE))))


def new_rows(cfg: RetrainConfig, seen: set[str]) -> tuple[int, list[bytes], set[str]]:
    """(source rows, rows not seen before in source order (first copy of duplicates), all digests)."""
    scan = scan_source(cfg.source.uri, cfg.source.format, cfg.s3)
    fresh, digests = [], set()
    for row in scan.rows:
        d = row_digest(row.data)
        # seen.json files written before rows were identified by their data hold byte digests
        if d not in seen and d not in digests and hashlib.sha256(row.data).hexdigest() not in seen:
            fresh.append(row.data)
        digests.add(d)
    return len(scan.rows), fresh, digests


def build_version(
    cfg: RetrainConfig,
    identity: TargetIdentity,
    lineage: str,
    v: int,
    previous: tuple[DatasetVersion, str] | None,
    rows: list[bytes],
    source_rows: int,
    digests: set[str],
    progress: bool,
) -> tuple[DatasetVersion, str]:
    """Extract ``rows`` into version ``v`` that inherits every shard of ``previous`` (None: a base version)."""
    uri = version_uri(lineage, v)
    fs, root = resolve(uri, cfg.s3)
    if exists(fs, join(root, MANIFEST_NAME)):
        raise RuntimeError(f"{uri} already holds a dataset version; another run made it (lease violated?)")
    atomic_write_bytes(fs, join(root, NEW_ROWS_FILE), b"".join(r.rstrip(b"\n") + b"\n" for r in rows))
    log.info("version v%04d: extracting %d new rows of %d in the source", v, len(rows), source_rows)
    part_cfg = cfg.extract_config(posixpath.join(uri, NEW_ROWS_FILE), posixpath.join(uri, "part"))
    part_cfg = part_cfg.model_copy(update={"fingerprint": part_cfg.fingerprint.model_copy(update={"probe_samples": 0})})
    if cfg.use_ray:  # one Ray for the pass, with the dashboard the training that follows needs
        init_ray(part_cfg.ray.address)
    part = run_extract(part_cfg, progress=progress, use_ray=cfg.use_ray)
    manifest = compose(
        part, previous[1] if previous else None, f"{part.target.model_name}-{identity.key[:12]}-v{v:04d}", cfg.s3
    )
    whole = cfg.extract_config(uri, uri)  # the version root, for fingerprints over all its samples
    if whole.fingerprint.probe_samples:
        manifest.fingerprints = fingerprint_dataset(whole, manifest)
    seen = (seen_digests(previous[1], cfg.s3) if previous else set()) | digests
    version = DatasetVersion(
        version=v,
        dataset_id=manifest.dataset_id,
        target_key=identity.key,
        parent=previous[0].dataset_id if previous else None,
        source_uri=cfg.source.uri,
        source_rows=source_rows,
        new_rows=len(rows),
        seen_rows=len(seen),
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    atomic_write_bytes(fs, join(root, SEEN_FILE), json.dumps(sorted(seen)).encode())
    atomic_write_bytes(fs, join(root, VERSION_FILE), version.model_dump_json(indent=1).encode())
    atomic_write_bytes(fs, join(root, MANIFEST_NAME), manifest.model_dump_json(indent=1).encode())  # commit point
    DatasetReader(uri, cfg.s3).verify_all()
    log.info(
        "version %s: %d rows (%d inherited), %d shards",
        manifest.dataset_id,
        manifest.totals.rows,
        manifest.totals.rows - part.totals.rows,
        manifest.totals.shards,
    )
    return version, uri


def compose(part: DatasetManifest, parent_uri: str | None, dataset_id: str, s3=None) -> DatasetManifest:
    """The version manifest: the parent's shards (paths into the parent's directory) + the part's."""
    own = [
        s.model_copy(
            update={
                "path": posixpath.join("part", s.path) if s.path else None,
                "quarantine_path": posixpath.join("part", s.quarantine_path) if s.quarantine_path else None,
            }
        )
        for s in part.shards
    ]
    inherited, parents = [], []
    if parent_uri is not None:
        parent = load_manifest(parent_uri, s3)
        if parent.target.key != part.target.key or [str(p) for p in parent.capture_points] != [
            str(p) for p in part.capture_points
        ]:
            raise RuntimeError(f"{parent_uri} holds another target or other capture points; versions never mix them")
        name = posixpath.basename(parent_uri.rstrip("/"))

        def rel(p: str | None) -> str | None:
            return posixpath.normpath(posixpath.join("..", name, p)) if p else None

        inherited = [
            s.model_copy(
                update={
                    "path": rel(s.path),
                    "quarantine_path": rel(s.quarantine_path),
                    "inherited_from": s.inherited_from or parent.dataset_id,
                }
            )
            for s in parent.shards
        ]
        parents = [*parent.parents, parent.dataset_id]
    shards = inherited + own
    m = part.model_copy(
        update={
            "dataset_id": dataset_id,
            "shards": shards,
            "parents": parents,
            "fingerprints": None,
            "quarantine_path": posixpath.join("part", part.quarantine_path) if part.quarantine_path else None,
            "totals": Totals(
                input_rows=sum(s.rows + s.quarantined for s in shards),
                rows=sum(s.rows for s in shards),
                quarantined=sum(s.quarantined for s in shards),
                tokens=sum(s.tokens for s in shards),
                loss_tokens=sum(s.loss_tokens for s in shards),
                bytes=sum(s.bytes for s in shards),
                shards=sum(1 for s in shards if s.path),
            ),
        }
    )
    m.reconcile()
    return m
