"""Connecting to Ray: the cluster a job was submitted to, or a local one."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


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
        log.info("starting a local Ray runtime")
        # Loopback only: a single-machine run has no reason to listen on the node's public IP.
        # The dashboard serves the state API that Ray Train's cleanup polls.
        ray.init(address="local", include_dashboard=True, dashboard_host="127.0.0.1", log_to_driver=True,
                 _node_ip_address="127.0.0.1")
    from ray.data import DataContext

    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False  # Strata prints its own per-unit progress
    ctx.print_on_execution_start = False
