"""Which boundary does each draft slot really receive? Decided from the values the engine fed.

The engine's recorded draft inputs (:mod:`pipeline.engines.vllm.feed`) are split per slot,
sketched with the fingerprints' projection, and compared, token by token, with every
boundary r_0..r_N of the same tokens: on prefill rows against the replayed probe samples,
on verify rows against a capture of the finished sequences. A slot's boundary is named only
when it matches within tolerance and beats every other boundary by the neighbour factor;
otherwise it is reported as matching none. Rows of rejected drafts (their token, or an
earlier one in the same step, is not in the final sequence) are dropped: they hold real
states of tokens that were never emitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipeline.fingerprint import rel_l2, sketch
from schemas.validation import Tolerances


@dataclass
class Rows:
    """Fed rows of one request whose tokens are the final sequence's, split by phase."""

    prefill_pos: list[int] = field(default_factory=list)
    prefill: list[torch.Tensor] = field(default_factory=list)
    verify_pos: list[int] = field(default_factory=list)
    verify: list[torch.Tensor] = field(default_factory=list)


def valid_rows(calls, sequence: list[int], prompt_len: int) -> Rows:
    """Rows of one request's ``propose`` calls that belong to the emitted sequence."""
    out = Rows()
    seen: set[int] = set()
    for c in calls:
        order = torch.argsort(c.positions)
        for j in order.tolist():
            p, t = int(c.positions[j]), int(c.token_ids[j])
            q = p + c.token_offset  # the token a row carries: at its position (vLLM) or the next (SGLang)
            if q >= len(sequence) or sequence[q] != t:
                break  # a rejected draft: it and every later row of this step never happened
            if p in seen:
                continue
            seen.add(p)
            if p < prompt_len:
                out.prefill_pos.append(p)
                out.prefill.append(c.aux[j])
            else:
                out.verify_pos.append(p)
                out.verify.append(c.aux[j])
    return out


@dataclass
class SlotFeed:
    """What one slot received in one phase: the boundary it matches (or None) and the errors."""

    best: str | None
    errors: dict[str, float]
    rows: int

    @property
    def closest(self) -> str:
        return min(self.errors, key=self.errors.get)

    def describe(self, label) -> str:
        if self.best is not None:
            return f"{label(self.best)} (rel L2 {self.errors[self.best]:.4f}, {self.rows} tokens)"
        return (
            f"no boundary (closest {label(self.closest)} at rel L2 {self.errors[self.closest]:.3f}, {self.rows} tokens)"
        )


def identify(fed: torch.Tensor, refs: dict[str, torch.Tensor], tol: Tolerances) -> SlotFeed:
    """``fed`` [T, dim] sketches vs each boundary's sketches of the same tokens."""
    errors = {k: rel_l2(fed, v) for k, v in refs.items()}
    best = min(errors, key=errors.get)
    ok = errors[best] <= tol.match_rel_l2 and all(
        e >= tol.neighbour_factor * errors[best] for k, e in errors.items() if k != best
    )
    return SlotFeed(best if ok else None, errors, int(fed.shape[0]))


def slot_sketches(rows: list[torch.Tensor], n_slots: int, proj: torch.Tensor) -> list[torch.Tensor]:
    """[T, n_slots*H] fed rows -> per slot [T, dim] sketches."""
    x = torch.stack(rows).float()
    h = x.shape[1] // n_slots
    if h * n_slots != x.shape[1] or h != proj.shape[0]:
        raise ValueError(f"the draft was fed rows of width {x.shape[1]}, not {n_slots} slots x hidden {proj.shape[0]}")
    return [sketch(x[:, s * h : (s + 1) * h], proj)[0] for s in range(n_slots)]


@dataclass
class MeasuredFeed:
    """Per slot, what the engine fed on prefill and on verify steps."""

    prefill: list[SlotFeed]
    verify: list[SlotFeed] | None
    vs_training: list[float]  # rel L2 of the prefill feed vs the slot's training values


def measure(
    per_request: list[tuple[Rows, dict[str, torch.Tensor], dict[str, torch.Tensor]]],
    training: list[torch.Tensor],
    n_slots: int,
    proj: torch.Tensor,
    tol: Tolerances,
) -> MeasuredFeed:
    """``per_request``: (rows, boundary sketches [len, dim] of the prompt's sample, of the final
    sequence); ``training``: per request, the slots' training sketches stacked [n_slots, len, dim]."""
    pre_fed: list[list[torch.Tensor]] = [[] for _ in range(n_slots)]
    pre_ref: dict[str, list[torch.Tensor]] = {}
    pre_train: list[list[torch.Tensor]] = [[] for _ in range(n_slots)]
    ver_fed: list[list[torch.Tensor]] = [[] for _ in range(n_slots)]
    ver_ref: dict[str, list[torch.Tensor]] = {}
    for (rows, prompt_refs, seq_refs), train in zip(per_request, training, strict=True):
        if rows.prefill:
            idx = torch.tensor(rows.prefill_pos)
            for s, sk in enumerate(slot_sketches(rows.prefill, n_slots, proj)):
                pre_fed[s].append(sk)
                pre_train[s].append(train[s][idx])
            for k, v in prompt_refs.items():
                pre_ref.setdefault(k, []).append(v[idx])
        if rows.verify:
            idx = torch.tensor(rows.verify_pos)
            for s, sk in enumerate(slot_sketches(rows.verify, n_slots, proj)):
                ver_fed[s].append(sk)
            for k, v in seq_refs.items():
                ver_ref.setdefault(k, []).append(v[idx])
    if not pre_fed[0]:
        raise ValueError("the engine fed the draft no prefill rows of the probe prompts")
    pre_refs = {k: torch.cat(v) for k, v in pre_ref.items()}
    prefill = [identify(torch.cat(pre_fed[s]), pre_refs, tol) for s in range(n_slots)]
    vs_training = [rel_l2(torch.cat(pre_fed[s]), torch.cat(pre_train[s])) for s in range(n_slots)]
    verify = None
    if ver_fed[0]:
        ver_refs = {k: torch.cat(v) for k, v in ver_ref.items()}
        verify = [identify(torch.cat(ver_fed[s]), ver_refs, tol) for s in range(n_slots)]
    return MeasuredFeed(prefill, verify, vs_training)
