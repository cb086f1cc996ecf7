"""Units of work on a pool of Ray actors, or on one worker in this process (``--no-ray``):
what the extraction and regeneration jobs both run their units on.

Both take the pending units and yield each unit's commit record (JSON) as it finishes; the
job does not know which it has. Ray actors are restarted when their process dies and the
units they held are retried (committing a unit is idempotent); a job that stops progressing
fails instead of waiting on work Ray cannot schedule.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from tqdm import tqdm

from pipeline.cluster import stalled
from pipeline.placement import Placement, place_actor
from pipeline.store.fs import join, read_bytes, remove_unpublished
from schemas.extract import RayConfig

log = logging.getLogger(__name__)

ACTOR_RESTARTS = 2  # an actor whose process dies is restarted this often, its units retried
IN_FLIGHT = 2  # units queued per actor: the next one's rows are there when a unit commits
CLOSE_WAIT_S = 60.0  # how long an engine gets to shut down before its actor is killed


def committed(fs, root: str, units_dir: str, record_cls, error: type[Exception], redo: str) -> dict:
    """The commit records (``unit-NNNNN.json`` of ``record_cls``) in ``units_dir``, by unit. A
    writer killed while publishing leaves a ``.unit-NNNNN.json.tmp-*`` sibling: removed here."""
    out = {}
    for path in remove_unpublished(fs, join(root, units_dir), "a commit record"):
        if not path.endswith(".json"):
            continue  # a unit's own output, next to its record
        try:
            rec = record_cls.model_validate_json(read_bytes(fs, path))
        except ValueError as e:
            raise error(
                f"{path}: unreadable commit record ({str(e).splitlines()[0]}); it was not written by "
                f"Strata's atomic commit: delete it to {redo} that unit"
            ) from None
        out[rec.unit] = rec
    return out


class RayUnitPool:
    """``ray.num_actors`` actors of ``actor_cls`` (built with ``args``), each holding
    ``cpus_per_actor``/``gpus_per_actor``; no more actors than units."""

    def __init__(self, actor_cls: type, args: tuple, r: RayConfig, units: int, what: str):
        import ray

        self.r, self.what = r, what
        remote = ray.remote(actor_cls)
        # an idle actor would load the target for nothing
        n = max(1, min(r.num_actors, units))
        self.placements: list[Placement] = []
        self.actors = []
        try:
            for _ in range(n):
                self.placements.append(place_actor(r, r.stall_timeout_s))
                opts = {
                    **self.placements[-1].options,
                    "max_restarts": ACTOR_RESTARTS,
                    "max_task_retries": ACTOR_RESTARTS,
                }
                self.actors.append(remote.options(**opts).remote(*args))
        except BaseException:  # a later actor's group not placed: release the groups already held
            self.close(graceful=False)
            raise
        log.info(
            "started %d %s(s) x %g CPU%s%s",
            len(self.actors),
            what,
            r.cpus_per_actor,
            f" x {r.gpus_per_actor:g} GPU" if r.gpus_per_actor else "",
            f" over {r.nodes_per_actor} nodes each" if r.nodes_per_actor > 1 else "",
        )

    def run(
        self, payload: list[dict], progress: bool, desc: str, postfix: Callable[[str], dict] | None = None
    ) -> Iterator[str]:
        """``actor.process(**item)`` for each item; each actor keeps ``IN_FLIGHT`` queued."""
        import ray

        todo = list(reversed(payload))
        owner: dict = {}  # in-flight ref -> actor index

        def fill() -> None:
            for i, actor in enumerate(self.actors):
                for _ in range(IN_FLIGHT - sum(1 for a in owner.values() if a == i)):
                    if not todo:
                        return
                    owner[actor.process.remote(**todo.pop())] = i

        timeout = self.r.stall_timeout_s or None
        bar = tqdm(total=len(payload), desc=desc, unit="unit", disable=not progress)
        fill()
        while owner:
            ready, _ = ray.wait(list(owner), num_returns=1, timeout=timeout)
            if not ready:
                raise stalled(
                    f"{desc} of {len(payload)} units",
                    timeout,
                    "re-run to resume (committed units are kept), after freeing or adding resources or "
                    "raising ray.stall_timeout_s",
                )
            ref = ready[0]
            del owner[ref]
            try:
                rec = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                raise RuntimeError(
                    f"a {self.what} is gone ({str(e).splitlines()[0]}; a process that dies is "
                    f"restarted {ACTOR_RESTARTS} times); committed units are kept: re-run the job "
                    "to resume"
                ) from e
            fill()
            bar.update(1)
            if postfix is not None:
                bar.set_postfix(**postfix(rec))
            yield rec
        bar.close()

    def call_one(self, method: str, *args):
        """``method`` on one actor (work that needs the actor's imports, not the job's process)."""
        import ray

        return ray.get(getattr(self.actors[0], method).remote(*args))

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
            for p in self.placements:
                p.remove()


class LocalUnitPool:
    """One worker in this process: the same steps without Ray."""

    def __init__(self, worker):
        self.worker = worker

    def run(
        self, payload: list[dict], progress: bool, desc: str, postfix: Callable[[str], dict] | None = None
    ) -> Iterator[str]:
        for item in tqdm(payload, desc=desc, unit="unit", disable=not progress):
            yield self.worker.process(**item)

    def call_one(self, method: str, *args):
        return getattr(self.worker, method)(*args)

    def close(self, graceful: bool = True) -> None:
        self.worker.close()
