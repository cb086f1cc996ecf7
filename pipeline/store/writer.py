"""Parquet shard writer: provenance in the schema, byte-plane tensors, atomic commit.

A shard is written to a temporary file (hashed while it is written, so the checksum
costs no second read), then published under its final name in one step. A crash
before ``commit`` leaves nothing visible.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.store.encoding import compress_plane
from pipeline.store.fs import full_disk_errors, publish_local_file, temporary_path
from schemas.dataset import BOOKKEEPING_FIELDS, META_CODEC, plane_column, provenances_from_schema
from schemas.provenance import DTYPE_BYTES


@dataclass
class SampleMeta:
    sample_id: str
    source_uri: str
    source_row: int
    content_sha256: str
    input_ids: list[int]
    loss_mask: list[int]


class _HashingFile:
    """File-like sink that hashes bytes on their way to disk."""

    def __init__(self, path: str):
        self._f = open(path, "wb")
        self.sha = hashlib.sha256()
        self.size = 0
        self.hash_s = self.write_s = 0.0
        self.closed = False

    def write(self, data) -> int:
        mv = memoryview(data)
        t0 = time.perf_counter()
        self.sha.update(mv)
        t1 = time.perf_counter()
        self._f.write(mv)
        self.hash_s, self.write_s = self.hash_s + (t1 - t0), self.write_s + (time.perf_counter() - t1)
        self.size += mv.nbytes
        return mv.nbytes

    def flush(self) -> None:
        self._f.flush()

    def tell(self) -> int:
        return self.size

    def close(self) -> None:
        if not self.closed:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            self.closed = True

    def discard(self) -> None:
        """Close without flushing to disk (the file is about to be removed; the disk may be full)."""
        if not self.closed:
            try:
                self._f.close()
            except OSError:
                pass
            self.closed = True


def parquet_options(schema: pa.Schema) -> dict:
    """How a shard's columns are written: bookkeeping zstd with statistics, byte planes as they are."""
    return {
        "compression": {f.name: ("zstd" if f in BOOKKEEPING_FIELDS else "none") for f in schema},
        "use_dictionary": False,
        "write_statistics": [f.name for f in BOOKKEEPING_FIELDS if not pa.types.is_list(f.type)],
        # Cells are whole [T, H] planes (MBs each): with the default 1 MB page target Parquet
        # re-buffers every value; large pages make the write ~5x cheaper.
        "data_page_size": 64 << 20,
    }


