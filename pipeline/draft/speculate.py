"""Reference speculative decoding: greedy chain speculation of k draft tokens against an
HF target. Lossless by construction (every emitted token is the target's greedy choice);
returns per-position acceptance so real engines can be measured against it.

Deliberately simple: the target recomputes the whole sequence at every verify step (no KV
cache), which is fine for the small targets it is used with in tests and validation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipeline.acceptance import acceptance_length
from pipeline.conventions.hf_hooks import decoder_parts, hook_capture_point
from pipeline.draft.model import Eagle3Draft, draft_to_target, shift
from schemas.capture import CapturePoint


@dataclass
class SpecResult:
    tokens: list[int]  # generated tokens (excluding the prompt)
    k: int
    verify_steps: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # times draft position j was accepted

    @property
    def accepted_tokens(self) -> int:
        return sum(self.accepted_per_pos)

    @property
    def acceptance_per_pos(self) -> list[float]:
        """Fraction of verify steps in which draft position j was accepted (vLLM's definition)."""
        return [a / max(self.verify_steps, 1) for a in self.accepted_per_pos]

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify step: accepted draft tokens + the target's own token."""
        return acceptance_length(self.accepted_tokens / max(self.verify_steps, 1))


class TargetRunner:
    """An HF causal LM with hooks on the draft's aux capture points."""

    def __init__(self, model, aux_points: list[CapturePoint]):
        self.model = model.eval()
        _, layers, norm = decoder_parts(model)
        self._store: dict[int, torch.Tensor] = {}
        self.slots = list(range(len(aux_points)))
        self._hooks = [hook_capture_point(layers, norm, p, self._store, i) for i, p in enumerate(aux_points)]

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(greedy next token per position [L], concatenated aux states [1, L, A*H])."""
        logits = self.model(input_ids=ids[None], use_cache=False).logits[0]
        aux = torch.cat([self._store[i] for i in self.slots], dim=-1)
        return logits.argmax(-1), aux


@torch.no_grad()
def draft_chain(draft: Eagle3Draft, aux: torch.Tensor, next_tokens: torch.Tensor, k: int) -> list[int]:
    """k greedy draft tokens after the last position; next_tokens[s] = token s+1 (known)."""
    T = next_tokens.shape[1]
    h = draft.fc(aux.to(draft.fc.weight.dtype))
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    pos = torch.arange(T)
    out: list[int] = []
    tokens = next_tokens
    for i in range(k):
        h = draft.step(tokens, h, pos + i, ks, vs)
        d = int(draft.logits(h[:, -1]).argmax(-1))
        t = int(draft_to_target(torch.tensor(d), draft.d2t))
        out.append(t)
        tokens = shift(next_tokens, i + 1, fill=0)
        tokens[:, -1] = t  # only the last position's chain matters from step 1 on
    return out


@torch.no_grad()
def speculative_generate(
    runner: TargetRunner,
    draft: Eagle3Draft,
    prompt: list[int],
    max_new_tokens: int,
    k: int,
    stop_ids: frozenset[int] = frozenset(),
) -> SpecResult:
    """Greedy chain speculation until a stop token or ``max_new_tokens``. Every verify step is
    counted whole (``pipeline.acceptance``): its accepted prefix is scored even where the emitted
    text is cut inside it, as the serving engines' counters do."""
    res = SpecResult(tokens=[], k=k, accepted_per_pos=[0] * k)
    ids = torch.tensor(prompt, dtype=torch.long)
    greedy, aux = runner(ids)
    while True:
        nxt = int(greedy[-1])  # the target's token: always correct
        res.tokens.append(nxt)
        ids = torch.cat([ids, torch.tensor([nxt])])
        if nxt in stop_ids or len(res.tokens) >= max_new_tokens:
            return res
        proposal = draft_chain(draft, aux, ids[1:][None], k)
        greedy_v, aux_v = runner(torch.cat([ids, torch.tensor(proposal)]))
        res.verify_steps += 1
        L = ids.numel()
        accepted = 0
        while accepted < k and int(greedy_v[L - 1 + accepted]) == proposal[accepted]:
            res.accepted_per_pos[accepted] += 1
            accepted += 1
        for tok in proposal[:accepted]:  # emitted up to the stop token or the budget
            res.tokens.append(tok)
            if tok in stop_ids or len(res.tokens) >= max_new_tokens:
                return res
        ids = torch.cat([ids, torch.tensor(proposal[:accepted], dtype=torch.long)])
        greedy, aux = greedy_v[: ids.numel()], aux_v[:, : ids.numel()]


@torch.no_grad()
def greedy_generate(model, prompt: list[int], max_new_tokens: int, stop_ids: frozenset[int] = frozenset()) -> list[int]:
    ids = torch.tensor(prompt, dtype=torch.long)
    out: list[int] = []
    for _ in range(max_new_tokens):
        nxt = int(model(input_ids=ids[None], use_cache=False).logits[0, -1].argmax())
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([nxt])])
        if nxt in stop_ids:
            break
    return out
