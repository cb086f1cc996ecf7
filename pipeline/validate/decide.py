"""The decision: the checks in order -- identity, reading rule, replay, release, the measured
feed, slots, acceptance -- each a function from its inputs to (result, reasons), and every
reason to block collected into the report.

With ``serving.replay: engine`` the slot table follows the *measured* feed (vLLM here and
in CI, and SGLang 0.5.18 from its own environment). The versioned rule table
(``pipeline.conventions.releases``) is shown beside it; a disagreement is reported as a
table bug, never silently resolved. Where the engine cannot run (``replay: hf``), the rule
for ``serving.engine_version`` decides, and a release without a known rule is refused.
Only the engine's refusal of the draft as configured is a finding; any other exception is an
error in Strata and propagates.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pipeline import conventions
from pipeline.engines.base import ServeResult, TargetEngine
from pipeline.engines.errors import EngineError
from pipeline.fingerprint import Fingerprints, projection, sketch
from pipeline.validate import acceptance, checks
from pipeline.validate import feed as F
from pipeline.validate.case import Case, deployment
from pipeline.validate.gate import check_slots, fix_hint, label
from pipeline.validate.replay import replay
from schemas.acceptance import HeldoutAcceptance
from schemas.artifact import (
    DraftArtifactManifest,
)
from schemas.capture import CapturePoint
from schemas.validation import (
    AcceptanceSection,
    EngineReads,
    Feed,
    SlotCheck,
    SlotFeed,
    ValidateConfig,
    ValidationReport,
)

log = logging.getLogger(__name__)


def decide(case: Case, engine: TargetEngine) -> ValidationReport:
    """Run the checks in order -- identity, reading rule, replay, release, measured feed, slots,
    acceptance -- and collect every reason to block."""
    cfg, s, n, trained, fp, art = case.cfg, case.cfg.serving, case.n, case.trained, case.fp, case.art
    draft_cfg_path, release, reading = case.draft_cfg_path, case.release, case.reading
    identity, res = checks.identity(case.manifest.target, case.serving_id, case.manifest.provenance != "fingerprints")
    if reading is not None:
        reasons = res.reasons + checks.reading_rule(case.readings, trained, s.engine, draft_cfg_path.name, n).reasons
        engine_reads = reading.reads(n).model_copy(
            update={"release": release, "other_runners": [r.reads(n) for r in case.readings[1:]]}
        )
    else:
        reasons = res.reasons
        engine_reads = EngineReads(
            release=release,
            no_rule=case.no_rule,
            note=f"no derived rule for {s.engine} {release} ({case.family}): the verdict follows the "
            f"measured feed; python -m pipeline.conventions.derive --engine {s.engine} --release "
            f"{release} adds it",
        )
    replayed = replay(engine, fp, n, s.target.path)
    got, res = checks.installed_release(s, release)
    if got is not None:
        engine_reads.replayed_with = f"{s.engine} {got}"
    reasons += res.reasons
    wrong_release = bool(res.reasons)

    served, slots, feed, more = slot_table(case, engine, replayed, wrong_release)
    reasons += more
    bad = [x for x in slots if not x.ok]
    reasons += [x.message for x in bad]
    if bad and reading is not None:
        if reading.ids is not None:
            reasons.append(f"{reading.rule.name} reads ids {reading.ids} from {reading.key} of {draft_cfg_path.name}")
        reasons.append(fix_hint(trained, s.engine, n, case.family, release, reading.rule.runner))
    elif bad:
        reasons.append(
            f"no derived rule for {s.engine} {release} says which ids feed the trained layers: derive it "
            f"(python -m pipeline.conventions.derive --engine {s.engine} --release {release}) for the fix"
        )

    fed = [x.fed for x in slots]
    accept = measure_acceptance(cfg, case.manifest, art, fp, fed, trained, served, blocked=bool(reasons))
    accept, more = acceptance.check(cfg, accept)
    reasons += more

    sc = deployment(cfg, case.draft_cfg_bytes, case.serving_id.key, case.family, release)
    return ValidationReport(
        decision="block" if reasons else "pass",
        reasons=reasons,
        artifact_digest=case.manifest.content_digest,
        serving_key=sc.key,
        serving=sc.model_dump(mode="json") | {"attn_implementation": s.attn_implementation},
        engine_reads=engine_reads,
        feed=feed,
        slots=slots,
        identity=identity,
        acceptance=accept,
        provenance=provenance(case.manifest),
        tolerances=cfg.tolerances.model_dump(),
        calibration={
            "matched_rel_l2": [x.errors[x.best] for x in slots],
            "nearest_other_rel_l2": [sorted(v for k, v in x.errors.items() if k != x.best)[0] for x in slots],
            "note": "measured: fp32 replay of fp32 data ~1e-6; bf16 vs fp32 ~0.2-1%; eager vs sdpa ~1e-6 (fp32); "
            "adjacent boundaries 28-96% on the tiny target",
        },
    )


def provenance(m: DraftArtifactManifest) -> dict:
    """Where the trained points come from: the training data's fingerprints, or the probe's inference."""
    if m.provenance != "fingerprints":
        p = m.probe or {}
        how = (
            "inferred by strata probe from the draft's own predictions (not fingerprint evidence)"
            if m.provenance == "inferred"
            else "declared by whoever trained the draft (not fingerprint evidence)"
        )
        return {
            "trained_points": how,
            "open_slots": {
                str(j): [str(x) for x in [m.aux_capture_points[j], *alts]]
                for j, alts in enumerate(m.aux_alternatives)
                if alts
            },
            "margin": p.get("margin"),
            "margin_se": p.get("margin_se"),
            "summary": p.get("summary"),
            "source": p.get("source"),
        }
    return {"trained_points": "the training data's fingerprints", "dataset_id": m.dataset_id}


def slot_table(
    case: Case, engine: TargetEngine, replayed: dict, wrong_release: bool
) -> tuple[ServeResult | None, list[SlotCheck], Feed, list[str]]:
    """Serve the draft as configured and measure what reaches its fc where the engine can run
    it; otherwise the rule's prediction fills the slot table. Returns (served, slots, the
    report's feed section, reasons)."""
    cfg, s, n, trained, fp, reading = case.cfg, case.cfg.serving, case.n, case.trained, case.fp, case.reading
    predicted = reading.points if reading is not None else []

    def by_rule(served: ServeResult | None, why: str | None, reasons: list[str]):
        if reading is None:  # no rule and no measurement: nothing vouches for the feed
            reasons = [
                *reasons,
                f"{s.engine} {case.release} has no derived rule and its feed was not measured "
                f"({why}): nothing says what it feeds the draft",
            ]
        slots = check_slots(
            trained,
            predicted,
            fp.sketches,
            replayed,
            n,
            cfg.tolerances,
            predicted=predicted,
            alternatives=case.alternatives,
        )
        return served, slots, Feed(not_measured=why), reasons

    servable = (
        s.replay == "engine"
        and not wrong_release
        and (reading is None or (not reading.error and len(reading.points) == len(trained)))
    )
    if s.replay != "engine":
        return by_rule(None, None, [])
    if not servable:
        return by_rule(
            None,
            "not served: "
            + (
                "another engine release is installed"
                if wrong_release
                else "the engine cannot feed this draft's slots as configured"
            ),
            [],
        )
    if cfg.acceptance_prompts == 0:
        return by_rule(None, "acceptance_prompts = 0: the draft was not served", [])
    try:
        served = acceptance.serve_as_configured(engine, cfg, case.art, case.draft_cfg_path, acceptance.prompts(cfg, fp))
    except EngineError as e:  # the engine refused the draft as configured: that is the finding (a bug is not)
        reason = f"{s.engine} failed to serve the draft as configured: {type(e).__name__}: {str(e)[:300]}"
        return by_rule(None, reason, [reason])
    if served.feed is None:  # an engine whose draft inputs cannot be observed: its rule decides
        return by_rule(served, "the engine's feed is not observable", [])
    measured, unmatched, feed, reasons = _measured_feed(cfg, fp, engine, served, replayed, trained, n)
    feed.disagreements = checks.feed_vs_rule(measured, reading.points, reading.rule, n) if reading else []
    for line in feed.disagreements:
        log.warning("%s", line)
    slots = check_slots(
        trained,
        measured,
        fp.sketches,
        replayed,
        n,
        cfg.tolerances,
        fed_by="measured",
        predicted=predicted,
        unmatched=unmatched,
        alternatives=case.alternatives,
    )
    return served, slots, feed, reasons


