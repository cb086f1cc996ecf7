"""The steps of extraction, without Ray: tokenize a unit, capture and write it, fingerprint the result.

:class:`CaptureWorker` hosts the engine and runs them; ``pipeline/extract/pool.py`` places it in
Ray actors (or, with ``--no-ray``, in the CLI's process). Tests and benchmarks call them directly.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache

import pyarrow as pa
import torch

from pipeline import fingerprint
from pipeline.data.chat import ChatEncoder
from pipeline.data.conversations import BadRow, parse_row
from pipeline.engines import open_engine
from pipeline.engines.base import CapturedBatch
from pipeline.extract import layout
from pipeline.store.fs import atomic_write_bytes, exists, join, read_bytes, resolve
from pipeline.store.reader import DatasetReader
from pipeline.store.writer import SampleMeta, ShardWriter
from schemas.extract import ExtractConfig
from schemas.manifest import DatasetManifest, ShardRecord

log = logging.getLogger(__name__)


@dataclass
class TokenizedUnit:
    unit: int
    start: int
    end: int
    samples: list[SampleMeta] = field(default_factory=list)
    quarantine: list[dict] = field(default_factory=list)
    tokenize_s: float = 0.0

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "unit": self.unit,
                "start": self.start,
                "end": self.end,
                "samples": [s.__dict__ for s in self.samples],
                "quarantine": self.quarantine,
                "tokenize_s": self.tokenize_s,
            }
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> TokenizedUnit:
        d = json.loads(data)
        return cls(
            d["unit"], d["start"], d["end"], [SampleMeta(**s) for s in d["samples"]], d["quarantine"], d["tokenize_s"]
        )


@lru_cache(maxsize=4)
def _encoder(model_dir: str, max_length: int, policy: str) -> ChatEncoder:
    return ChatEncoder(model_dir, max_length, policy)


QUARANTINE_PREFIX = 4096  # bytes of a bad row kept for a person to read; the whole row is in the source


def quarantine_record(uri: str, row: int, reason: str, data: bytes) -> dict:
    """What the quarantine keeps of a bad row: where it is, why, its hash and a bounded prefix."""
    return {
        "source_uri": uri,
        "source_row": row,
        "reason": reason,
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "line": data[:QUARANTINE_PREFIX].decode("utf-8", errors="replace"),
        "truncated": len(data) > QUARANTINE_PREFIX,
    }


def tokenize_unit(cfg: ExtractConfig, unit: int, start: int, rows: list[bytes]) -> TokenizedUnit:
    """Parse, template and tokenize rows; every failure becomes a quarantine record."""
    t0 = time.perf_counter()
    enc = _encoder(cfg.target.path, cfg.max_length, cfg.length_policy)
    out = TokenizedUnit(unit, start, start + len(rows))
    for offset, data in enumerate(rows):
        row = start + offset
        try:
            conv = parse_row(data)
            e = enc.encode(conv.messages)
        except BadRow as err:
            out.quarantine.append(quarantine_record(cfg.source.uri, row, str(err), data))
            continue
        out.samples.append(
            SampleMeta(
                sample_id=layout.sample_id(cfg.source.uri, row, conv.content_sha256),
                source_uri=cfg.source.uri,
                source_row=row,
                content_sha256=conv.content_sha256,
                input_ids=e.input_ids,
                loss_mask=e.loss_mask,
            )
        )
    out.tokenize_s = time.perf_counter() - t0
    return out


class UnitWriter:
    """Hosts the engine; turns tokenized units into committed shards.

    Capture of batch i+1 overlaps encoding and writing of batch i (a writer thread;
    zstd and hashing release the GIL).
    """

    def __init__(self, cfg: ExtractConfig, schema, engine, compress_threads: int = 1, engine_start_s: float = 0.0):
        self.cfg, self.schema, self.engine = cfg, schema, engine
        self._startup = {"engine_start": engine_start_s}  # charged to the first unit this writer commits
        self.fs, self.root = resolve(cfg.output.uri, cfg.s3)
        self.compress_threads = compress_threads
        self._local_tmp = join(self.root, "_tmp") if not cfg.output.uri.startswith("s3://") else None

    def process(self, tu: TokenizedUnit, streamed: list[SampleMeta] = ()) -> ShardRecord:
        """Capture and commit one unit -- once: a unit already committed (Ray re-running a task
        whose output was lost with a node, say) returns its record untouched. ``streamed``: the
        unit's samples a streaming run trains on without storing them (counted, not written)."""
        path = join(self.root, layout.unit_record_path(tu.unit))
        if exists(self.fs, path):
            done = ShardRecord.model_validate_json(read_bytes(self.fs, path))
            if done.source_rows == (tu.start, tu.end):
                return done
        rec = ShardRecord(
            unit=tu.unit,
            source_rows=(tu.start, tu.end),
            path=None,
            rows=len(tu.samples),
            tokens=sum(len(s.input_ids) for s in tu.samples),
            loss_tokens=sum(sum(s.loss_mask) for s in tu.samples),
            quarantined=len(tu.quarantine),
            bytes=0,
            sha256=None,
            streamed=len(streamed),
            streamed_tokens=sum(len(s.input_ids) for s in streamed),
        )
        seconds = Counter({"tokenize": tu.tokenize_s, **self._startup})
        self._startup = {}
        if tu.samples:
            nbytes, digest = self._write_shard(tu, seconds)
            rec.path, rec.bytes, rec.sha256 = layout.shard_path(tu.unit), nbytes, digest
        t0 = time.perf_counter()
        if tu.quarantine:
            qp = layout.quarantine_path(tu.unit)
            body = "".join(json.dumps(q, ensure_ascii=False) + "\n" for q in tu.quarantine)
            atomic_write_bytes(self.fs, join(self.root, qp), body.encode())
            rec.quarantine_path = qp
        seconds["commit"] += time.perf_counter() - t0
        rec.seconds = {k: round(v, 4) for k, v in seconds.items()}
        # The unit record is the commit point: written last, atomically.
        atomic_write_bytes(self.fs, path, rec.model_dump_json().encode())
        return rec

    def _write_shard(self, tu: TokenizedUnit, seconds: Counter) -> tuple[int, str]:
        """Capture batch after batch while a writer thread encodes the previous one; adds where
        the time went to ``seconds`` (writer_wait: the capture thread waiting for the writer)."""
        writer = ShardWriter(
            self.fs,
            join(self.root, layout.shard_path(tu.unit)),
            self.schema,
            tmp_dir=self._local_tmp,
            compress_threads=self.compress_threads,
        )
        lengths = [len(s.input_ids) for s in tu.samples]
        q: queue.Queue = queue.Queue(maxsize=2)
        errors: list[BaseException] = []

        def drain() -> None:
            while (item := q.get()) is not None:
                if errors:
                    continue
                try:
                    writer.write(*item)
                except BaseException as e:  # re-raised on the capture thread
                    errors.append(e)

        t = threading.Thread(target=drain, name=f"shard-writer-{tu.unit}", daemon=True)
        t.start()
        try:
            for idx in self.engine.plan_batches(lengths):
                metas = [tu.samples[i] for i in idx]
                batch: CapturedBatch = self.engine.capture([m.input_ids for m in metas])
                seconds.update(batch.seconds)
                t0 = time.perf_counter()
                q.put((metas, batch.lengths, batch.planes))
                seconds["writer_wait"] += time.perf_counter() - t0
                if errors:
                    break
        finally:
            t0 = time.perf_counter()
            q.put(None)
            t.join()
            seconds["writer_wait"] += time.perf_counter() - t0
        if errors:
            writer.abort()
            raise errors[0]
        out = writer.commit()
        seconds.update(writer.seconds())
        return out


