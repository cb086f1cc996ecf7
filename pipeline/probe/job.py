"""``strata probe``: which layers was this draft trained on?

The target runs once over the probe conversations (every boundary kept); candidate aux sets are
ranked by how well the draft fits the target when fed each -- its own training loss on the assistant
tokens (``score``); the answer is the best set,
its margin over the runner-up and that margin's error, or "inconclusive". What a deployment
feeds the draft is the gate's question (``pipeline.validate.foreign``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pipeline import conventions
from pipeline.data.chat import ChatEncoder, Encoded
from pipeline.data.conversations import BadRow, parse_row
from pipeline.data.source import scan_source
from pipeline.data.stdlib import make_conversations
from pipeline.draft.foreign import ForeignDraft, ForeignDraftError, read_draft
from pipeline.identity import target_config, text_config
from pipeline.probe.capture import ProbeCapture, capture_boundaries
from pipeline.probe.search import Inference, Scored, infer, seed_candidates
from schemas.capture import CapturePoint
from schemas.probe import Candidate, ProbeConfig, ProbeReport

log = logging.getLogger(__name__)


@dataclass
class Probe:
    cfg: ProbeConfig
    draft: ForeignDraft
    capture: ProbeCapture
    inference: Inference
    report: ProbeReport

    @property
    def trained(self) -> list[CapturePoint] | None:
        """The declared points, else a conclusive inference; None when no one set is known."""
        if self.cfg.trained_on:
            return self.report.declared
        return self.inference.set_of(self.inference.best) if self.inference.conclusive else None

    @property
    def admissible(self) -> list[list[CapturePoint]] | None:
        """What the gate checks a deployment against: per slot, the points the draft may have been
        trained on -- one each when declared or inferred, several in a slot a tie leaves open; None
        when the probe settled nothing (the draft does not fit the target)."""
        if self.cfg.trained_on:
            assert self.report.declared is not None
            return [[p] for p in self.report.declared]
        adm = self.inference.admissible
        return None if adm is None else [[self.inference.points[k] for k in ks] for ks in adm]


def probe_prompts(cfg: ProbeConfig) -> list[Encoded]:
    """The probe conversations in the target's chat template, with their assistant tokens marked
    (whole conversations: every assistant token is evidence)."""
    if cfg.conversations:
        convs = []
        for row in scan_source(cfg.conversations).rows:
            try:
                convs.append(parse_row(row.data).messages)
            except BadRow:
                continue
    else:
        convs = [c["messages"] for c in make_conversations()]
    assert cfg.target is not None
    enc = ChatEncoder(cfg.target.path, cfg.max_length)
    out = []
    for messages in convs:
        try:
            e = enc.encode(messages)
        except BadRow:  # no assistant turn within max_length: nothing a draft was trained to predict
            continue
        if len(e.input_ids) >= 8:
            out.append(e)
        if len(out) == cfg.prompts:
            break
    if len(out) < 2:
        raise ForeignDraftError(
            f"{cfg.conversations or 'the built-in conversations'}: fewer than two usable conversations to probe with"
        )
    return out


def _check_fits(draft: ForeignDraft, tcfg: dict, target: str) -> None:
    t, c = text_config(tcfg), draft.model.config
    if c.target_hidden_size != t["hidden_size"] or c.vocab_size != t["vocab_size"]:
        raise ForeignDraftError(
            f"{draft.directory}: the draft reads hidden size {c.target_hidden_size} and vocab "
            f"{c.vocab_size}; the target {target} has {t['hidden_size']} and {t['vocab_size']}: "
            "it was trained for another target"
        )


def _given(points, num_aux: int, n: int) -> tuple[int, ...]:
    """A candidate from the config: ascending residual boundaries, one per slot of the draft."""
    aux = tuple(conventions.boundary(p, n) for p in points)
    if len(aux) != num_aux or None in aux or list(aux) != sorted(set(aux)):  # type: ignore[type-var]
        raise ForeignDraftError(
            f"candidate {[str(p) for p in points]}: the draft has {num_aux} slots; give that many "
            "residual-stream points (embedding, layer outputs), ascending and distinct"
        )
    return aux  # type: ignore[return-value]


def _candidate(inf: Inference, s: Scored) -> Candidate:
    pts = inf.set_of(s)
    n = len(inf.points) - 1
    return Candidate(
        points=pts,
        boundaries=[conventions.boundary_label(p, n) for p in pts],
        agreement=[round(a, 4) for a in inf.agreement(s)],
        fit=[round(f, 5) for f in inf.fit(s)],
        pooled_fit=round(inf.pooled(s), 5),
        why=s.why,
    )


def run_probe(cfg: ProbeConfig, progress: bool = True, capture: ProbeCapture | None = None) -> Probe:
    """Probe the draft (the serving comparison is ``pipeline.validate.foreign``'s).
    ``capture``: the target's boundaries on the probe prompts from an earlier probe of this target."""
    assert cfg.target is not None
    tdir = cfg.target.path
    tcfg = target_config(tdir)
    n = int(text_config(tcfg)["num_hidden_layers"])
    draft = read_draft(cfg.draft, tdir)
    _check_fits(draft, tcfg, tdir)
    if capture is None:
        prompts = probe_prompts(cfg)
        log.info("probe: capturing r_0..r_%d of %s on %d prompts", n, tdir, len(prompts))
        capture = capture_boundaries(tdir, prompts, cfg.dtype)
    elif capture.num_layers != n:
        raise ForeignDraftError(f"the capture given holds {capture.num_layers} layers; the target {tdir} has {n}")
    cap = capture
    archs = {}
    for engine in ("vllm", "sglang"):
        try:
            archs[engine] = conventions.engine_family(engine, tcfg)
        except conventions.ConventionError:
            continue
    readings = conventions.readings_of_config(draft.config, n, archs)
    if cfg.candidates:  # the user's shortlist, scored as given: no shifts, no search
        seeds = {_given(c, draft.num_aux, n): ["given"] for c in cfg.candidates}
        rounds = 0
    else:
        seeds, rounds = seed_candidates(readings, draft.num_aux, n), 4
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(desc="probe: candidate aux sets", unit="set", leave=False)
    try:
        inf = infer(
            draft.model,
            cap,
            seeds,
            steps=cfg.steps,
            rounds=rounds,
            resamples=cfg.resamples,
            z=cfg.z,
            min_margin=cfg.min_margin,
            progress=bar,
        )
    finally:
        if bar is not None:
            bar.close()
    report = _report(cfg, draft, inf, readings, n, len(cap.lengths))
    return Probe(cfg, draft, cap, inf, report)


def _report(
    cfg: ProbeConfig, draft: ForeignDraft, inf: Inference, readings: dict, n: int, n_prompts: int
) -> ProbeReport:
    best, ru = _candidate(inf, inf.best), _candidate(inf, inf.runner_up)
    pooled = {s.aux: inf.pooled(s) for s in inf.ranked}
    claimed = []
    for points, who in readings.items():
        aux = tuple(conventions.boundary(p, n) for p in points)
        claimed.append(
            {
                "read_by": who,
                "points": [str(p) for p in points],
                "boundaries": [conventions.boundary_label(p, n) for p in points],
                "fit": round(pooled[aux], 5) if aux in pooled else None,
                "is_the_inferred_set": list(points) == best.points and inf.conclusive,
            }
        )
    words = ", ".join(conventions.describe_point(p, n) for p in best.points)
    among = f"of the {len(inf.ranked)} candidate sets given, " if cfg.candidates else ""
    if inf.conclusive:
        verdict = "inferred"
        summary = (
            f"{among}trained on {', '.join(best.boundaries)} ({words}): the draft's loss is lowest fed these, "
            f"{inf.margin:.4f} nats per token below the runner-up {', '.join(ru.boundaries)} "
            f"(+-{inf.margin_se:.4f} over resampled prompts, {inf.margin / max(inf.margin_se, 1e-12):.1f} SE)"
        )
    else:
        verdict = "inconclusive"
        lead = (
            f"inconclusive: the best set {', '.join(best.boundaries)} (loss {-inf.pooled(inf.best):.4f} nats per "
            f"token) leads the runner-up {', '.join(ru.boundaries)} by {inf.margin:.4f}"
        )
        if not inf.fits_target:
            loss = -inf.pooled(inf.best)
            summary = (
                f"inconclusive: the draft predicts this target's tokens no better than their frequencies do (fed "
                f"its best set {', '.join(best.boundaries)}, its loss is {loss:.4f} nats per token against "
                f"{loss + inf.over_frequencies:.4f} for the frequencies, +-{inf.over_frequencies_se:.4f}) -- an "
                "untrained draft, or one trained for another target: which layers it prefers says nothing about "
                "its training"
            )
        elif inf.beyond_noise:
            summary = (
                f"{lead} (+-{inf.margin_se:.4f}), not clearly more than the {inf.min_margin:g} that tells two sets "
                "apart -- the draft fits both about equally (a draft can read an adjacent boundary as well as its "
                "own); the training config's layers (trained_on) settle it"
            ) + _slots_in_words(inf, n)
        else:
            summary = (
                f"{lead}, within {cfg.z:g} standard errors ({inf.margin_se:.4f}) -- a draft that barely depends on "
                f"which of these layers it reads, or too few prompts ({n_prompts})"
            ) + _slots_in_words(inf, n)
    notes = list(draft.notes)
    provenance = "inferred" if verdict == "inferred" else None
    declared = None
    if cfg.trained_on:
        declared = [conventions.boundary_point(k, n) for k in _given(cfg.trained_on, draft.num_aux, n)]
        agrees = (
            "cannot confirm it"
            if verdict != "inferred"
            else "agrees"
            if best.points == declared
            else "conclusively disagrees"
        )
        summary = (
            f"declared trained on {', '.join(conventions.boundary_label(p, n) for p in declared)}; the probe's "
            f"evidence {agrees}: {summary}"
        )
        if agrees == "conclusively disagrees":
            notes.append("the probe's evidence contradicts the declared training layers: check the training config")
        verdict, provenance = "declared", "declared"
    if not draft.claimed:
        notes.append("the config names no aux ids: every engine would use its default")
    return ProbeReport(
        verdict=verdict,
        summary=summary,
        draft=str(draft.directory),
        layout=draft.layout,
        target=str(cfg.target.path),
        declared=declared if cfg.trained_on else None,
        provenance=provenance,
        num_layers=n,
        prompts=n_prompts,
        positions=inf.positions,
        claimed=draft.claimed,
        best=best,
        runner_up=ru,
        margin=round(inf.margin, 5),
        margin_se=round(inf.margin_se, 5),
        z=cfg.z,
        min_margin=inf.min_margin,
        spread=round(inf.spread, 5),
        over_frequencies=round(inf.over_frequencies, 5),
        over_frequencies_se=round(inf.over_frequencies_se, 5),
        admissible=None
        if (adm := inf.admissible) is None
        else [[conventions.boundary_label(inf.points[k], n) for k in ks] for ks in adm],
        slots=[
            {
                "slot": e.slot,
                "boundary": conventions.boundary_label(inf.points[e.best], n),
                "next_best": None if e.runner_up is None else conventions.boundary_label(inf.points[e.runner_up], n),
                "margin": None if e.runner_up is None else round(e.margin, 5),
                "margin_se": round(e.margin_se, 5),
                "conclusive": inf.slot_conclusive(e),
            }
            for e in inf.slots
        ],
        evaluated=len(inf.ranked),
        claimed_readings=claimed,
        notes=notes,
    )


def _slots_in_words(inf: Inference, n: int) -> str:
    """What a tie still pins down: the slots settled, and the boundaries each other slot may be fed.
    Said only in a tie (``Inference.admissible``)."""
    adm = inf.admissible
    if adm is None:
        return ""
    label = [conventions.boundary_label(p, n) for p in inf.points]
    pinned = [f"slot {j} {label[ks[0]]}" for j, ks in enumerate(adm) if len(ks) == 1]
    open_ = [f"slot {j} {' or '.join(label[k] for k in ks)}" for j, ks in enumerate(adm) if len(ks) > 1]
    if not open_:
        return ""
    settles = f"settles {', '.join(pinned)} and " if pinned else ""
    return f"; the evidence {settles}leaves {', '.join(open_)}"
