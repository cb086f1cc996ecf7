"""Acceptance, defined once -- every figure Strata prints (training's held-out measurement,
validation through an engine, the reference decoding, the cost table) is this quantity.

Chain acceptance under greedy decoding with k draft tokens: at each verify step draft
position j counts as accepted when it and every earlier position equal the target's greedy
tokens. A step is counted whole, as vLLM's and SGLang's counters count it, even where the
emitted text stops inside it (the end of the turn or the token budget). Over a set of
prompts the counts are token-weighted (summed over every verify step of every prompt):

    rate_j = accepted_j / steps,  accepted per step = sum_j rate_j,
    mean acceptance length = 1 + accepted per step  (tokens one verify step emits).

Its standard error treats prompts as the independent units (steps within one generation
are not independent): the ratio estimator's delta-method SE over prompts. The prompts are
conversations up to the start of their first assistant turn, and generation stops at the
target's end of turn (or the stated token budget) -- what a deployment serves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from schemas.acceptance import Acceptance


def acceptance_length(accepted_per_step: float) -> float:
    """Mean acceptance length: a verify step emits the accepted drafts plus one target token."""
    return 1.0 + accepted_per_step


@dataclass(frozen=True)
class PromptCounts:
    """One prompt's speculative decoding: verify steps, and per draft position the steps that
    accepted it."""

    verify_steps: int
    accepted_per_pos: tuple[int, ...]

    @property
    def accepted(self) -> int:
        return sum(self.accepted_per_pos)


def standard_error(per_prompt: list[PromptCounts]) -> float | None:
    """SE of accepted-per-step (= SE of the mean acceptance length) with prompts as clusters;
    None with fewer than two prompts that ran a verify step."""
    ran = [c for c in per_prompt if c.verify_steps > 0]
    m = len(ran)
    if m < 2:
        return None
    steps = sum(c.verify_steps for c in ran)
    r = sum(c.accepted for c in ran) / steps
    resid = sum((c.accepted - r * c.verify_steps) ** 2 for c in ran)
    return math.sqrt(m / (m - 1) * resid) / steps


def summary(
    measured_by: str,
    k: int,
    verify_steps: int,
    accepted_per_pos: list[int] | None,
    accepted: int | None = None,
    per_prompt: list[PromptCounts] | None = None,
    **extra,
) -> Acceptance:
    """The acceptance record every measurement reports. ``per_prompt`` gives the standard error;
    engines that only expose totals leave it out (``se`` None)."""
    steps = max(verify_steps, 1)
    accepted = sum(accepted_per_pos) if accepted is None else accepted
    return Acceptance(
        measured_by=measured_by,
        k=k,
        verify_steps=verify_steps,
        prompts=len(per_prompt) if per_prompt is not None else None,
        accepted_per_step=accepted / steps,
        mean_acceptance_length=acceptance_length(accepted / steps),
        se=standard_error(per_prompt) if per_prompt is not None else None,
        acceptance_per_pos=[a / steps for a in accepted_per_pos] if accepted_per_pos is not None else None,
        **extra,
    )


def from_prompts(measured_by: str, k: int, per_prompt: list[PromptCounts], **extra) -> Acceptance:
    """:func:`summary` of per-prompt counts."""
    per_pos = [sum(c.accepted_per_pos[j] for c in per_prompt) for j in range(k)]
    return summary(measured_by, k, sum(c.verify_steps for c in per_prompt), per_pos, per_prompt=per_prompt, **extra)


def line(acc: Acceptance) -> str:
    """One line per measurement, for terminals and logs."""
    se = f" +- {acc.se:.2f}" if acc.se is not None else ""
    per = acc.acceptance_per_pos
    per_s = " [" + " ".join(f"{a:.2f}" for a in per) + "]" if per else ""
    n = f"{acc.prompts} prompts, " if acc.prompts is not None else ""
    return (
        f"mean acceptance length {acc.mean_acceptance_length:.2f}{se} (k={acc.k}, {n}"
        f"{acc.verify_steps} verify steps){per_s} -- {acc.measured_by}"
    )