def fingerprint_dataset(cfg: ExtractConfig, manifest: DatasetManifest) -> dict:
    """Fingerprint probe samples from the committed shards (the values training will read)."""
    t0 = time.perf_counter()
    reader = DatasetReader(cfg.output.uri, cfg.s3, verify_checksums=False, manifest=manifest)
    fp = fingerprint.compute(reader, cfg.fingerprint.probe_samples, cfg.fingerprint.dim, cfg.fingerprint.seed)
    path, digest = fp.save(cfg.output.uri, cfg.s3)
    dt = time.perf_counter() - t0
    log.info("fingerprinted %d probe samples x %d capture points in %.2fs", len(fp.sample_ids), len(fp.points), dt)
    return {
        "path": path,
        "sha256": digest,
        "probe_samples": len(fp.sample_ids),
        "dim": fp.dim,
        "seed": fp.seed,
        "seconds": dt,
    }


class CaptureWorker:
    """Hosts the engine (loaded on the first unit) and turns source rows into committed units.

    Tokenizing here, next to the engine, costs a few milliseconds per unit; separate tokenize
    processes cost seconds of start-up and imports each, on the cores the forward needs.
    """

    def __init__(self, cfg_json: str, schema: pa.Schema, in_ray: bool = True, imports_s: float = 0.0):
        """``imports_s``: the seconds importing this module took (torch among them), counted in
        the engine's start so that a job's breakdown does not charge them to Ray."""
        self.cfg = ExtractConfig.model_validate_json(cfg_json)
        self._imports_s = imports_s
        self.schema = schema
        if in_ray and not self.cfg.ray.gpus_per_actor:
            # Ray sets one OMP thread for a fractional or 1-CPU actor; compute with what it holds.
            torch.set_num_threads(max(1, round(self.cfg.ray.cpus_per_actor)))
        self.engine = None
        self._writer: UnitWriter | None = None

    def writer(self) -> UnitWriter:
        if self._writer is None:
            t0 = time.perf_counter()
            self.engine = open_engine(self.cfg)
            self._writer = UnitWriter(
                self.cfg,
                self.schema,
                self.engine,
                compress_threads=self.cfg.ray.writer_threads_per_actor(),
                engine_start_s=self._imports_s + time.perf_counter() - t0,
            )
        return self._writer

    def process(self, unit: int, start: int, rows: list[bytes], keep: list[int] | None = None) -> str:
        """Tokenize, capture and commit one unit; its commit record (JSON). ``keep``: store only
        these source rows, the others are streamed (a streaming run's held-out data)."""
        writer = self.writer()  # first: the engine's imports and load count as its start, not as tokenizing
        tu = tokenize_unit(self.cfg, unit, start, rows)
        streamed: list[SampleMeta] = []
        if keep is not None:
            kept = set(keep)
            streamed = [s for s in tu.samples if s.source_row not in kept]
            tu.samples = [s for s in tu.samples if s.source_row in kept]
        return writer.process(tu, streamed).model_dump_json()

    def fingerprint(self, manifest_json: str) -> dict:
        return fingerprint_dataset(self.cfg, DatasetManifest.model_validate_json(manifest_json))

    def close(self) -> None:
        """Release the engine (vLLM/SGLang run their own processes)."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()
        self.engine = self._writer = None
