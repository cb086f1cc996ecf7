"""Read a hidden-state dataset: verify checksums, refuse mismatched provenance.

Tensors are decoded to torch with one copy (the byte-plane join); raw planes are read
straight from the Arrow buffers.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pipeline.errors import UnusableInput
from pipeline.store.encoding import bits_to_torch, decompress_plane, join_planes
from pipeline.store.fs import exists, join, read_bytes, resolve
from schemas.capture import CapturePoint, parse_points
from schemas.dataset import META_CODEC, plane_column, provenances_from_schema
from schemas.identity import TargetIdentity
from schemas.manifest import MANIFEST_NAME, DatasetManifest, ShardRecord
from schemas.provenance import DTYPE_BYTES, TensorProvenance

FOOTER_CACHE_SHARDS = 256  # parsed footers a reader keeps (a few hundred KB each at most)


class ProvenanceMismatch(UnusableInput):
    """The data is not what the caller expects (other target, other capture points)."""


class ShardCorrupt(ValueError):
    """A shard is missing or its bytes do not match the manifest's checksum."""


@dataclass
class Sample:
    sample_id: str
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool
    tensors: dict[str, torch.Tensor]  # capture point -> [T, H]


def load_manifest(uri: str, s3: object | None = None) -> DatasetManifest:
    fs, root = resolve(uri, s3)
    path = join(root, MANIFEST_NAME)
    if not exists(fs, path):
        raise FileNotFoundError(
            f"{uri}: no {MANIFEST_NAME}; the extraction did not finish (re-run it to resume) "
            "or this is not a Strata dataset"
        )
    return DatasetManifest.model_validate_json(read_bytes(fs, path))


