"""Where a capture actor's resources come from: its own CPUs and GPUs on one node, or, for a
target larger than one node (Kimi-K2 class), a placement group spanning ``ray.nodes_per_actor``
nodes that vLLM's Ray executor fills with its tensor-parallel workers.

vLLM's rules for a placement group it is started inside (vLLM 0.32, ``vllm/v1/executor/ray_utils.py``,
``initialize_ray_cluster``; workers asked for in ``ray_executor.py`` with ``num_cpus=0``): it uses the current placement group when there is one, each bundle
may hold at most one GPU, and it needs at least ``world_size`` GPU bundles. So a spanning actor's
group is one CPU bundle for the actor itself plus one bundle per GPU, packed (ranks fill one node
before the next: tensor parallelism's all-reduces stay on NVLink where they can), and the actor
captures child tasks so the workers vLLM starts land in it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pipeline.errors import UnusableInput
from schemas.extract import RayConfig

log = logging.getLogger(__name__)


def actor_bundles(r: RayConfig) -> list[dict[str, float]]:
    """One actor's resources as Ray bundles (the first one is where the actor itself runs)."""
    if r.nodes_per_actor == 1:
        return [{"CPU": r.cpus_per_actor, **({"GPU": r.gpus_per_actor} if r.gpus_per_actor else {})}]
    return [{"CPU": r.cpus_per_actor}] + [{"GPU": 1.0}] * int(r.gpus_per_actor)


def plan_bundles(r: RayConfig) -> list[dict[str, float]]:
    """Every bundle of the job's ``num_actors`` actors, for the up-front resource check."""
    return [b for _ in range(r.num_actors) for b in actor_bundles(r)]


def check_nodes(r: RayConfig, nodes: list[dict] | None = None) -> None:
    """A spanning actor needs ``nodes_per_actor`` nodes with ``gpus_per_actor / nodes_per_actor`` GPUs
    each, not only that many GPUs in total: refuse, naming the nodes, when the cluster has fewer.
    ``nodes``: ``ray.nodes()`` (alive ones count)."""
    if r.nodes_per_actor == 1:
        return
    if nodes is None:
        import ray

        nodes = ray.nodes()
    per_node = r.gpus_per_actor / r.nodes_per_actor
    have = [n for n in nodes if n.get("Alive") and n.get("Resources", {}).get("GPU", 0) >= per_node]
    need = r.nodes_per_actor * r.num_actors
    if len(have) < need:
        gpus = sorted((n.get("Resources", {}).get("GPU", 0) for n in nodes if n.get("Alive")), reverse=True)
        raise UnusableInput(
            f"ray: {r.num_actors} capture actors x nodes_per_actor {r.nodes_per_actor} need {need} nodes with "
            f"{per_node:g} GPUs each (gpus_per_actor {r.gpus_per_actor:g} / nodes_per_actor {r.nodes_per_actor}); "
            f"the cluster's nodes have {', '.join(f'{g:g}' for g in gpus)} GPUs: add GPU nodes, or lower ray.nodes_per_actor and engine.tp_size"
        )


@dataclass
class Placement:
    """Ray ``.options()`` for one actor, and the placement group to remove when it is done (if any)."""

    options: dict
    group: object | None = None

    def remove(self) -> None:
        if self.group is not None:
            from ray.util import remove_placement_group

            remove_placement_group(self.group)
            self.group = None


def place_actor(r: RayConfig, timeout_s: float | None) -> Placement:
    """Resources for one actor; for a spanning actor its placement group, created and waited for."""
    if r.nodes_per_actor == 1:
        return Placement({"num_cpus": r.cpus_per_actor, "num_gpus": r.gpus_per_actor or None})
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = placement_group(actor_bundles(r), strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s or None)
    if not ready:
        from ray.util import remove_placement_group

        remove_placement_group(group)
        raise UnusableInput(
            f"ray: the placement group of a capture actor spanning {r.nodes_per_actor} nodes "
            f"({int(r.gpus_per_actor)} GPUs) was not placed within {timeout_s:g} s: another job may hold "
            "the GPUs; free them or raise ray.stall_timeout_s"
        )
    log.info("placement group %s: %s", group.id.hex()[:12], actor_bundles(r))
    strategy = PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True
    )
    return Placement({"num_cpus": r.cpus_per_actor, "scheduling_strategy": strategy}, group)
