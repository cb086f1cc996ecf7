"""How well the draft does its job when one aux set is fed to it: the evidence the probe weighs.

The measure is the draft's own training objective -- the soft cross-entropy against the target's
distribution, TTT steps unrolled, on the assistant tokens it was trained to predict -- computed by
the draft's own ``score_step``. Fed the layers it was trained on, a draft is at the optimum its
training found; fed others, it is off it. Greedy agreement is kept for the report, but it is a
coarse reading of the same thing: on a small draft it ranks the trained set anywhere among the
candidates, where the loss ranks it first or second. Positions outside the assistant turns are left
out for the same reason: the draft never learned to predict them.

The fit is relative: any draft, trained or not, fits some aux set best, and a random-init one fits
its favourite set beyond any noise (its outputs still depend on the scale of what it is fed). What
says a draft learned this target at all is its fit against the target's token frequencies: the
same positions predicted by one distribution, the target's own average over them. A trained draft
gets close to the target's entropy; a random-init draft does worse than the frequencies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.draft.model import Eagle3Draft, Layout, TargetBatch, step_target
from pipeline.probe.capture import ProbeCapture


@dataclass
class Evidence:
    """Per TTT step and probe conversation, [steps, P]."""

    fit: torch.Tensor  # minus the soft cross-entropy, summed over the positions in the loss (float64)
    in_loss: torch.Tensor  # those positions
    hits: torch.Tensor  # the draft's greedy token is the target's, at a trained position
    trained: torch.Tensor  # trained positions


@torch.no_grad()
def evidence(
    draft: Eagle3Draft, cap: ProbeCapture, target: TargetBatch, aux: tuple[int, ...], steps: int = 1
) -> Evidence:
    """``cap.states[aux[j]]`` fed to slot j; ``target``: ``cap.targets`` over the draft's vocabulary."""
    x = torch.cat([cap.states[i] for i in aux], dim=-1)
    layout = Layout.of(cap.tokens, cap.lengths)
    rows: list[list[torch.Tensor]] = [[], [], [], []]
    for i, h in enumerate(draft.unroll(x, cap.tokens, steps, layout)):
        s = draft.score_step(h, i, target, layout)
        for out, t in zip(rows, (-s.ce.double(), s.in_loss, s.hit, s.trained), strict=True):
            out.append(t.sum(1))
    fit, in_loss, hits, trained = (torch.stack(r) for r in rows)
    return Evidence(fit, in_loss.long(), hits.long(), trained.long())


def frequencies(cap: ProbeCapture, target: TargetBatch, steps: int = 1) -> torch.Tensor:
    """The fit of the target's token frequencies, scored as ``evidence`` scores the draft: per TTT step
    and probe conversation [steps, P], minus the soft cross-entropy of the positions in the loss
    against their average target distribution (float64)."""
    layout = Layout.of(cap.tokens, cap.lengths)
    out = []
    for i in range(steps):
        p, _, in_loss = step_target(target, i, layout)
        if not bool(in_loss.any()):  # no position this step: nothing to fit, as evidence() finds
            out.append(torch.zeros(p.shape[0], dtype=torch.float64))
            continue
        q = p[in_loss].double().mean(0).clamp_min(1e-30)
        out.append((-(p.double() * q.log()).sum(-1) * in_loss).sum(1))
    return -torch.stack(out)
