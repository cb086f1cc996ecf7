"""Connecting to Ray: the cluster a job was submitted to, or a local one."""

from __future__ import annotations

import logging
import os

from pipeline.errors import UnusableInput

log = logging.getLogger(__name__)


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


def init_ray(address: str | None = None) -> None:
    """``ray job submit`` sets RAY_ADDRESS; plain ``python jobs/x.py`` starts a local Ray."""
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
        log.info("starting a local Ray runtime (loopback only, token auth)")
        _loopback_only()
        # The dashboard serves the state API that Ray Train's cleanup polls.
        ray.init(address="local", include_dashboard=True, dashboard_host="127.0.0.1", log_to_driver=True,
                 _node_ip_address="127.0.0.1")
    from ray.data import DataContext

    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False  # Strata prints its own per-unit progress
    ctx.print_on_execution_start = False


def require_resources(plan: str, cpus: float, gpus: float, fix: str) -> None:
    """Refuse, in one line, a plan the Ray cluster cannot schedule: Ray would otherwise queue its
    tasks and actors forever ("cluster resources are not enough ... may hang forever").
    ``plan`` says how ``cpus`` and ``gpus`` add up; ``fix`` what to change."""
    import ray

    total = ray.cluster_resources()
    have_cpu, have_gpu = total.get("CPU", 0), total.get("GPU", 0)
    if have_cpu < cpus or have_gpu < gpus:
        raise UnusableInput(f"{plan} = {cpus:g} CPUs{f' and {gpus:g} GPUs' if gpus else ''}, but the Ray cluster has "
                            f"{have_cpu:g} CPUs{f' and {have_gpu:g} GPUs' if gpus else ''}: {fix}, or add nodes")
