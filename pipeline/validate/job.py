"""The validation job: replay the probe samples the way the serving engine will run them,
serve the draft exactly as configured, measure which tensors really arrive at the draft's
input, compare them with the training fingerprints, check identities and acceptance, and
decide pass/block -- with a report a person can act on.

With ``serving.replay: engine`` the slot table follows the *measured* feed (vLLM here and
in CI, and SGLang 0.5.18 from its own environment). The versioned rule table
(``pipeline.conventions.releases``) is shown beside it; a disagreement is reported as a
table bug, never silently resolved. Where the engine cannot run (``replay: hf``), the rule
for ``serving.engine_version`` decides, and a release without a known rule is refused.
The checks live in ``checks.py``; this module only orders them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from dataclasses import dataclass
from pathlib import Path

from pipeline import conventions
from pipeline.engines.base import ServeResult, TargetEngine
from pipeline.engines.errors import EngineError, EngineUnavailable
from pipeline.errors import UnusableInput
from pipeline.fingerprint import Fingerprints, projection, sketch
from pipeline.identity import stop_token_ids, target_config, target_identity
from pipeline.registry.registry import Registry
from pipeline.store.objects import open_store
from pipeline.validate import acceptance, checks
from pipeline.validate import feed as F
from pipeline.validate.cost import cost_table
from pipeline.validate.gate import check_slots, fix_hint, label
from pipeline.validate.replay import open_replay_engine, replay
from pipeline.validate.report import write_report
from schemas.artifact import (
    ARTIFACT_FINGERPRINTS,
    ARTIFACT_MANIFEST,
    DraftArtifactManifest,
    content_digest,
)
from schemas.capture import CapturePoint
from schemas.config import load_config
from schemas.identity import TargetIdentity
from schemas.registry import Deployment, ValidationRecord
from schemas.validation import SlotCheck, ValidateConfig, ValidationReport

log = logging.getLogger(__name__)


class ValidationInputError(UnusableInput):
    """The artifact or serving spec cannot be validated (exit code 2)."""


def _family(cfg: ValidateConfig, tcfg: dict) -> str:
    """The architecture whose rule applies; UnknownRelease when the table has none (measured or refused)."""
    try:
        return conventions.engine_family(cfg.serving.engine, tcfg, cfg.serving.engine_family)
    except conventions.UnknownRelease:
        raise
    except conventions.ConventionError as e:
        raise ValidationInputError(str(e)) from None


def deployment(
    cfg: ValidateConfig, draft_cfg_bytes: bytes, target_key: str, family: str, release: str | None = None
) -> Deployment:
    """The pinned deployment a validation config describes (what its record is valid for)."""
    s = cfg.serving
    return Deployment(
        engine=s.engine,
        engine_version=release or checks.serving_release(s),
        engine_family=family if s.engine == "sglang" else None,
        dtype=s.dtype,
        tp_size=s.tp_size,
        vllm_runner=s.vllm_runner if s.engine == "vllm" and s.vllm_runner != "auto" else None,
        draft_config_sha256=hashlib.sha256(draft_cfg_bytes).hexdigest(),
        target_key=target_key,
    )


def serving_for_channel(validate_config_path: str) -> Deployment:
    """The serving configuration a channel deploys with, from a validation config."""
    cfg = load_config(validate_config_path, ValidateConfig)
    art = Path(cfg.artifact)
    draft_cfg_path = Path(cfg.serving.draft_config) if cfg.serving.draft_config else art / "config.json"
    ident = target_identity(cfg.serving.target.path, cfg.serving.target.name, cfg.serving.target.revision)
    family = _family(cfg, target_config(cfg.serving.target.path))
    return deployment(cfg, draft_cfg_path.read_bytes(), ident.key, family)


def _load_artifact(art: Path) -> tuple[DraftArtifactManifest, Fingerprints]:
    if not (art / ARTIFACT_MANIFEST).exists():
        raise ValidationInputError(f"{art}: no {ARTIFACT_MANIFEST}; expected a draft exported by `strata export`")
    manifest = DraftArtifactManifest.model_validate_json((art / ARTIFACT_MANIFEST).read_text())
    if not manifest.fingerprints or not (art / ARTIFACT_FINGERPRINTS).exists():
        raise ValidationInputError(
            f"{art}: the artifact carries no training fingerprints; re-export it from a dataset "
            "extracted with fingerprint.probe_samples > 0"
        )
    # Every file is checked against the manifest before it is used: a flipped byte in the
    # fingerprints would otherwise become a wrong diagnosis, in the weights a wrong verdict.
    if (got := content_digest(art)) != manifest.content_digest:
        raise ValidationInputError(
            f"{art}: weights + config.json hash to {got[:16]}, the manifest says "
            f"{manifest.content_digest[:16]}: the artifact was modified; re-export or re-fetch it"
        )
    fp_sha = hashlib.sha256((art / ARTIFACT_FINGERPRINTS).read_bytes()).hexdigest()
    if fp_sha != manifest.fingerprints.get("sha256"):
        raise ValidationInputError(
            f"{art / ARTIFACT_FINGERPRINTS}: sha256 {fp_sha[:16]} does not match the manifest's "
            f"{str(manifest.fingerprints.get('sha256'))[:16]}: the fingerprints were modified"
        )
    return manifest, Fingerprints.load(str(art), name=ARTIFACT_FINGERPRINTS)


@dataclass
class Case:
    """One validation's resolved inputs: the artifact, the config the engine reads, the serving
    target and the reading rules of the serving release."""

    cfg: ValidateConfig
    art: Path
    manifest: DraftArtifactManifest
    fp: Fingerprints
    draft_cfg_path: Path
    draft_cfg_bytes: bytes
    serving_id: TargetIdentity
    family: str
    release: str
    readings: list[checks.Reading]  # empty: no derived rule, the measurement alone decides
    no_rule: str | None = None  # why there is no rule (then the engine must run here)

    @property
    def reading(self) -> checks.Reading | None:
        return self.readings[0] if self.readings else None

    @property
    def n(self) -> int:
        return self.serving_id.num_layers

    @property
    def trained(self) -> list[CapturePoint]:
        return list(self.manifest.aux_capture_points)


def load_case(cfg: ValidateConfig) -> Case:
    """Everything validation needs before any engine starts; ValidationInputError when unusable."""
    s = cfg.serving
    art = Path(cfg.artifact)
    if art.is_dir() and not (art / ARTIFACT_MANIFEST).exists() and (art / "config.json").exists():
        if s.draft_config is None:  # the engine reads the draft's own config, not the adopted copy's path
            cfg = cfg.model_copy(update={"serving": s.model_copy(update={"draft_config": str(art / "config.json")})})
            s = cfg.serving
        from pipeline.validate.foreign import import_for_validation

        art = import_for_validation(cfg)
    manifest, fp = _load_artifact(art)
    draft_cfg_path = Path(s.draft_config) if s.draft_config else art / "config.json"
    draft_cfg_bytes = draft_cfg_path.read_bytes()
    serving_id = target_identity(s.target.path, s.target.name, s.target.revision)
    tcfg = target_config(s.target.path)
    release = checks.serving_release(s)
    no_rule = None
    try:
        family = (tcfg.get("architectures") or [s.engine_family])[0]  # named by the engine if no rule knows it
        family = _family(cfg, tcfg)
        readings = checks.rule_readings(
            s, release, family, json.loads(draft_cfg_bytes), serving_id.num_layers, conventions.is_moe(tcfg)
        )
    except conventions.UnknownRelease as e:
        if not checks.measurable(s, release):  # nothing to measure and no rule: refuse, never guess
            raise ValidationInputError(str(e)) from None
        readings, no_rule = [], str(e)
        log.warning(
            "no derived rule for %s %s (%s): the verdict follows the measured feed; python -m "
            "pipeline.conventions.derive --engine %s --release %s adds it",
            s.engine,
            release,
            family,
            s.engine,
            release,
        )
    except conventions.ConventionError as e:
        raise ValidationInputError(str(e)) from None
    return Case(cfg, art, manifest, fp, draft_cfg_path, draft_cfg_bytes, serving_id, family, release, readings, no_rule)


def run_validate(cfg: ValidateConfig, engine: TargetEngine | None = None) -> ValidationReport:
    """Validate ``cfg``; ``engine``: a replay engine already open for this serving target (from
    ``open_replay_engine``), reused and left open -- several validations, one engine start."""
    case = load_case(cfg)
    owned = False
    try:
        if engine is None:
            engine, owned = open_replay_engine(cfg, case.n)
    except EngineUnavailable as e:
        raise ValidationInputError(
            f"replay through {cfg.serving.engine} is not possible here: {e}; set "
            "serving.replay: hf to replay through HF transformers with its reading rules"
        ) from None
    try:
        report = decide(case, engine)
        if report.decision == "block":
            if cfg.cost:
                report.cost = blocked_cost(case, engine)
            engine.release_draft(case.art)  # a blocked configuration does not stay loaded
    finally:
        if owned:
            engine.close()
    if cfg.report_dir:
        report.report_dir = cfg.report_dir
        write_report(report, case.n, Path(cfg.report_dir))
    if cfg.registry:
        record(
            cfg, report, deployment(cfg, case.draft_cfg_bytes, case.serving_id.key, case.family, case.release), case.art
        )
    return report


def decide(case: Case, engine: TargetEngine) -> ValidationReport:
    """Run the checks in order -- identity, reading rule, replay, release, measured feed, slots,
    acceptance -- and collect every reason to block."""
    cfg, s, n, trained, fp, art = case.cfg, case.cfg.serving, case.n, case.trained, case.fp, case.art
    draft_cfg_path, release, reading = case.draft_cfg_path, case.release, case.reading
    identity, res = checks.identity(case.manifest.target, case.serving_id, case.manifest.provenance != "fingerprints")
    if reading is not None:
        reasons = res.reasons + checks.reading_rule(case.readings, trained, s.engine, draft_cfg_path.name, n).reasons
        engine_reads = {
            **reading.as_dict(n),
            "release": release,
            "other_runners": [r.as_dict(n) for r in case.readings[1:]],
        }
    else:
        reasons = res.reasons
        engine_reads = {
            "rule": None,
            "release": release,
            "no_rule": case.no_rule,
            "note": f"no derived rule for {s.engine} {release} ({case.family}): the verdict follows the "
            f"measured feed; python -m pipeline.conventions.derive --engine {s.engine} --release "
            f"{release} adds it",
        }
    replayed = replay(engine, fp, n, s.target.path)
    got, res = checks.installed_release(s, release)
    if got is not None:
        engine_reads["replayed_with"] = f"{s.engine} {got}"
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
    reasons += acceptance.reasons(cfg, accept)

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
            "margin": p.get("margin"),
            "margin_se": p.get("margin_se"),
            "summary": p.get("summary"),
            "source": p.get("source"),
        }
    return {"trained_points": "the training data's fingerprints", "dataset_id": m.dataset_id}


def blocked_cost(case: Case, engine: TargetEngine) -> dict | None:
    """The cost table for a blocked configuration, where the serving engine itself runs here
    (None when validation was not asked to run it: ``replay: hf`` or no acceptance prompts)."""
    cfg, s = case.cfg, case.cfg.serving
    if s.replay != "engine" or cfg.acceptance_prompts == 0:
        return None
    got, wrong = checks.installed_release(s, case.release)
    if wrong.reasons:
        return {"skipped": f"the installed {s.engine} {got} is not the serving release {case.release}"}
    reading = case.reading
    if reading is None:
        return {"skipped": f"no derived rule for {s.engine} {case.release}: the correct ids are not known"}
    return cost_table(
        engine,
        case.art,
        case.draft_cfg_path,
        case.trained,
        case.n,
        case.family,
        case.release,
        reading.rule.runner,
        acceptance.prompts(cfg, case.fp),
        cfg.max_new_tokens,
        cfg.speculative_tokens,
        stop_token_ids(s.target.path),
    )


def slot_table(
    case: Case, engine: TargetEngine, replayed: dict, wrong_release: bool
) -> tuple[ServeResult | None, list[SlotCheck], dict, list[str]]:
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
        slots = check_slots(trained, predicted, fp.sketches, replayed, n, cfg.tolerances, predicted=predicted)
        return served, slots, ({"not_measured": why} if why else {}), reasons

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
    measured, unmatched, feed = _measured_feed(cfg, fp, engine, served, replayed, trained, n)
    feed["disagreements"] = checks.feed_vs_rule(measured, reading.points, reading.rule, n) if reading else []
    for line in feed["disagreements"]:
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
    )
    return served, slots, feed, feed.pop("reasons")


def _measured_feed(
    cfg: ValidateConfig,
    fp: Fingerprints,
    engine: TargetEngine,
    served: ServeResult,
    replayed: dict,
    trained: list[CapturePoint],
    n: int,
) -> tuple[list[CapturePoint | None], list[str], dict]:
    """Per slot, the boundary the engine fed (None: none matched), and the report's feed section."""
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
    section = {
        "measured_with": f"{engine.name} {engine.version}: what its draft's fc received",
        "reasons": reasons,
        "recorded_rows": {"prefill": m.prefill[0].rows, "verify": m.verify[0].rows if m.verify else 0},
        "prefill": [x.describe(lab) for x in m.prefill],
        "verify": [x.describe(lab) for x in m.verify] if m.verify else "no verify-step rows recorded",
        "vs_training_rel_l2": m.vs_training,
        "verify_deviations": deviations,
        "slots": [
            {
                "prefill": x.best,
                "verify": (m.verify[i].best if m.verify else None),
                "prefill_errors": x.errors,
                "verify_errors": (m.verify[i].errors if m.verify else None),
            }
            for i, x in enumerate(m.prefill)
        ],
    }
    return fed, unmatched, section