def _measured_feed(
    cfg: ValidateConfig,
    fp: Fingerprints,
    engine: TargetEngine,
    served: ServeResult,
    replayed: dict,
    trained: list[CapturePoint],
    n: int,
) -> tuple[list[CapturePoint | None], list[str], Feed, list[str]]:
    """Per slot, the boundary the engine fed (None: none matched), the unmatched slots described, the
    report's feed section and the reasons to block it gives."""
    import torch

    # Every residual boundary the engine captures (engines never feed post-norm states).
    keys = [str(p) for p in engine.points if conventions.boundary(p, n) is not None]
    offsets = [sum(fp.lengths[:i]) for i in range(len(fp.lengths))]
    ps = acceptance.prompts(cfg, fp)
    seqs = [p + out for p, out in zip(ps, served.outputs, strict=True)]
    proj = projection(engine.hidden_size, fp.dim, fp.seed)
    final = engine.capture_tensors(seqs)
    per_request, training = [], []
    for i, (p, calls) in enumerate(zip(ps, served.feed, strict=True)):
        o, length = offsets[i], fp.lengths[i]
        rows = F.valid_rows(calls, seqs[i], len(p))
        prompt_refs = {k: replayed[k][o : o + length] for k in keys}
        seq_refs = {k: sketch(final[k][i].float(), proj)[0] for k in keys}
        per_request.append((rows, prompt_refs, seq_refs))
        training.append(torch.stack([fp.sketches[str(t)][o : o + length] for t in trained]))
    m = F.measure(per_request, training, len(trained), proj, cfg.tolerances)

    def lab(key: str) -> str:
        return label(CapturePoint.parse(key), n)

    fed = [CapturePoint.parse(x.best) if x.best else None for x in m.prefill]
    unmatched = [x.describe(lab) for x in m.prefill]
    reasons, deviations = [], []
    for slot, (pre, ver) in enumerate(zip(m.prefill, m.verify or m.prefill, strict=True)):
        if m.verify is None or ver.best == pre.best:
            continue
        if ver.best is None and pre.best is not None and ver.closest == pre.best:
            # The layer is the prefill's (its nearest boundary), but its values are off: the engine
            # computes verify-step states differently, e.g. with attention missing context. Reported;
            # what it costs is the acceptance check's to judge.
            deviations.append(
                f"slot {slot}: on verify steps {lab(pre.best)} again, but only within rel L2 "
                f"{ver.errors[ver.closest]:.3f} (prefill {pre.errors[pre.best]:.4f}; tolerance "
                f"{cfg.tolerances.match_rel_l2}): the engine computes the verify-step states "
                "differently from a prefill of the same tokens"
            )
            continue
        reasons.append(
            f"slot {slot} is fed {pre.describe(lab)} on prefill but {ver.describe(lab)} on verify "
            "steps: the engine feeds the draft different layers while decoding"
        )
    for line in deviations:
        log.warning("%s", line)
    section = Feed(
        measured_with=f"{engine.name} {engine.version}: what its draft's fc received",
        recorded_rows={"prefill": m.prefill[0].rows, "verify": m.verify[0].rows if m.verify else 0},
        prefill=[x.describe(lab) for x in m.prefill],
        verify=[x.describe(lab) for x in m.verify] if m.verify else "no verify-step rows recorded",
        vs_training_rel_l2=m.vs_training,
        verify_deviations=deviations,
        slots=[
            SlotFeed(
                prefill=x.best,
                verify=m.verify[i].best if m.verify else None,
                prefill_errors=x.errors,
                verify_errors=m.verify[i].errors if m.verify else None,
            )
            for i, x in enumerate(m.prefill)
        ],
    )
    return fed, unmatched, section, reasons


def measure_acceptance(
    cfg: ValidateConfig,
    manifest: DraftArtifactManifest,
    art: Path,
    fp: Fingerprints,
    fed: list,
    trained: list,
    served: ServeResult | None,
    blocked: bool,
) -> AcceptanceSection:
    if cfg.acceptance_prompts == 0:
        return AcceptanceSection(skipped="acceptance_prompts = 0")
    if any(f is None for f in fed) or len(fed) != len(trained):
        return AcceptanceSection(skipped="the engine would not feed the draft's slots")
    if cfg.serving.replay == "engine" and served is None:
        return AcceptanceSection(
            skipped=f"not served through {cfg.serving.engine}: the rule or release check already blocks it"
        )
    ps = acceptance.prompts(cfg, fp)
    held = manifest.metrics.get("heldout_acceptance")
    return AcceptanceSection(
        served=served.acceptance if served is not None else None,
        reference=acceptance.reference(cfg, art, ps, fed),
        note="measured for the report only: this configuration is blocked" if blocked and served is not None else None,
        predicted_accepted_per_step=acceptance.predicted_accepted_per_step(manifest, cfg.speculative_tokens),
        heldout_at_training=HeldoutAcceptance.model_validate(held) if held and "skipped" not in held else None,
    )