class ShardWriter:
    def __init__(
        self,
        fs: pafs.FileSystem,
        path: str,
        schema: pa.Schema,
        tmp_dir: str | None = None,
        compress_threads: int = 1,
    ):
        self.fs, self.path, self.schema = fs, path, schema
        if tmp_dir is None:
            tmp_dir = os.path.dirname(path) if isinstance(fs, pafs.LocalFileSystem) else tempfile.gettempdir()
        os.makedirs(tmp_dir, exist_ok=True)
        self._tmp = temporary_path(path, tmp_dir)
        self._sink = _HashingFile(self._tmp)
        try:
            with full_disk_errors(path):
                self._writer = pq.ParquetWriter(pa.PythonFile(self._sink, mode="w"), schema, **parquet_options(schema))
        except BaseException:  # nothing was written that anyone can use: no temporary file stays
            self._sink.discard()
            os.remove(self._tmp)
            raise
        self._provs = provenances_from_schema(schema)
        self._pool = ThreadPoolExecutor(compress_threads) if compress_threads > 1 else None
        self.rows = 0
        self.tokens = 0
        self._compress_s = self._table_s = self._commit_s = 0.0

    def seconds(self) -> dict[str, float]:
        """Where this shard's writing went: compressing planes, Parquet encoding, SHA-256,
        writes to the file, and the commit (close, fsync, publish)."""
        sink = self._sink.hash_s + self._sink.write_s
        return {
            "compress": self._compress_s,
            "parquet": max(0.0, self._table_s - sink),
            "hash": self._sink.hash_s,
            "write": self._sink.write_s,
            "commit": self._commit_s,
        }

    def write(self, metas: list[SampleMeta], lengths: list[int], planes: dict[str, np.ndarray]) -> None:
        """Append one row group per sample: ``metas[i]`` describes the i-th of the samples packed end
        to end in ``planes`` (capture point -> [B, sum(lengths), H] uint8 byte planes), ``lengths[i]``
        tokens long."""
        if len(metas) != len(lengths):
            raise ValueError(f"{len(metas)} sample records for a batch of {len(lengths)} samples")
        for m, n in zip(metas, lengths, strict=True):
            if len(m.input_ids) != n:
                raise ValueError(f"sample {m.sample_id}: {len(m.input_ids)} input ids but {n} captured tokens")
        cols: dict[str, pa.Array] = {
            "sample_id": pa.array([m.sample_id for m in metas], pa.string()),
            "source_uri": pa.array([m.source_uri for m in metas], pa.string()),
            "source_row": pa.array([m.source_row for m in metas], pa.int64()),
            "content_sha256": pa.array([m.content_sha256 for m in metas], pa.string()),
            "input_ids": pa.array([m.input_ids for m in metas], pa.list_(pa.int32())),
            "loss_mask": pa.array([m.loss_mask for m in metas], pa.list_(pa.uint8())),
            "num_tokens": pa.array(lengths, pa.int32()),
        }
        token_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        for prov in self._provs:
            point = str(prov.capture_point)
            point_planes = planes.get(point)
            if point_planes is None:
                raise ValueError(f"batch has no tensor for capture point {point}")
            b, h = DTYPE_BYTES[prov.dtype], prov.hidden_size
            if point_planes.shape != (b, int(token_offsets[-1]), h) or point_planes.dtype != np.uint8:
                raise ValueError(
                    f"{point}: expected byte planes of shape {(b, int(token_offsets[-1]), h)} uint8, "
                    f"got {point_planes.shape} {point_planes.dtype}"
                )
            for k in range(b):
                name = plane_column(point, k)
                field = self.schema.field(name)
                cols[name] = self._plane_array(point_planes[k], token_offsets, h, field.metadata[META_CODEC])
        table = pa.Table.from_arrays([cols[f.name] for f in self.schema], schema=self.schema)
        t0, sink0 = time.perf_counter(), self._sink.hash_s + self._sink.write_s
        with full_disk_errors(self.path):
            # A row group per sample: training reads a few samples from each of many shards per
            # batch, and Parquet reads whole column chunks -- a row group per forward batch would
            # make every batch read the whole forward batch of each sample it needs.
            self._writer.write_table(table, row_group_size=1)
        self._table_s += time.perf_counter() - t0 - (self._sink.hash_s + self._sink.write_s - sink0)
        self.rows += len(metas)
        self.tokens += int(token_offsets[-1])

    def _plane_array(self, plane: np.ndarray, token_offsets: np.ndarray, h: int, codec: bytes) -> pa.Array:
        n = len(token_offsets) - 1
        if codec == b"raw":
            # Zero-copy: the packed plane already is the concatenation of the cells.
            data = pa.py_buffer(np.ascontiguousarray(plane))
            offsets = pa.py_buffer(token_offsets * h)
        else:
            t0 = time.perf_counter()
            cells = [plane[token_offsets[i] : token_offsets[i + 1]] for i in range(n)]
            blobs = list(self._pool.map(compress_plane, cells)) if self._pool else [compress_plane(c) for c in cells]
            self._compress_s += time.perf_counter() - t0
            offsets = pa.py_buffer(np.concatenate([[0], np.cumsum([len(x) for x in blobs])]).astype(np.int64))
            data = pa.py_buffer(b"".join(blobs))
        return pa.LargeBinaryArray.from_buffers(pa.large_binary(), n, [None, offsets, data])

    def commit(self) -> tuple[int, str]:
        """Close, fsync and publish; returns (bytes, sha256) of the published shard. A failure
        (a full disk at the fsync, say) leaves no temporary file behind."""
        t0 = time.perf_counter()
        try:
            with full_disk_errors(self.path):
                self._writer.close()
                self._sink.close()
        except BaseException:
            self.abort()
            raise
        if self._pool:
            self._pool.shutdown()
        publish_local_file(self._tmp, self.fs, self.path)
        self._commit_s += time.perf_counter() - t0
        return self._sink.size, self._sink.sha.hexdigest()

    def abort(self) -> None:
        try:
            self._writer.close()
        except Exception:  # best effort cleanup of an unpublished temp file
            pass
        self._sink.discard()
        if self._pool:
            self._pool.shutdown()
        if os.path.exists(self._tmp):
            os.remove(self._tmp)
