"""Connecting to Ray: the cluster a job was submitted to, or a local one."""

from __future__ import annotations

import atexit
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

from pipeline.errors import UnusableInput

log = logging.getLogger(__name__)
T = TypeVar("T")

_started_locally = False  # this process started the Ray runtime it uses (no node will join it)
_background: _BackgroundStart | None = None  # a start begun by start_ray_meanwhile, not yet waited for


class _BackgroundStart(threading.Thread):
    """:func:`init_ray` on a thread that then stays parked until the process exits: Ray's processes
    get the parent-death signal, which Linux sends when the *thread* that spawned them ends, so a
    thread that returned after starting Ray would take the GCS and the raylet down with it."""

    def __init__(self, address: str | None, dashboard: bool):
        super().__init__(name="ray-start", daemon=True)
        self.address, self.dashboard = address, dashboard
        self.done = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        def quiet(record: logging.LogRecord) -> bool:  # the handler is set on the main thread instead
            return not record.getMessage().startswith("SIGTERM handler is not set")

        ray_log = logging.getLogger("ray._private.worker")
        ray_log.addFilter(quiet)
        try:
            init_ray(self.address, self.dashboard)
        except BaseException as e:  # re-raised where the job waits for Ray
            self.error = e
        finally:
            ray_log.removeFilter(quiet)
            self.done.set()
        threading.Event().wait()


def start_ray_meanwhile(address: str | None = None, dashboard: bool = True) -> None:
    """Begin :func:`init_ray` on a helper thread and return at once; the job's next
    :func:`init_ray` waits for it (and raises what it raised).

    For a driver that imports its training stack next (torch and transformers: seconds on two
    cores): Ray's start waits mostly on its own processes, so the two
    overlap instead of adding up. ``ray.init`` installs its SIGTERM handler (exit, so that Ray is
    shut down) only from the main thread: it is installed here."""
    global _background
    if _background is not None:
        return
    import ray  # on this thread: the helper's imports should not race the caller's for ray's own modules

    if ray.is_initialized():
        return
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
    _background = _BackgroundStart(address, dashboard)
    _background.start()


def _loopback_only() -> None:
    """A single-machine run has no reason to be reachable from the network.

    ``_node_ip_address`` alone does not do it: Ray resolves the node IP from the machine's
    route and its GCS, raylet and agents then listen on every interface. With Ray's cluster
    mode off it uses the loopback address for all of them (the variable for the processes it
    starts, the constant for this one, which read it at import). Token auth: Ray 2.60 turns
    it on for a new local runtime unless RAY_AUTH_MODE says otherwise (and makes
    ~/.ray/auth_token); Strata only warns when it was switched off.
    """
    from ray._private import ray_constants

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None and mode.lower() != "token":
        log.warning("RAY_AUTH_MODE=%s: the local Ray runtime runs without token auth", mode)


def init_ray(address: str | None = None, dashboard: bool = True) -> None:
    """``ray job submit`` sets RAY_ADDRESS; plain ``python jobs/x.py`` starts a local Ray.

    ``dashboard``: a local Ray starts its dashboard (1.7 s), which serves the state API Ray
    Train's cleanup polls; extraction alone does without, and then starts lean
    (:func:`_lean_start`). The first call in a process decides, :func:`start_ray_meanwhile`'s
    included: a call after it waits for that start.
    """
    global _started_locally, _background
    bg = _background
    if bg is not None and threading.current_thread() is not bg:
        bg.done.wait()
        _background = None
        if bg.error is not None:
            raise bg.error
    # No telemetry: clusters here reach no outside network, and Ray Data's usage
    # collector otherwise polls a Prometheus on localhost:9090 and logs tracebacks.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_DATA_USAGE_DISABLED", "1")
    import ray

    if ray.is_initialized():
        return
    addr = address or os.environ.get("RAY_ADDRESS")
    if addr:
        log.info("connecting to the Ray cluster at %s", addr)
        ray.init(address=addr, log_to_driver=True)
    else:
        _started_locally = True
        log.info("starting a local Ray runtime (loopback only, token auth%s)", "" if dashboard else ", lean")
        _loopback_only()
        with _lean_start(enabled=not dashboard):
            ray.init(
                address="local",
                include_dashboard=dashboard,
                dashboard_host="127.0.0.1",
                log_to_driver=True,
                _node_ip_address="127.0.0.1",
            )
        atexit.register(_stop_local_ray)  # runs before Ray's own exit hook (registered at import)


