"""Where capture actors run: a pool of Ray actors, or one in the CLI's process (``--no-ray``).

Both take the pending units and yield commit records as units finish; the job does not know
which it has. Ray actors are restarted when their process dies, and the units they held are
retried (committing a unit is idempotent); a job that stops progressing fails instead of
waiting on work Ray cannot schedule.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pyarrow as pa
from tqdm import tqdm

from pipeline.cluster import stalled
from schemas.extract import ExtractConfig
from schemas.manifest import DatasetManifest, ShardRecord

log = logging.getLogger(__name__)

ACTOR_RESTARTS = 2  # a capture actor whose process dies is restarted this often, its units retried
IN_FLIGHT = 2  # units queued per actor: the next one's rows are there when a unit commits
CLOSE_WAIT_S = 60.0  # how long an engine gets to shut down before its actor is killed


class CaptureActor:
    """The Ray actor around a :class:`~pipeline.extract.worker.CaptureWorker`, which is imported
    in the actor's process only: torch and transformers are seconds of imports the job's own
    process does without."""

    def __init__(self, cfg_json: str, schema: pa.Schema):
        from pipeline.extract.worker import CaptureWorker

        self.worker = CaptureWorker(cfg_json, schema, in_ray=True)

    def process(self, unit: int, start: int, rows: list[bytes]) -> str:
        return self.worker.process(unit, start, rows)

    def fingerprint(self, manifest_json: str) -> dict:
        return self.worker.fingerprint(manifest_json)

    def close(self) -> None:
        self.worker.close()


class RayCapturePool:
    """``ray.num_actors`` capture actors, each holding ``cpus_per_actor``/``gpus_per_actor``."""

    def __init__(self, cfg: ExtractConfig, schema: pa.Schema, units: int):
        import ray

        r = cfg.ray
        self.cfg = cfg
        remote = ray.remote(CaptureActor).options(
            num_cpus=r.cpus_per_actor, num_gpus=r.gpus_per_actor or None,
            max_restarts=ACTOR_RESTARTS, max_task_retries=ACTOR_RESTARTS,
        )
        cfg_json = cfg.model_dump_json()
        # No more actors than units: an idle actor would load the target for nothing.
        self.actors = [remote.remote(cfg_json, schema) for _ in range(max(1, min(r.num_actors, units)))]
        log.info("started %d capture actor(s) x %g CPU%s", len(self.actors), r.cpus_per_actor,
                 f" x {r.gpus_per_actor:g} GPU" if r.gpus_per_actor else "")

    def run(self, payload: list[dict], progress: bool) -> Iterator[ShardRecord]:
        """Each actor keeps ``IN_FLIGHT`` units queued; a finished unit frees its actor's slot."""
        import ray

        todo = list(reversed(payload))
        owner: dict = {}  # in-flight ref -> actor index

        def fill() -> None:
            for i, actor in enumerate(self.actors):
                for _ in range(IN_FLIGHT - sum(1 for a in owner.values() if a == i)):
                    if not todo:
                        return
                    item = todo.pop()
                    owner[actor.process.remote(item["unit"], item["start"], item["rows"])] = i

        timeout = self.cfg.ray.stall_timeout_s or None
        bar = tqdm(total=len(payload), desc="extract", unit="shard", disable=not progress)
        tokens = 0
        fill()
        while owner:
            ready, _ = ray.wait(list(owner), num_returns=1, timeout=timeout)
            if not ready:
                raise stalled(f"extraction of {len(payload)} units", timeout,
                              "re-run to resume (committed units are kept), after freeing or adding resources or "
                              "raising ray.stall_timeout_s")
            ref = ready[0]
            del owner[ref]
            try:
                rec = ShardRecord.model_validate_json(ray.get(ref))
            except ray.exceptions.RayActorError as e:
                raise RuntimeError(f"a capture actor is gone ({str(e).splitlines()[0]}; a process that dies is "
                                   f"restarted {ACTOR_RESTARTS} times); committed units are kept: re-run the job "
                                   "to resume") from e
            fill()
            tokens += rec.tokens
            bar.update(1)
            bar.set_postfix(tokens=tokens, quarantined=rec.quarantined)
            yield rec
        bar.close()

    def fingerprint(self, manifest: DatasetManifest) -> dict:
        """On an actor: it has torch imported already, the job's own process never imports it."""
        import ray

        return ray.get(self.actors[0].fingerprint.remote(manifest.model_dump_json()))

    def close(self, graceful: bool = True) -> None:
        """Let the engines shut down (vLLM and SGLang run their own processes), then end the actors;
        after an error (an actor that may never have been placed) end them at once."""
        import ray

        try:
            if graceful:
                ray.wait([a.close.remote() for a in self.actors], num_returns=len(self.actors), timeout=CLOSE_WAIT_S)
        finally:
            for a in self.actors:
                ray.kill(a)


class LocalCapturePool:
    """One capture actor in this process: the same steps without Ray."""

    def __init__(self, cfg: ExtractConfig, schema: pa.Schema, units: int):
        from pipeline.extract.worker import CaptureWorker

        self.actor = CaptureWorker(cfg.model_dump_json(), schema, in_ray=False)

    def run(self, payload: list[dict], progress: bool) -> Iterator[ShardRecord]:
        for item in tqdm(payload, desc="extract", unit="shard", disable=not progress):
            yield ShardRecord.model_validate_json(self.actor.process(item["unit"], item["start"], item["rows"]))

    def fingerprint(self, manifest: DatasetManifest) -> dict:
        return self.actor.fingerprint(manifest.model_dump_json())

    def close(self, graceful: bool = True) -> None:
        self.actor.close()
