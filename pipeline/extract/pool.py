"""Where capture workers run (``pipeline.unitpool``): Ray actors, or one in the CLI's process."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pyarrow as pa

from pipeline.unitpool import LocalUnitPool, RayUnitPool
from schemas.extract import ExtractConfig
from schemas.manifest import DatasetManifest, ShardRecord


def _capture_worker(cfg_json: str, schema: pa.Schema, in_ray: bool):
    """A :class:`~pipeline.extract.worker.CaptureWorker`, its module imported here (torch among
    its imports, none when this process has it already) and those seconds counted in its start."""
    t0 = time.perf_counter()
    from pipeline.extract.worker import CaptureWorker

    return CaptureWorker(cfg_json, schema, in_ray=in_ray, imports_s=time.perf_counter() - t0)


class CaptureActor:
    """The Ray actor around a :class:`~pipeline.extract.worker.CaptureWorker`, which is imported
    in the actor's process only: torch and transformers are seconds of imports the job's own
    process does without."""

    def __init__(self, cfg_json: str, schema: pa.Schema):
        self.worker = _capture_worker(cfg_json, schema, in_ray=True)

    def process(self, unit: int, start: int, rows: list[bytes], keep: list[int] | None = None) -> str:
        return self.worker.process(unit, start, rows, keep)

    def fingerprint(self, manifest_json: str) -> dict:
        return self.worker.fingerprint(manifest_json)

    def close(self) -> None:
        self.worker.close()


class CapturePool:
    """Capture workers on Ray actors (``use_ray``) or in this process; yields commit records."""

    def __init__(
        self, cfg: ExtractConfig, schema: pa.Schema, units: int, use_ray: bool, actor_cls: type = CaptureActor
    ):
        if use_ray:
            self.pool = RayUnitPool(actor_cls, (cfg.model_dump_json(), schema), cfg.ray, units, "capture actor")
        else:
            self.pool = LocalUnitPool(_capture_worker(cfg.model_dump_json(), schema, in_ray=False))

    def run(self, payload: list[dict], progress: bool) -> Iterator[ShardRecord]:
        seen = {"tokens": 0}

        def postfix(rec_json: str) -> dict:
            rec = ShardRecord.model_validate_json(rec_json)
            seen["tokens"] += rec.tokens
            return {"tokens": seen["tokens"], "quarantined": rec.quarantined}

        for rec in self.pool.run(payload, progress, "extract", postfix):
            yield ShardRecord.model_validate_json(rec)

    def fingerprint(self, manifest: DatasetManifest) -> dict:
        """On a worker: it has torch imported already, the job's own process never imports it."""
        return self.pool.call_one("fingerprint", manifest.model_dump_json())

    @property
    def actors(self) -> list:
        """The Ray actors (a streaming run's feeder sends them batches to capture)."""
        return self.pool.actors

    def close(self, graceful: bool = True) -> None:
        self.pool.close(graceful)