@contextmanager
def _lean_start(enabled: bool) -> Iterator[None]:
    """Start a local runtime without the Python processes a job on it never uses.

    Without the dashboard, Ray still starts its API server (with only its usage-stats module;
    usage stats are off) and the autoscaler monitor (a local runtime gains no nodes): about
    1.8 CPU-seconds of imports on two cores, in front of the raylet's start. And the raylet
    waits for a full dashboard agent, whose modules then sample every process for metrics
    nobody scrapes here. Here the first two are not started and the agent runs in the mode Ray
    uses when its dashboard packages are missing (``--minimal``: no modules). Logs still reach
    the driver (the log monitor stays). ``bench_extract_job.py`` times Ray's start. Ray's
    private functions are replaced only while ``ray.init`` runs; if they changed, Ray starts
    as it always did.
    """
    if not enabled:
        yield
        return
    try:
        from ray._private import node, utils

        saved = [
            (node.Node, "start_api_server", node.Node.start_api_server),
            (node.Node, "start_monitor", node.Node.start_monitor),
            (utils, "get_dashboard_dependency_error", utils.get_dashboard_dependency_error),
        ]
    except (ImportError, AttributeError) as e:
        log.debug("Ray's start-up changed (%s): starting the full local runtime", e)
        yield
        return

    def no_api_server(self, **_) -> None:
        self._webui_url = None  # what Ray records when its API server cannot start

    node.Node.start_api_server = no_api_server
    node.Node.start_monitor = lambda self: None
    utils.get_dashboard_dependency_error = lambda: ImportError("a lean local runtime: no dashboard")
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def _stop_local_ray() -> None:
    """Ray's shutdown stops the GCS before the autoscaler monitor, whose SIGTERM handler then blocks
    reporting to the stopped GCS until Ray kills it a second later: a second of every CLI run.
    A local single-node runtime keeps nothing in its monitor, so it is ended first, at once."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    try:
        if node is not None and node.head:
            node.kill_monitor(check_alive=False)
    except Exception as e:  # a private API: if it changes, shutdown only takes its second again
        log.debug("could not stop Ray's monitor early: %s", e)
    ray.shutdown()


def require_resources(plan: str, bundles: list[dict[str, float]], fix: str, wait_s: float) -> None:
    """Refuse, in one line, a plan the Ray cluster cannot schedule, instead of letting Ray queue
    its actors and tasks forever ("cluster resources are not enough ... may hang forever").

    ``bundles`` are the plan's actors and tasks (CPU/GPU each). A cluster this job started
    locally gains no nodes, so a plan that does not fit is refused at once; on a cluster the job
    was submitted to, the autoscaler is asked for the bundles (``request_resources``) and the
    job waits up to ``wait_s`` seconds for them before refusing."""
    import ray

    cpus, gpus = sum(b.get("CPU", 0) for b in bundles), sum(b.get("GPU", 0) for b in bundles)

    def have() -> tuple[float, float]:
        total = ray.cluster_resources()
        return total.get("CPU", 0), total.get("GPU", 0)

    cpu, gpu = have()
    if (cpu < cpus or gpu < gpus) and wait_s > 0 and not _started_locally:
        from ray.autoscaler.sdk import request_resources

        log.info(
            "%s needs %g CPUs / %g GPUs, the cluster has %g / %g now: asking the autoscaler, waiting up to %g s",
            plan,
            cpus,
            gpus,
            cpu,
            gpu,
            wait_s,
        )
        request_resources(bundles=bundles)
        try:
            deadline = time.monotonic() + wait_s
            while (cpu < cpus or gpu < gpus) and time.monotonic() < deadline:
                time.sleep(min(5.0, wait_s))
                cpu, gpu = have()
        finally:
            request_resources(bundles=[])  # the job's own actors and tasks hold the nodes from here on
    if cpu < cpus or gpu < gpus:
        waited = f" after waiting {wait_s:g} s for the autoscaler" if wait_s > 0 and not _started_locally else ""
        raise UnusableInput(
            f"{plan} = {cpus:g} CPUs{f' and {gpus:g} GPUs' if gpus else ''}, but the Ray cluster has "
            f"{cpu:g} CPUs{f' and {gpu:g} GPUs' if gpus else ''}{waited}: {fix}, or add nodes"
        )


class Stalled(RuntimeError):
    """Nothing finished for longer than a job allows: Ray queues work it cannot schedule without a
    word (a node lost mid-run, CPUs taken by another job), so the job stops and says so."""


def stalled(what: str, timeout_s: float, fix: str) -> Stalled:
    return Stalled(
        f"{what}: nothing finished in {timeout_s:g} s. Ray may be unable to schedule the work "
        f"(`ray status` lists pending demands) or the work is stuck; {fix}"
    )


def stall_guard(items: Iterator[T], timeout_s: float | None, what: str, fix: str) -> Iterator[T]:
    """``items`` as they arrive (pulled on a helper thread); raises :class:`Stalled` naming
    ``what`` and ``fix`` when none arrives for ``timeout_s`` seconds (None or 0: wait forever).
    However the consumer stops (stall, error, ``break``), ``items`` is closed once its current
    item arrives, so a Ray Data iterator shuts its executor down as it would unguarded."""
    if not timeout_s:
        yield from items
        return
    q: queue.Queue = queue.Queue(maxsize=1)
    end, stop = object(), threading.Event()

    def put(x) -> bool:
        while not stop.is_set():
            try:
                q.put(x, timeout=0.5)
                return True
            except queue.Full:
                pass
        return False

    def pump() -> None:
        try:
            for item in items:
                if not put(item):
                    return
            put(end)
        except BaseException as e:  # re-raised on the consumer's thread
            put(e)
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    threading.Thread(target=pump, name="stall-guard", daemon=True).start()
    try:
        while True:
            try:
                item = q.get(timeout=timeout_s)
            except queue.Empty:
                raise stalled(what, timeout_s, fix) from None
            if item is end:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
