"""Rank candidate aux sets by how well the draft fits the target fed each, and say how sure that is.

Candidates first: every reading of the config's ids (each engine release, the training tools,
HF), every default, each of those shifted by 1-3 boundaries, and the embedding inserted. Then a
per-slot search over every boundary from the best so far, until no slot improves. Sets are
ascending and distinct (what an engine can feed). The margin to the runner-up gets a standard
error from resampling prompts. A conclusion needs the margin, less ``z`` of its standard errors,
to exceed ``min_margin``: beyond the noise *and* beyond what a draft can fit equally well. The fit
is the draft's training objective (``score``): minus the soft cross-entropy per position, in nats.
Nothing is concluded from a draft that does not fit the target better than the target's token
frequencies (``fits_target``): its preferences among sets are not a trace of training. Otherwise a
tie still settles something: per slot, the boundaries of the sets the best does not clear by the
floor at ``z`` standard errors (``Inference.admissible``) -- what a deployment may feed that slot.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from pipeline import conventions
from pipeline.draft.model import Eagle3Draft, draft_to_target
from pipeline.probe.capture import ProbeCapture
from pipeline.probe.score import Evidence, evidence, frequencies
from schemas.capture import CapturePoint

Aux = tuple[int, ...]  # indices into ProbeCapture.points, one per slot


@dataclass
class Scored:
    aux: Aux
    ev: Evidence
    why: list[str] = field(default_factory=list)


@dataclass
class SlotEvidence:
    """One slot, the others held at the best set: its best boundary against its next best."""

    slot: int
    best: int  # index into Inference.points
    runner_up: int | None
    margin: float
    margin_se: float


@dataclass
class Inference:
    points: list[CapturePoint]  # the capture's boundaries, r_0..r_N
    ranked: list[Scored]  # best first
    margin: float  # fit(best) - fit(runner-up), nats per position, all steps pooled
    margin_se: float  # its standard error over resampled prompts
    z: float  # how many standard errors make it conclusive
    slots: list[SlotEvidence] = field(default_factory=list)
    min_margin: float = 0.0  # nats per position the runner-up must be worse by, beyond the noise
    ties: list[Scored] = field(default_factory=list)  # the sets the best does not clear by min_margin at z SE
    over_frequencies: float = 0.0  # pooled fit of the best set minus the target's token frequencies
    over_frequencies_se: float = 0.0

    @property
    def spread(self) -> float:
        """Best pooled fit minus the median candidate's: how much the draft leans on its layers."""
        pooled = sorted(self.pooled(s) for s in self.ranked)
        return self.pooled(self.best) - pooled[len(pooled) // 2]

    @property
    def best(self) -> Scored:
        return self.ranked[0]

    @property
    def runner_up(self) -> Scored:
        return self.ranked[1]

    @property
    def conclusive(self) -> bool:
        """The runner-up fits worse by more than ``min_margin``, at ``z`` standard errors. Beyond the
        noise is not enough: a draft can fit a slot's adjacent boundary about as well as its own (drafts
        trained alike on r_2 fit it 0.0003 nats per token better than r_1, or slightly worse), and
        enough prompts make any such difference "significant" -- either way round. A floor on the size
        keeps such a pair a tie however many prompts are used."""
        return self.fits_target and _beyond(self.margin, self.margin_se, self.z, self.min_margin)

    @property
    def fits_target(self) -> bool:
        """Fed its best set, the draft predicts the target better than the target's token frequencies
        do, at ``z`` standard errors: it learned this target, so its preferences can say what it was
        trained on. A random-init draft does not."""
        return _beyond(self.over_frequencies, self.over_frequencies_se, self.z, 0.0)

    @property
    def beyond_noise(self) -> bool:
        """Beyond the noise alone: with ``conclusive`` false, the margin is too small to tell the sets apart."""
        return _beyond(self.margin, self.margin_se, self.z, 0.0)

    @property
    def admissible(self) -> list[list[int]] | None:
        """Per slot, the boundaries the draft may have been trained on, best first: the best set's alone
        when conclusive; in a tie, also those of every set the best does not clear by the floor at ``z``
        standard errors -- within the noise too, where the best set itself may be off but the trained
        one is still among them (each slot judged apart, so a mix of two tied sets is admitted too).
        None when the draft does not fit the target: then nothing is settled."""
        if not self.fits_target:
            return None
        if self.conclusive:
            return [[k] for k in self.best.aux]
        out = [[k] for k in self.best.aux]
        for s in self.ties:
            for slot, k in zip(out, s.aux, strict=True):
                if k not in slot:
                    slot.append(k)
        return out

    def slot_conclusive(self, e: SlotEvidence) -> bool:
        return e.runner_up is None or _beyond(e.margin, e.margin_se, self.z, self.min_margin)

    def set_of(self, s: Scored) -> list[CapturePoint]:
        return [self.points[i] for i in s.aux]

    @property
    def positions(self) -> int:
        """Trained positions scored at step 0."""
        return int(self.best.ev.trained[0].sum())

    def agreement(self, s: Scored) -> list[float]:
        """Per TTT step: the fraction of trained positions where the draft predicted the target's token."""
        return (s.ev.hits.sum(1).float() / s.ev.trained.sum(1).clamp(min=1).float()).tolist()

    def fit(self, s: Scored) -> list[float]:
        """Per TTT step: minus the draft's soft cross-entropy against the target, nats per position."""
        return (s.ev.fit.sum(1) / s.ev.in_loss.sum(1).clamp(min=1)).tolist()

    def pooled(self, s: Scored) -> float:
        return float(s.ev.fit.sum() / s.ev.in_loss.sum().clamp(min=1))


def _beyond(margin: float, se: float, z: float, floor: float) -> bool:
    return margin - z * se > floor


def _ascending(aux: Aux) -> bool:
    return all(a < b for a, b in zip(aux, aux[1:], strict=False))


def seed_candidates(readings: dict[tuple[CapturePoint, ...], list[str]], num_aux: int, n: int) -> dict[Aux, list[str]]:
    """The readings (of the draft's slot count), each shifted by +-1..3, and with the embedding inserted."""
    out: dict[Aux, list[str]] = {}

    def add(points: Sequence[CapturePoint] | None, why: str) -> None:
        if points is None or len(points) != num_aux:
            return
        aux = tuple(conventions.boundary(p, n) for p in points)
        if None not in aux and _ascending(aux):  # type: ignore[arg-type]
            out.setdefault(aux, []).append(why)  # type: ignore[arg-type]

    for points, who in readings.items():
        add(points, "; ".join(who))
    for points, who in list(readings.items()):
        for d in (1, -1, 2, -2, 3, -3):
            add(conventions.shifted(points, d, n), f"{'+' if d > 0 else ''}{d} from {who[0]}")
        add(conventions.embedding_inserted(points, n), f"the embedding inserted into {who[0]}")
    if not out:  # no reading fits the draft's slot count: a search from evenly spread boundaries
        add(conventions.evenly_spread(num_aux, n), "evenly spread")
    return out


def infer(
    draft: Eagle3Draft,
    cap: ProbeCapture,
    seeds: dict[Aux, list[str]],
    steps: int = 1,
    rounds: int = 4,
    resamples: int = 1000,
    z: float = 3.0,
    min_margin: float = 0.0,
    seed: int = 0,
    progress=None,
) -> Inference:
    """Score the seeds, then search slot by slot from the best; rank everything evaluated."""
    n_aux, n_b = draft.config.num_aux, len(cap.points)
    target = cap.targets(draft_to_target(torch.arange(draft.config.draft_vocab_size), draft.d2t))
    if not bool(target.trained.any()):
        raise ValueError("the probe conversations hold no assistant tokens: nothing a draft is trained to predict")
    scored: dict[Aux, Scored] = {}

    def evaluate(cands: Iterable[tuple[Aux, str]]) -> None:
        for aux, why in cands:
            if aux in scored:
                if why not in scored[aux].why:
                    scored[aux].why.append(why)
                continue
            scored[aux] = Scored(aux, evidence(draft, cap, target, aux, steps), [why])
            if progress is not None:
                progress.update(1)

    def key(s: Scored) -> tuple[float, int]:
        return (float(s.ev.fit.sum()), -sum(s.aux))

    def best() -> Scored:
        return max(scored.values(), key=key)

    if not seeds:
        raise ValueError("the probe needs at least one candidate aux set to start from")
    evaluate((aux, "; ".join(why)) for aux, why in seeds.items())
    for _ in range(rounds):
        start = best().aux
        for slot in range(n_aux):
            cur = best().aux
            lo = cur[slot - 1] + 1 if slot else 0
            hi = cur[slot + 1] if slot + 1 < n_aux else n_b
            evaluate(((*cur[:slot], k, *cur[slot + 1 :]), f"per-slot search (slot {slot})") for k in range(lo, hi))
        if best().aux == start:
            break
    ranked = sorted(scored.values(), key=key, reverse=True)
    if len(ranked) < 2:
        raise ValueError("the probe needs at least two candidate aux sets")
    margin, se = _margin(ranked[0], ranked[1], resamples, seed)
    top = ranked[0]
    base = frequencies(cap, target, steps)
    over, over_se = _bootstrap(top.ev.fit - base, top.ev.in_loss, resamples, seed)
    ties = [x for x in ranked[1:] if not _beyond(*_margin(top, x, resamples, seed), z, min_margin)]
    slots = []
    for j in range(n_aux):  # which slots the evidence pins down, and which the draft barely uses
        rivals = [
            x
            for x in ranked[1:]
            if x.aux[j] != top.aux[j] and all(x.aux[i] == top.aux[i] for i in range(n_aux) if i != j)
        ]
        if not rivals:
            slots.append(SlotEvidence(j, top.aux[j], None, float("inf"), 0.0))
            continue
        m, e = _margin(top, rivals[0], resamples, seed + 1 + j)
        slots.append(SlotEvidence(j, top.aux[j], rivals[0].aux[j], m, e))
    return Inference(cap.points, ranked, margin, se, z, slots, min_margin, ties, over, over_se)


def _margin(a: Scored, b: Scored, resamples: int, seed: int) -> tuple[float, float]:
    """Pooled fit difference and its bootstrap standard error over prompts."""
    return _bootstrap(a.ev.fit - b.ev.fit, a.ev.in_loss, resamples, seed)


def _bootstrap(fit_diff: torch.Tensor, in_loss: torch.Tensor, resamples: int, seed: int) -> tuple[float, float]:
    """A [steps, P] fit difference pooled per position, and its standard error over resampled prompts."""
    diff, cnt = fit_diff.sum(0), in_loss.sum(0).double()  # per prompt
    margin = float(diff.sum() / cnt.sum().clamp(min=1))
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, diff.numel(), (resamples, diff.numel()), generator=g)
    boot = diff[idx].sum(1) / cnt[idx].sum(1).clamp(min=1)
    return margin, float(boot.std())
