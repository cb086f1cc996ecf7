"""Where an extraction job puts things inside the dataset root, and what a unit is.

A unit is a contiguous range of source rows; it becomes at most one shard plus its
quarantine file, and is committed by writing ``_units/unit-NNNNN.json`` last. Resume
skips committed units, so each input row lands exactly once.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

JOB_FILE = "_job.json"
UNITS_DIR = "_units"
SHARDS_DIR = "shards"
QUARANTINE_DIR = "quarantine"
QUARANTINE_FILE = "quarantine.jsonl"


@dataclass(frozen=True)
class Unit:
    unit: int
    start: int
    end: int


def plan_units(num_rows: int, rows_per_unit: int) -> list[Unit]:
    return [Unit(i, s, min(s + rows_per_unit, num_rows)) for i, s in enumerate(range(0, num_rows, rows_per_unit))]


def unit_record_path(unit: int) -> str:
    return f"{UNITS_DIR}/unit-{unit:05d}.json"


def shard_path(unit: int) -> str:
    return f"{SHARDS_DIR}/part-{unit:05d}.parquet"


def quarantine_path(unit: int) -> str:
    return f"{QUARANTINE_DIR}/unit-{unit:05d}.jsonl"


def sample_id(source_uri: str, row: int, content_sha256: str) -> str:
    return hashlib.sha256(f"{source_uri}\0{row}\0{content_sha256}".encode()).hexdigest()[:20]


def job_fingerprint(extraction: dict, target_key: str, source_sha256: str, keep: set[int] | None = None) -> str:
    """What must not change between a crashed run and its resume (and, for a streaming run's
    held-out data, which rows it stores)."""
    what = {"extraction": extraction, "target": target_key, "source": source_sha256}
    if keep is not None:
        what["stored_rows"] = hashlib.sha256(json.dumps(sorted(keep)).encode()).hexdigest()
    payload = json.dumps(what, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]