def measure_acceptance(
    cfg: ValidateConfig,
    manifest: DraftArtifactManifest,
    art: Path,
    fp: Fingerprints,
    fed: list,
    trained: list,
    served: ServeResult | None,
    blocked: bool,
) -> dict:
    if cfg.acceptance_prompts == 0:
        return {"skipped": "acceptance_prompts = 0"}
    if any(f is None for f in fed) or len(fed) != len(trained):
        return {"skipped": "the engine would not feed the draft's slots"}
    if cfg.serving.replay == "engine" and served is None:
        return {"skipped": f"not served through {cfg.serving.engine}: the rule or release check already blocks it"}
    ps = acceptance.prompts(cfg, fp)
    ref = acceptance.reference(cfg, art, ps, fed)
    out = {**served.acceptance, "reference": ref} if served is not None else ref
    if blocked and served is not None:
        out["note"] = "measured for the report only: this configuration is blocked"
    return {
        **out,
        "predicted_accepted_per_step": acceptance.predicted_accepted_per_step(manifest, cfg.speculative_tokens),
        "heldout_at_training": manifest.metrics.get("heldout_acceptance"),
    }


def record(cfg: ValidateConfig, report: ValidationReport, sc: Deployment, art: Path) -> None:
    reg = Registry(open_store(cfg.registry, cfg.s3))
    reg.add_artifact(art)
    reg.add_record(
        ValidationRecord(
            record_id=uuid.uuid4().hex[:12],
            artifact_digest=report.artifact_digest,
            serving=sc,
            decision=report.decision,
            reasons=report.reasons,
            report_uri=report.report_dir,
        )
    )
