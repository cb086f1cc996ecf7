"""The validation job: replay the probe samples the way the serving engine will run them,
serve the draft exactly as configured, measure which tensors really arrive at the draft's
input, compare them with the training fingerprints, check identities and acceptance, and
decide pass/block -- with a report a person can act on.

With ``serving.replay: engine`` the slot table follows the *measured* feed (vLLM here and
in CI; SGLang on GPU clusters reports its rule). The versioned rule table
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
from pathlib import Path

from pipeline import conventions
from pipeline.engines.errors import EngineUnavailable
from pipeline.fingerprint import Fingerprints, projection
from pipeline.identity import target_identity
from pipeline.validate import checks
from pipeline.validate.gate import check_slots, fix_hint, label
from pipeline.validate.replay import replay
from schemas.artifact import ARTIFACT_FINGERPRINTS, ARTIFACT_MANIFEST, DraftArtifactManifest
from schemas.capture import CapturePoint
from schemas.registry import ServingConfig
from schemas.validation import ValidateConfig, ValidationReport

log = logging.getLogger(__name__)


class ValidationInputError(ValueError):
    """The artifact or serving spec cannot be validated (exit code 2)."""


def _family(cfg: ValidateConfig, tcfg: dict) -> str:
    if cfg.serving.engine_family != "auto":
        return cfg.serving.engine_family
    try:
        return conventions.engine_family(cfg.serving.engine, tcfg)
    except conventions.ConventionError as e:
        raise ValidationInputError(str(e)) from None


def serving_config(cfg: ValidateConfig, draft_cfg_bytes: bytes, target_key: str, family: str,
                   release: str | None = None) -> ServingConfig:
    s = cfg.serving
    return ServingConfig(engine=s.engine, engine_version=release or checks.serving_release(s),
                         engine_family=family if s.engine == "sglang" else None, dtype=s.dtype, tp_size=s.tp_size,
                         vllm_runner=s.vllm_runner if s.engine == "vllm" and s.vllm_runner != "auto" else None,
                         draft_config_sha256=hashlib.sha256(draft_cfg_bytes).hexdigest(), target_key=target_key)


def serving_for_channel(validate_config_path: str) -> ServingConfig:
    """The serving configuration a channel deploys with, from a validation config."""
    from schemas.config import load_config

    cfg = load_config(validate_config_path, ValidateConfig)
    art = Path(cfg.artifact)
    draft_cfg_path = Path(cfg.serving.draft_config) if cfg.serving.draft_config else art / "config.json"
    ident = target_identity(cfg.serving.target.path, cfg.serving.target.name, cfg.serving.target.revision)
    tcfg = json.loads((Path(cfg.serving.target.path) / "config.json").read_text())
    return serving_config(cfg, draft_cfg_path.read_bytes(), ident.key, _family(cfg, tcfg))


def _load_artifact(art: Path) -> tuple[DraftArtifactManifest, Fingerprints]:
    if not (art / ARTIFACT_MANIFEST).exists():
        raise ValidationInputError(f"{art}: no {ARTIFACT_MANIFEST}; expected a draft exported by `strata export`")
    manifest = DraftArtifactManifest.model_validate_json((art / ARTIFACT_MANIFEST).read_text())
    if not manifest.fingerprints or not (art / ARTIFACT_FINGERPRINTS).exists():
        raise ValidationInputError(f"{art}: the artifact carries no training fingerprints; re-export it from a dataset "
                                   "extracted with fingerprint.probe_samples > 0")
    return manifest, Fingerprints.load(str(art), name=ARTIFACT_FINGERPRINTS)


def run_validate(cfg: ValidateConfig) -> ValidationReport:
    s = cfg.serving
    art = Path(cfg.artifact)
    manifest, fp = _load_artifact(art)
    draft_cfg_path = Path(s.draft_config) if s.draft_config else art / "config.json"
    draft_cfg_bytes = draft_cfg_path.read_bytes()
    draft_cfg = json.loads(draft_cfg_bytes)
    serving_id = target_identity(s.target.path, s.target.name, s.target.revision)
    family = _family(cfg, json.loads((Path(s.target.path) / "config.json").read_text()))
    n = serving_id.num_layers
    trained = list(manifest.aux_capture_points)
    reasons: list[str] = []

    identity, res = checks.identity(manifest.target, serving_id)
    reasons += res.reasons
    release = checks.serving_release(s)
    try:
        readings = checks.rule_readings(s, release, family, draft_cfg, n)
    except conventions.ConventionError as e:
        raise ValidationInputError(str(e)) from None
    reasons += checks.reading_rule(readings, trained, s.engine, draft_cfg_path.name, n).reasons
    reading = readings[0]
    engine_reads = {**reading.as_dict(n), "release": release,
                    "other_runners": [r.as_dict(n) for r in readings[1:]]}

    try:
        replayed = replay(cfg, fp, n)
    except EngineUnavailable as e:
        raise ValidationInputError(f"replay through {s.engine} is not possible here: {e}; set "
                                   "serving.replay: hf to replay through HF transformers with its reading rules") from None
    got, res = checks.installed_release(s, release)
    if got is not None:
        engine_reads["replayed_with"] = f"{s.engine} {got}"
    reasons += res.reasons
    wrong_release = bool(res.reasons)

    # Serve the draft as configured and measure what reaches its fc (where the engine can run it).
    servable = (s.replay == "engine" and not wrong_release and not reading.error
                and len(reading.points) == len(trained))
    served, feed = None, {}
    if servable and cfg.acceptance_prompts > 0:
        try:
            served = _serve(cfg, art, draft_cfg_path, fp)
        except Exception as e:  # the engine refused the draft as configured: that is the finding
            reasons.append(f"{s.engine} failed to serve the draft as configured: {type(e).__name__}: {str(e)[:300]}")
            feed = {"not_measured": "the engine failed to start or serve the draft"}
    if served is not None and served.feed_calls is not None:
        measured, unmatched, feed = _measured_feed(cfg, fp, served, replayed, trained, n)
        feed["disagreements"] = checks.feed_vs_rule(measured, reading.points, reading.rule, n)
        for line in feed["disagreements"]:
            log.warning("%s", line)
        reasons += feed.pop("reasons")
        slots = check_slots(trained, measured, fp.sketches, replayed, n, cfg.tolerances, fed_by="measured",
                            predicted=reading.points, unmatched=unmatched)
    else:
        if feed:
            pass
        elif s.replay == "engine" and servable:
            feed = {"not_measured": "acceptance_prompts = 0: the draft was not served"}
        elif s.replay == "engine":
            feed = {"not_measured": "not served: " + ("another engine release is installed" if wrong_release else
                                                     "the engine cannot feed this draft's slots as configured")}
        slots = check_slots(trained, reading.points, fp.sketches, replayed, n, cfg.tolerances,
                            predicted=reading.points)
    bad = [x for x in slots if not x.ok]
    reasons += [x.message for x in bad]
    if bad:
        if reading.ids is not None:
            reasons.append(f"{reading.rule.name} reads ids {reading.ids} from {reading.key} of {draft_cfg_path.name}")
        reasons.append(fix_hint(trained, s.engine, n, family, release, reading.rule.runner))

    fed = [x.fed for x in slots]
    accept = measure_acceptance(cfg, manifest, art, fp, fed, trained, served,
                                blocked=bool(bad) or wrong_release or not servable)
    reasons += _acceptance_reasons(cfg, accept)

    sc = serving_config(cfg, draft_cfg_bytes, serving_id.key, family, release)
    report = ValidationReport(
        decision="block" if reasons else "pass", reasons=reasons, artifact_digest=manifest.content_digest,
        serving_key=sc.key, serving=sc.model_dump(mode="json") | {"attn_implementation": s.attn_implementation},
        engine_reads=engine_reads, feed=feed, slots=slots, identity=identity, acceptance=accept,
        tolerances=cfg.tolerances.model_dump(),
        calibration={"matched_rel_l2": [x.errors[x.best] for x in slots], "nearest_other_rel_l2": [
            sorted(v for k, v in x.errors.items() if k != x.best)[0] for x in slots],
            "note": "measured: fp32 replay of fp32 data ~1e-6; bf16 vs fp32 ~0.2-1%; eager vs sdpa ~1e-6 (fp32); "
                    "adjacent boundaries 28-96% on the tiny target"},
    )
    if cfg.report_dir:
        from pipeline.validate.report import write_report

        report.report_dir = cfg.report_dir
        write_report(report, n, Path(cfg.report_dir))
    if cfg.registry:
        record(cfg, report, sc, art)
    return report


def _serve(cfg: ValidateConfig, art: Path, draft_cfg_path: Path, fp: Fingerprints):
    from pipeline.validate import acceptance

    return getattr(acceptance, cfg.serving.engine)(cfg, art, draft_cfg_path, acceptance.prompts(cfg, fp))


def _measured_feed(cfg: ValidateConfig, fp: Fingerprints, served, replayed: dict, trained: list[CapturePoint],
                   n: int) -> tuple[list[CapturePoint | None], list[str], dict]:
    """Per slot, the boundary the engine fed (None: none matched), and the report's feed section."""
    import torch

    from pipeline.engines import vllm_engine
    from pipeline.fingerprint import sketch
    from pipeline.validate import feed as F
    from pipeline.validate.acceptance import prompts

    s = cfg.serving
    keys = [str(b) for b in conventions.all_boundaries(n)[:-1]]  # r_0..r_N: what an engine can feed
    offsets = [sum(fp.lengths[:i]) for i in range(len(fp.lengths))]
    ps = prompts(cfg, fp)
    seqs = [p + out for p, out in zip(ps, served.outputs, strict=True)]
    capture = vllm_engine.shared("capture", s.target.path, [CapturePoint.parse(k) for k in keys], dtype=s.dtype,
                                 tp_size=s.tp_size, max_model_len=s.max_model_len)
    hidden = capture.hidden_size
    proj = projection(hidden, fp.dim, fp.seed)
    final = capture.capture_tensors(seqs)
    per_request, training = [], []
    for i, (p, calls) in enumerate(zip(ps, served.feed_calls, strict=True)):
        o, length = offsets[i], fp.lengths[i]
        rows = F.valid_rows(calls, seqs[i], len(p))
        prompt_refs = {k: replayed[k][o:o + length] for k in keys}
        seq_refs = {k: sketch(final[k][i].float(), proj)[0] for k in keys}
        per_request.append((rows, prompt_refs, seq_refs))
        training.append(torch.stack([fp.sketches[str(t)][o:o + length] for t in trained]))
    m = F.measure(per_request, training, len(trained), proj, cfg.tolerances)

    def lab(key: str) -> str:
        return label(CapturePoint.parse(key), n)

    fed = [CapturePoint.parse(x.best) if x.best else None for x in m.prefill]
    unmatched = [x.describe(lab) for x in m.prefill]
    reasons = []
    for slot, (pre, ver) in enumerate(zip(m.prefill, m.verify or m.prefill, strict=True)):
        if m.verify is not None and ver.best != pre.best:
            reasons.append(f"slot {slot} is fed {pre.describe(lab)} on prefill but {ver.describe(lab)} on verify "
                           "steps: the engine feeds the draft different layers while decoding")
    section = {"measured_with": served.acceptance.get("measured_by"), "reasons": reasons,
               "prefill": [x.describe(lab) for x in m.prefill],
               "verify": [x.describe(lab) for x in m.verify] if m.verify else "no verify rows (no draft accepted)",
               "vs_training_rel_l2": m.vs_training,
               "slots": [{"prefill": x.best, "verify": (m.verify[i].best if m.verify else None),
                          "prefill_errors": x.errors, "verify_errors": (m.verify[i].errors if m.verify else None)}
                         for i, x in enumerate(m.prefill)]}
    return fed, unmatched, section


