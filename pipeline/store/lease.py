"""A lease in an object store (a registry, a dataset's output): one holder at a time, per name.

Taken with a conditional create (If-None-Match) or, once the holder's lease has expired, a
conditional overwrite of exactly the expired object (If-Match), so two processes racing for
it cannot both win. The holder renews it in the background and releases it on exit with a
conditional delete; a holder that dies lets it expire -- or, on the same host, is seen to be
dead at once (its pid is gone), so a resume right after a crash need not wait out the TTL.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from datetime import UTC, datetime

from pydantic import BaseModel

from pipeline.store.objects import ObjectStore, PreconditionFailed, StoreUnavailable

log = logging.getLogger(__name__)


class LeaseRecord(BaseModel):
    name: str
    owner: str
    run_id: str
    acquired_at: str
    expires_at: float  # unix seconds

    def describe(self) -> str:
        left = self.expires_at - time.time()
        return f"{self.owner} (run {self.run_id}, since {self.acquired_at}, expires in {left:.0f} s)"


class LeaseHeld(RuntimeError):
    def __init__(self, holder: LeaseRecord):
        super().__init__(f"lease {holder.name!r} is held by {holder.describe()}")
        self.holder = holder


def _dead_on_this_host(owner: str) -> bool:
    """``host:pid`` names a process of this host that no longer runs."""
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, someone else's
        return False
    return False


# Runs of this process that hold a lease now: a record naming this process but none of these
# is left from an earlier run whose release could not reach the store (it had gone away).
_HELD_HERE: set[str] = set()


def _ended_in_this_process(holder: LeaseRecord) -> bool:
    return holder.owner == f"{socket.gethostname()}:{os.getpid()}" and holder.run_id not in _HELD_HERE


class Lease:
    """``with Lease(store, name, ttl_s):`` -- raises LeaseHeld when someone else holds it."""

    def __init__(self, store: ObjectStore, name: str, ttl_s: float, run_id: str | None = None):
        self.store, self.name, self.ttl_s = store, name, ttl_s
        self.key = f"leases/{name}.json"
        self.record = LeaseRecord(
            name=name,
            owner=f"{socket.gethostname()}:{os.getpid()}",
            run_id=run_id or uuid.uuid4().hex[:12],
            acquired_at="",
            expires_at=0,
        )
        self._etag: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = False

    def _body(self) -> bytes:
        self.record.expires_at = time.time() + self.ttl_s
        return self.record.model_dump_json().encode()

    def acquire(self) -> Lease:
        self.record.acquired_at = datetime.now(UTC).isoformat(timespec="seconds")
        cur = self.store.get(self.key)
        # Counted as held before the write: another thread of this process that reads the record
        # between this write and the next line must not take it as a run that ended here.
        _HELD_HERE.add(self.record.run_id)
        try:
            if cur is None:
                self._etag = self.store.put(self.key, self._body(), if_none_match=True)
            else:
                holder = LeaseRecord.model_validate_json(cur[0])
                dead = _dead_on_this_host(holder.owner) or _ended_in_this_process(holder)
                if holder.expires_at > time.time() and not dead:
                    raise LeaseHeld(holder)
                log.warning(
                    "lease %s: taking over from %s, %s",
                    self.name,
                    holder.describe(),
                    "its run is gone" if dead else "expired",
                )
                self._etag = self.store.put(self.key, self._body(), if_match=cur[1])
        except BaseException as e:
            _HELD_HERE.discard(self.record.run_id)
            if not isinstance(e, PreconditionFailed):
                raise
            now = self.store.get(self.key)
            raise LeaseHeld(LeaseRecord.model_validate_json(now[0]) if now else self.record) from None
        log.info("lease %s taken by %s (ttl %.0f s)", self.name, self.record.owner, self.ttl_s)
        self._thread = threading.Thread(target=self._renew_loop, name=f"lease-{self.name}", daemon=True)
        self._thread.start()
        return self

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            with self._lock:
                try:
                    self._etag = self.store.put(self.key, self._body(), if_match=self._etag)
                except PreconditionFailed:
                    self.lost = True
                    log.error("lease %s was taken over by someone else; this run must not promote", self.name)
                    return
                except StoreUnavailable as e:  # the store may come back before the lease expires
                    log.warning("lease %s: renewal failed (%s); retrying", self.name, e)

    def check(self) -> None:
        """Raise unless this process still holds the lease (call before irreversible steps)."""
        if self.lost:
            raise RuntimeError(f"lease {self.name!r} was lost during the run; not promoting")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            if self._etag is not None and not self.lost:
                try:
                    self.store.delete(self.key, if_match=self._etag)
                    log.info("lease %s released", self.name)
                except PreconditionFailed:
                    log.warning("lease %s changed before release; left as is", self.name)
                except StoreUnavailable as e:  # never hides the error that ended the run
                    log.warning(
                        "lease %s could not be released (%s): it expires in %.0f s, or at once for a "
                        "rerun on this host",
                        self.name,
                        e,
                        self.ttl_s,
                    )
            self._etag = None
            _HELD_HERE.discard(self.record.run_id)

    def __enter__(self) -> Lease:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