class DatasetReader:
    def __init__(
        self,
        uri: str,
        s3: object | None = None,
        expect_target: TargetIdentity | None = None,
        expect_points: list[CapturePoint | str] | None = None,
        verify_checksums: bool = True,
        manifest: DatasetManifest | None = None,
    ):
        self.uri = uri
        self.fs, self.root = resolve(uri, s3)
        self.manifest = manifest or load_manifest(uri, s3)
        self.manifest.reconcile()
        self.verify_checksums = verify_checksums
        m = self.manifest
        if expect_target is not None:
            diff = expect_target.differences(m.target)
            if diff:
                raise ProvenanceMismatch(
                    f"dataset {uri} was extracted from {m.target.describe()}, but the caller expects "
                    f"{expect_target.describe()}; differs in: {'; '.join(diff)}"
                )
        have = [str(p) for p in m.capture_points]
        if expect_points is not None:
            want = [str(p) for p in parse_points(list(expect_points))]
            missing = [p for p in want if p not in have]
            if missing:
                raise ProvenanceMismatch(
                    f"dataset {uri} holds capture points {have}, but the caller expects {want} ({missing} missing)"
                )
            self.points = want
        else:
            self.points = have
        self._prov = {str(p.capture_point): p for p in m.columns}
        # Parsed shard footers, oldest first (published shards never change; decode threads share them).
        self._footers: OrderedDict[str, pq.FileMetaData] = OrderedDict()
        self._footers_lock = threading.Lock()

    @property
    def shards(self) -> list[ShardRecord]:
        return [s for s in self.manifest.shards if s.path is not None]

    def provenance(self, point: CapturePoint | str) -> TensorProvenance:
        return self._prov[str(point)]

    def read_shard(self, shard: ShardRecord) -> pa.Table:
        """Read one shard, verifying its checksum and that its columns carry our provenance."""
        path = join(self.root, shard.path)  # type: ignore[arg-type]
        if not exists(self.fs, path):
            raise ShardCorrupt(f"shard {shard.path} of {self.uri} is listed in the manifest but missing")
        blob = read_bytes(self.fs, path)
        if self.verify_checksums:
            digest = hashlib.sha256(blob).hexdigest()
            if len(blob) != shard.bytes or digest != shard.sha256:
                raise ShardCorrupt(
                    f"shard {shard.path} of {self.uri} is corrupt: {len(blob)} bytes sha256 {digest[:12]}, "
                    f"manifest says {shard.bytes} bytes sha256 {str(shard.sha256)[:12]}"
                )
        columns = ["sample_id", "source_row", "input_ids", "loss_mask", "num_tokens"]
        for p in self.points:
            columns += [plane_column(p, k) for k in range(DTYPE_BYTES[self._prov[p].dtype])]
        pf = pq.ParquetFile(pa.BufferReader(blob))
        self._check_shard_provenance(shard.path, provenances_from_schema(pf.schema_arrow))
        return pf.read(columns=columns)

    def check_file_provenance(self, path: str) -> None:
        """A Parquet file under the dataset's root (not listed in its manifest: a stream's cached
        batches) carries exactly the manifest's columns and provenance."""
        with self.fs.open_input_file(join(self.root, path)) as f:
            self._check_shard_provenance(path, provenances_from_schema(pq.ParquetFile(f).schema_arrow))

    def _check_shard_provenance(self, path: str, provs: list[TensorProvenance]) -> None:
        """Every shard must carry exactly the manifest's columns: no mixed capture points."""
        for prov in provs:
            if prov.target_key != self.manifest.target.key:
                raise ProvenanceMismatch(
                    f"shard {path}: column {prov.capture_point} comes from target key {prov.target_key}, "
                    f"the manifest says {self.manifest.target.key}"
                )
        got = {str(p.capture_point): p for p in provs}
        want = {str(p.capture_point): p for p in self.manifest.columns}
        if got != want:
            raise ProvenanceMismatch(
                f"shard {path} holds capture points {sorted(got)} with their provenance, the manifest says "
                f"{sorted(want)}: the dataset mixes capture points (or provenance); re-extract it"
            )

    def verify_all(self) -> None:
        """Check every shard up front (raises ShardCorrupt naming it): exists, checksum, carries
        our provenance, holds exactly its unit's source rows, and no sample id twice in the
        dataset -- a manifest edited to list one file twice is self-consistent otherwise."""
        seen: dict[str, str] = {}
        for shard in self.shards:
            table = self.read_shard(shard)
            ids, rows = table.column("sample_id").to_pylist(), table.column("source_row").to_pylist()
            lo, hi = shard.source_rows
            if len(ids) != shard.rows or any(not lo <= r < hi for r in rows):
                raise ShardCorrupt(
                    f"shard {shard.path} of {self.uri} holds {len(ids)} rows from source rows "
                    f"{min(rows, default=None)}..{max(rows, default=None)}; its unit {shard.unit} covers "
                    f"{lo}..{hi - 1} with {shard.rows} rows: the manifest points at another unit's file"
                )
            for sid in ids:
                if sid in seen:
                    raise ShardCorrupt(
                        f"sample {sid} is in shard {shard.path} and in {seen[sid]} of {self.uri}: "
                        "the dataset lists a sample twice; re-extract it"
                    )
                seen[sid] = shard.path  # type: ignore[assignment]

    def read_row_group(self, shard_path: str, row_group: int, columns: list[str] | None = None) -> pa.Table:
        """One row group, without re-hashing the shard (call verify_all first). A shard's footer
        is parsed once (a row group per sample makes it the larger read for one sample)."""
        cols = columns or ["sample_id", "input_ids", "loss_mask", "num_tokens"] + [
            plane_column(p, k) for p in self.points for k in range(DTYPE_BYTES[self._prov[p].dtype])
        ]
        with self.fs.open_input_file(join(self.root, shard_path)) as f:
            with self._footers_lock:
                meta = self._footers.get(shard_path)
            pf = pq.ParquetFile(f, metadata=meta)
            if meta is None:
                with self._footers_lock:
                    self._footers[shard_path] = pf.metadata
                    while len(self._footers) > FOOTER_CACHE_SHARDS:
                        self._footers.popitem(last=False)
            return pf.read_row_group(row_group, columns=cols)

    def decode(self, table: pa.Table, i: int, point: str) -> torch.Tensor:
        """Tensor [T, H] of capture point ``point`` for row ``i`` of a shard table."""
        prov = self._prov[point]
        b, h = DTYPE_BYTES[prov.dtype], prov.hidden_size
        t = table.column("num_tokens")[i].as_py()
        planes = []
        for k in range(b):
            col = table.column(plane_column(point, k))
            cell = col[i].as_buffer()
            codec = table.schema.field(plane_column(point, k)).metadata[META_CODEC]
            data = decompress_plane(cell, t * h) if codec == b"zstd" else cell
            planes.append(np.frombuffer(data, np.uint8).reshape(t, h))
        return bits_to_torch(join_planes(planes), prov.dtype)

    def iter_samples(self) -> Iterator[Sample]:
        for shard in self.shards:
            table = self.read_shard(shard)
            ids, masks = table.column("input_ids"), table.column("loss_mask")
            for i in range(table.num_rows):
                yield Sample(
                    sample_id=table.column("sample_id")[i].as_py(),
                    input_ids=torch.from_numpy(ids[i].values.to_numpy().astype(np.int64)),
                    loss_mask=torch.from_numpy(masks[i].values.to_numpy().astype(bool)),
                    tensors={p: self.decode(table, i, p) for p in self.points},
                )


@dataclass(frozen=True)
class SampleRef:
    """Where one sample lives in a dataset (training plans and fingerprints address samples by it)."""

    shard: str
    row_group: int
    row: int
    tokens: int
    sample_id: str


def index_samples(reader: DatasetReader) -> list[SampleRef]:
    """Every sample of the dataset, in shard and row order, without reading tensors."""
    refs = []
    for shard in reader.shards:
        with reader.fs.open_input_file(join(reader.root, shard.path)) as f:
            pf = pq.ParquetFile(f)
            t = pf.read(columns=["sample_id", "num_tokens"])  # one read, whatever the row groups
            where = [(rg, i) for rg in range(pf.num_row_groups) for i in range(pf.metadata.row_group(rg).num_rows)]
            for (rg, i), sid, n in zip(where, t["sample_id"].to_pylist(), t["num_tokens"].to_pylist(), strict=True):
                refs.append(SampleRef(shard.path, rg, i, n, sid))
    return refs