def measure_acceptance(cfg: ValidateConfig, manifest: DraftArtifactManifest, art: Path, fp: Fingerprints,
                       fed: list, trained: list, served, blocked: bool) -> dict:
    from pipeline.validate import acceptance

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
    return {**out, "predicted_accepted_per_step": acceptance.predicted_accepted_per_step(manifest, cfg.speculative_tokens)}


def _acceptance_reasons(cfg: ValidateConfig, accept: dict) -> list[str]:
    reasons = []
    if "mean_acceptance_length" not in accept:
        return reasons
    if accept["mean_acceptance_length"] < cfg.tolerances.acceptance_floor:
        reasons.append(f"mean acceptance length {accept['mean_acceptance_length']:.2f} < floor "
                       f"{cfg.tolerances.acceptance_floor}")
    pred = accept.get("predicted_accepted_per_step")
    if pred and accept["accepted_per_step"] < cfg.tolerances.acceptance_vs_predicted * pred:
        reasons.append(f"accepted tokens per step {accept['accepted_per_step']:.2f} is far below the "
                       f"{pred:.2f} training accuracy predicts")
    if not accept["lossless"] and cfg.serving.dtype == "float32":
        reasons.append(f"speculative decoding ({accept['measured_by']}) changed the greedy output: not lossless")
    elif not accept["lossless"]:
        # Verifying k+1 tokens in one forward rounds differently from one token at a time
        # in 16-bit types, which can flip near-tied argmaxes: reported, not gated.
        accept["lossless_note"] = (f"output differs from target-only greedy decoding in {cfg.serving.dtype}; "
                                   "16-bit verification can flip near-ties; gated at float32 only")
    return reasons


def record(cfg: ValidateConfig, report: ValidationReport, sc: ServingConfig, art: Path) -> None:
    import os

    from pipeline.registry.registry import Registry
    from pipeline.registry.store import open_store
    from schemas.registry import ValidationRecord

    reg = Registry(open_store(cfg.registry, os.environ.get("AWS_ENDPOINT_URL")))
    reg.add_artifact(art)
    reg.add_record(ValidationRecord(record_id=uuid.uuid4().hex[:12], artifact_digest=report.artifact_digest, serving=sc,
                                    decision=report.decision, reasons=report.reasons, report_uri=report.report_dir))
