"""Read a conversations source (JSONL or Parquet, local or S3) into raw rows.

Rows stay raw bytes here: parsing happens in the tokenize tasks, so every bad row is
quarantined by the same code, with its source line and reason.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.data.conversations import UNREADABLE
from pipeline.store.fs import exists, join, read_bytes, resolve
from schemas.regenerate import CONVERSATIONS_FILE, RECORD_FILE, RegenerationRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RawRow:
    row: int  # 0-based index in the source
    data: bytes  # one JSONL line, or a Parquet row re-encoded as JSON


@dataclass
class SourceScan:
    uri: str
    format: str
    sha256: str
    rows: list[RawRow]


def detect_format(uri: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    if uri.endswith((".jsonl", ".json", ".jsonl.gz")):
        return "jsonl"
    if uri.endswith((".parquet", ".pq")):
        return "parquet"
    raise ValueError(f"source.uri {uri!r}: cannot tell the format from the name; set source.format to jsonl or parquet")


def scan_source(uri: str, fmt: str = "auto", s3: object | None = None) -> SourceScan:
    """Read every row and the source's digest. Parquet rows become canonical JSON."""
    fmt = detect_format(uri, fmt)
    fs, path = resolve(uri, s3)
    info = fs.get_file_info(path)
    if info.type != pafs.FileType.File:
        raise FileNotFoundError(f"source.uri {uri!r} does not exist or is not a file")
    try:
        with fs.open_input_stream(path) as f:
            blob = f.read()
    except OSError as e:
        raise OSError(f"source.uri {uri!r}: cannot read it: {e}") from None
    digest = hashlib.sha256(blob).hexdigest()
    if fmt == "jsonl":
        lines = blob.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        rows = [RawRow(i, line.rstrip(b"\r")) for i, line in enumerate(lines)]
    else:
        rows = _parquet_rows(uri, blob)
    return SourceScan(uri=uri, format=fmt, sha256=digest, rows=rows)


CONVERSATION_COLUMNS = ("messages", "conversations")


def _parquet_rows(uri: str, blob: bytes) -> list[RawRow]:
    """The conversation column of each row as canonical JSON; other columns (ids, timestamps,
    binary blobs) are not part of a conversation and are ignored."""
    import pyarrow as pa

    try:
        table = pq.read_table(pa.BufferReader(blob))
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"source.uri {uri!r}: not a readable Parquet file: {e}") from None
    keep = [c for c in CONVERSATION_COLUMNS if c in table.column_names]
    if not keep:
        raise ValueError(
            f"source.uri {uri!r}: no {' or '.join(CONVERSATION_COLUMNS)} column; it has {table.column_names}"
        )
    rows = []
    for i, r in enumerate(_iter_rows(table.select(keep))):
        try:
            rows.append(RawRow(i, json.dumps(r, ensure_ascii=False, sort_keys=True).encode("utf-8", "surrogatepass")))
        except (TypeError, ValueError) as e:  # a conversation field holding non-JSON values: that row is bad
            rows.append(
                RawRow(i, json.dumps({UNREADABLE: f"not JSON-representable: {type(e).__name__}: {e}"}).encode())
            )
    return rows


def _iter_rows(table) -> Iterator[dict]:
    for batch in table.to_batches(max_chunksize=4096):
        yield from batch.to_pylist()


def regeneration_of(source_uri: str, source_sha256: str, s3=None) -> dict | None:
    """The provenance of a regenerated source: ``regeneration.json`` beside it, if it vouches for
    exactly these bytes (a file edited after regeneration is not the target's output)."""
    if not source_uri.endswith("/" + CONVERSATIONS_FILE) and source_uri != CONVERSATIONS_FILE:
        return None
    base = source_uri[: -len(CONVERSATIONS_FILE)].rstrip("/") or "."
    fs, root = resolve(base, s3)
    if not exists(fs, join(root, RECORD_FILE)):
        return None
    rec = RegenerationRecord.model_validate_json(read_bytes(fs, join(root, RECORD_FILE)))
    if rec.output_sha256 != source_sha256:
        log.warning(
            "%s: %s does not describe this file (it changed after regeneration); not recorded as regenerated",
            source_uri,
            RECORD_FILE,
        )
        return None
    return rec.model_dump(mode="json", exclude={"quarantine"})
