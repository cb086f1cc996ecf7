"""The stream's cache (``data.cache``): the first epoch's captured batches kept as Parquet shards,
so later epochs -- and a rerun of the same stream -- read them instead of capturing again.

One shard per first-epoch step and training worker, written by the capture actor that captured
the batch (atomically, before it hands the batch over), one row group per sample so a later
epoch's batch reads only its own samples. The shards carry the dataset's columns and per-tensor
provenance, so the stream's held-out manifest (the same columns) decodes them and checks each
file's provenance. A batch is read from the cache only when every one of its samples' shards is
there, else it is captured again: the values are the same either way (capture is deterministic
and rounded to the stored dtype), so a missing shard costs time, never correctness.
``stream_cache.json`` names the stream the shards belong to -- its extraction, columns and
first-epoch plan -- and a cache of another stream is refused, never mixed in. A cache serves one
run at a time: the run that claims it removes what a killed writer left unpublished.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass

import numpy as np

from pipeline.store.fs import atomic_write_bytes, exists, join, read_bytes, remove_unpublished, resolve
from pipeline.store.reader import DatasetReader, SampleRef
from pipeline.store.writer import SampleMeta, ShardWriter
from pipeline.train.data import load_batch
from schemas.config import ConfigError, S3Config
from schemas.manifest import DatasetManifest

log = logging.getLogger(__name__)

CACHE_FILE = "stream_cache.json"
EPOCH0 = "epoch-0"  # the first epoch's shards, the only ones kept


def shard_path(step: int, rank: int) -> str:
    """The first-epoch batch of ``step`` on worker ``rank``, relative to the cache's root."""
    return f"{EPOCH0}/step-{step:07d}-rank-{rank:03d}.parquet"


@dataclass(frozen=True)
class CacheSpec:
    """What the capture actors and the training workers need to write and read the cache."""

    uri: str
    s3: dict
    manifest: str  # the stream's held-out DatasetManifest, JSON: the columns that decode the shards
    steps: int  # first-epoch steps: the ones whose batches are written


def stream_key(manifest: DatasetManifest, epoch0: list[list[list[str]]]) -> str:
    """The stream a cache belongs to: its extraction, its columns' provenance (target, capture
    points, dtypes) and which samples each first-epoch (step, worker) batch holds."""
    body = {
        "extraction": {k: v for k, v in manifest.extraction.items() if k != "output"},  # not where it is written
        "columns": [c.model_dump(mode="json") for c in manifest.columns],
        "epoch0": epoch0,
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def claim(uri: str, s3: S3Config, manifest: DatasetManifest, epoch0: list[list[list[str]]]) -> CacheSpec:
    """The driver's check before training: a new cache is marked as this stream's; one that holds
    another stream's batches (another source, capture points, seed, batch_tokens or worker count)
    is refused."""
    fs, root = resolve(uri, s3)
    key, path = stream_key(manifest, epoch0), join(root, CACHE_FILE)
    record = {
        "key": key,
        "source": manifest.extraction.get("source", {}).get("uri"),
        "capture": manifest.extraction.get("capture"),
        "dataset_id": manifest.dataset_id,
        "steps": len(epoch0),
        "workers": len(epoch0[0]) if epoch0 else 0,
    }
    if exists(fs, path):
        have = json.loads(read_bytes(fs, path))
        if have.get("key") != key:
            raise ConfigError(
                f"data.cache {uri} holds the batches of another stream ({_describe(have)}); this run streams "
                f"{_describe(record)}, or the same with another plan (seed, batch_tokens, packing): delete the "
                "cache or name another data.cache"
            )
        log.info("stream cache %s: reusing the shards of this stream already there", uri)
        remove_unpublished(fs, join(root, EPOCH0), "a cache shard")  # a capture actor killed mid-write
    else:
        atomic_write_bytes(fs, path, json.dumps(record, indent=1).encode())
        log.info("stream cache %s: the first epoch's %d steps will be kept", uri, len(epoch0))
    return CacheSpec(uri, s3.model_dump(mode="json"), manifest.model_dump_json(), len(epoch0))


def _describe(r: dict) -> str:
    return f"{r.get('source')} captured at {r.get('capture')}, {r.get('steps')} first-epoch steps on {r.get('workers')} workers"


def write_shard(uri: str, s3: dict, path: str, schema, samples: list[tuple[SampleMeta, dict[str, np.ndarray]]]) -> None:
    """A capture actor keeps one captured batch: ``samples`` in batch order, each with its byte
    planes (capture point -> [bytes, tokens, H] uint8), one row group each."""
    fs, root = resolve(uri, S3Config.model_validate(s3))
    writer = ShardWriter(fs, join(root, path), schema)
    try:
        for meta, planes in samples:
            writer.write([meta], [len(meta.input_ids)], planes)
        writer.commit()
    except BaseException:
        writer.abort()
        raise


class CacheReader:
    """A training worker's reads: which first-epoch shard holds each training sample, and the
    batch decoded from those shards when they are all there."""

    def __init__(self, spec: CacheSpec, epoch0: list[list[list[int]]], points: list[str]):
        manifest = DatasetManifest.model_validate_json(spec.manifest)
        self.reader = DatasetReader(
            spec.uri, S3Config.model_validate(spec.s3), expect_points=points, verify_checksums=False, manifest=manifest
        )
        self.where = {
            i: (shard_path(s, r), pos)
            for s, ranks in enumerate(epoch0)
            for r, idx in enumerate(ranks)
            for pos, i in enumerate(idx)
        }
        self._present: set[str] = set()  # shards seen and provenance-checked (published ones never change)

    def has(self, idx: list[int]) -> bool:
        """Every sample's shard is there (a shard still being written is not: it appears at once, whole)."""
        for i in idx:
            if i not in self.where:  # in no first-epoch batch (with several workers an epoch drops a remainder)
                return False
            path = self.where[i][0]
            if path not in self._present:
                if not exists(self.reader.fs, join(self.reader.root, path)):
                    return False
                self.reader.check_file_provenance(path)
                self._present.add(path)
        return True

    def read(
        self, idx: list[int], lengths: list[int], sample_ids: list[str], aux: list[str], final: str, packed: bool
    ) -> dict:
        refs = [SampleRef(*self.where[i], 0, n, sid) for i, n, sid in zip(idx, lengths, sample_ids, strict=True)]
        return {**load_batch(self.reader, refs, aux, final, packed), "sample_ids": list(sample_ids)}
