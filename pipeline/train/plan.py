"""The run plan: everything the driver decided before launching workers, handed to each
worker as JSON (Ray Train workers do not share the driver's memory), and the batches each
epoch trains on -- a pure function of (samples, seed, epoch, world size), so a resumed run
continues at exactly the step where it stopped. Standard library only: GPU benchmark boxes
plan batches with it too.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Protocol


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


class Sized(Protocol):
    tokens: int


def plan_epoch(
    refs: list[Sized],
    batch_tokens: int,
    world: int,
    seed: int,
    epoch: int,
    window: int = 256,
    packed: bool = False,
) -> list[list[list[int]]]:
    """steps x workers x sample indices. Length bucketing: shuffle, sort within windows,
    fill each batch up to ``batch_tokens`` tokens (real ones when packed, padded to the
    longest otherwise; a longer sample has a batch of its own), shuffle batches."""
    rng = random.Random(seed * 100_003 + epoch)
    order = list(range(len(refs)))
    rng.shuffle(order)
    batches: list[list[int]] = []
    for w in range(0, len(order), window):
        chunk = sorted(order[w : w + window], key=lambda i: -refs[i].tokens)
        cur: list[int] = []
        used = 0
        for i in chunk:
            cost = used + refs[i].tokens if packed else refs[cur[0] if cur else i].tokens * (len(cur) + 1)
            if cur and cost > batch_tokens:
                batches.append(cur)
                cur, used = [], 0
            cur.append(i)
            used += refs[i].tokens
        if cur:
            batches.append(cur)
    rng.shuffle(batches)
    steps = len(batches) // world
    return [[batches[s * world + r] for r in range(world)] for s in range(steps)]
