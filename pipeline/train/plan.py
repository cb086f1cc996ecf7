"""The run plan: everything the driver decided before launching workers, handed to each
worker as JSON (Ray Train workers do not share the driver's memory)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunPlan:
    cfg: dict
    draft: dict  # DraftConfig fields
    aux: list[str]  # aux capture points, slot order
    final: str  # final capture point in the dataset
    final_needs_norm: bool  # final is pre-norm: apply the target's norm
    train_refs: list[dict]
    eval_refs: list[dict]
    resume_from: str | None = None
    use_ray_data: bool = True
    extra: dict = field(default_factory=dict)
