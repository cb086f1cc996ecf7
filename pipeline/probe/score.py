"""The draft's agreement with the target for one aux set: the evidence the probe weighs.

At TTT step i, position t of the draft reads token t+i+1 and predicts token t+i+2, which the
target predicted at position t+i+1 (its greedy token there). Step 0 reads the aux states
directly; later steps read the draft's own states, so the aux set's effect carries on.
"""

from __future__ import annotations

import torch

from pipeline.draft.model import Eagle3Draft, draft_to_target, shift
from pipeline.probe.capture import ProbeCapture


@torch.no_grad()
def agreement(
    draft: Eagle3Draft, cap: ProbeCapture, aux: tuple[int, ...], steps: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hits [steps, P], counted [steps, P]) with ``cap.states[aux[j]]`` fed to slot j."""
    P, T = cap.tokens.shape
    x = torch.cat([cap.states[i] for i in aux], dim=-1)
    valid = torch.arange(T)[None, :] < cap.lengths[:, None]
    hits = torch.zeros(steps, P, dtype=torch.long)
    counted = torch.zeros(steps, P, dtype=torch.long)
    for i, h in enumerate(draft.unroll(x, cap.tokens, steps)):
        pred = draft_to_target(draft.logits(h).argmax(-1), draft.d2t)
        ok = shift(valid, i + 1, fill=False)
        hits[i] = ((pred == shift(cap.greedy, i + 1, fill=-1)) & ok).sum(1)
        counted[i] = ok.sum(1)
    return hits, counted
