"""The validation job: replay the probe samples the way the serving engine will run them,
compare what it would feed the draft with the training fingerprints, check identities,
measure acceptance, and decide pass/block -- with a report a person can act on.

Replay and acceptance run through the serving engine itself (``serving.replay: engine``) or
through HF transformers where that engine cannot run (``replay: hf``); what the engine
feeds each slot always follows its id-reading rules in ``pipeline.conventions``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from pathlib import Path

from pipeline import conventions
from pipeline.engines import installed_version, same_release
from pipeline.engines.errors import EngineUnavailable
from pipeline.fingerprint import Fingerprints
from pipeline.identity import target_identity
from pipeline.validate.gate import check_slots, fix_hint, label
from pipeline.validate.replay import replay
from schemas.artifact import ARTIFACT_FINGERPRINTS, ARTIFACT_MANIFEST, DraftArtifactManifest
from schemas.registry import ServingConfig
from schemas.validation import Check, ValidateConfig, ValidationReport

log = logging.getLogger(__name__)


class ValidationInputError(ValueError):
    """The artifact or serving spec cannot be validated (exit code 2)."""


def serving_config(cfg: ValidateConfig, draft_cfg_bytes: bytes, target_key: str, family: str) -> ServingConfig:
    s = cfg.serving
    return ServingConfig(engine=s.engine, engine_version=s.engine_version,
                         engine_family=family if s.engine == "sglang" else None, dtype=s.dtype, tp_size=s.tp_size,
                         draft_config_sha256=hashlib.sha256(draft_cfg_bytes).hexdigest(), target_key=target_key)


def serving_for_channel(validate_config_path: str) -> ServingConfig:
    """The serving configuration a channel deploys with, from a validation config."""
    from schemas.config import load_config

    cfg = load_config(validate_config_path, ValidateConfig)
    art = Path(cfg.artifact)
    draft_cfg_path = Path(cfg.serving.draft_config) if cfg.serving.draft_config else art / "config.json"
    ident = target_identity(cfg.serving.target.path, cfg.serving.target.name, cfg.serving.target.revision)
    family = cfg.serving.engine_family
    if family == "auto":
        tcfg = json.loads((Path(cfg.serving.target.path) / "config.json").read_text())
        family = conventions.sglang_family(tcfg.get("model_type", "llama"))
    return serving_config(cfg, draft_cfg_path.read_bytes(), ident.key, family)


def run_validate(cfg: ValidateConfig) -> ValidationReport:
    art = Path(cfg.artifact)
    if not (art / ARTIFACT_MANIFEST).exists():
        raise ValidationInputError(f"{art}: no {ARTIFACT_MANIFEST}; expected a draft exported by `strata export`")
    manifest = DraftArtifactManifest.model_validate_json((art / ARTIFACT_MANIFEST).read_text())
    if not manifest.fingerprints or not (art / ARTIFACT_FINGERPRINTS).exists():
        raise ValidationInputError(f"{art}: the artifact carries no training fingerprints; re-export it from a dataset "
                                   "extracted with fingerprint.probe_samples > 0")
    draft_cfg_path = Path(cfg.serving.draft_config) if cfg.serving.draft_config else art / "config.json"
    draft_cfg_bytes = draft_cfg_path.read_bytes()
    draft_cfg = json.loads(draft_cfg_bytes)
    serving_id = target_identity(cfg.serving.target.path, cfg.serving.target.name, cfg.serving.target.revision)
    tcfg = json.loads((Path(cfg.serving.target.path) / "config.json").read_text())
    family = cfg.serving.engine_family
    if family == "auto":
        family = conventions.sglang_family(tcfg.get("model_type", "llama"))
    n = serving_id.num_layers
    reasons: list[str] = []

    # 1. Identity: is this the target the draft was trained against?
    identity = []
    for field, what in (("weights_sha256", "weights"), ("config_sha256", "config"), ("tokenizer_sha256", "tokenizer"),
                        ("chat_template_sha256", "chat template")):
        a, b = getattr(manifest.target, field), getattr(serving_id, field)
        ok = a == b
        identity.append(Check(name=what, ok=ok, message=f"{what}: {'same' if ok else f'training {str(a)[:12]} vs serving {str(b)[:12]}'}"))
        if not ok:
            reasons.append(f"serving target's {what} differ from the training target's ({str(a)[:12]} vs {str(b)[:12]})")

    # 2. What the engine will feed the draft, by its own reading rules.
    ids, key = conventions.ids_in_draft_config(draft_cfg, cfg.serving.engine, cfg.serving.vllm_reads_nested)
    try:
        fed = conventions.points_read_from(ids, cfg.serving.engine, n, family)  # type: ignore[arg-type]
        read_error = None
    except conventions.ConventionError as e:
        fed, read_error = [], str(e)
        reasons.append(f"{cfg.serving.engine} cannot capture what {draft_cfg_path.name} asks for: {e}")
    trained = list(manifest.aux_capture_points)
    engine_reads = {"key": key, "ids": ids, "points": [str(p) for p in fed], "labels": [label(p, n) for p in fed],
                    "error": read_error}
    if ids is None:
        reasons.append(f"{cfg.serving.engine} finds no aux layer ids in {draft_cfg_path.name} and silently uses its "
                       f"default {[label(p, n) for p in fed]}")
    if len(fed) != len(trained) and not read_error:
        reasons.append(f"{cfg.serving.engine} would feed {len(fed)} aux states, the draft was trained on {len(trained)}")

    # 3. Replay the probe samples through the serving target, in the serving dtype.
    fp = Fingerprints.load(str(art), name=ARTIFACT_FINGERPRINTS)
    try:
        replayed = replay(cfg, fp, n)
    except EngineUnavailable as e:
        raise ValidationInputError(f"replay through {cfg.serving.engine} is not possible here: {e}; set "
                                   "serving.replay: hf to replay through HF transformers with its reading rules") from None
    wrong_release = False
    if cfg.serving.replay == "engine":
        # Reading rules and acceptance are properties of one engine release: a verdict measured
        # on another release than the one the serving spec names would vouch for the wrong engine.
        got = installed_version(cfg.serving.engine)
        engine_reads["replayed_with"] = f"{cfg.serving.engine} {got}"
        if got is not None and not same_release(got, cfg.serving.engine_version):
            wrong_release = True
            reasons.append(f"replayed through {cfg.serving.engine} {got}, but serving.engine_version is "
                           f"{cfg.serving.engine_version}: validate where {cfg.serving.engine} "
                           f"{cfg.serving.engine_version} is installed, or set serving.engine_version to {got}")
    slots = check_slots(trained, fed, fp.sketches, replayed, n, cfg.tolerances)
    bad = [s for s in slots if not s.ok]
    for s in bad:
        reasons.append(s.message)
    if bad:
        if ids is not None:
            reasons.append(f"{cfg.serving.engine} reads ids {ids} from {key} of {draft_cfg_path.name}")
        reasons.append(fix_hint(trained, cfg.serving.engine, n, family))

    # 4. Acceptance, served as configured, next to the reference implementation's.
    accept = measure_acceptance(cfg, manifest, art, draft_cfg_path, fp, fed, trained, blocked=bool(bad) or wrong_release)
    if "mean_acceptance_length" in accept:
        if accept["mean_acceptance_length"] < cfg.tolerances.acceptance_floor:
            reasons.append(f"mean acceptance length {accept['mean_acceptance_length']:.2f} < floor {cfg.tolerances.acceptance_floor}")
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

    sc = serving_config(cfg, draft_cfg_bytes, serving_id.key, family)
    matched = [s.errors[s.best] for s in slots]
    report = ValidationReport(
        decision="block" if reasons else "pass", reasons=reasons, artifact_digest=manifest.content_digest,
        serving_key=sc.key, serving=sc.model_dump(mode="json") | {"attn_implementation": cfg.serving.attn_implementation},
        engine_reads=engine_reads, slots=slots, identity=identity, acceptance=accept,
        tolerances=cfg.tolerances.model_dump(),
        calibration={"matched_rel_l2": matched, "nearest_other_rel_l2": [
            sorted(v for k, v in s.errors.items() if k != s.best)[0] for s in slots],
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


def measure_acceptance(cfg: ValidateConfig, manifest: DraftArtifactManifest, art: Path, draft_cfg_path: Path,
                       fp: Fingerprints, fed: list, trained: list, blocked: bool) -> dict:
    from pipeline.validate import acceptance

    if cfg.acceptance_prompts == 0:
        return {"skipped": "acceptance_prompts = 0"}
    if not fed or len(fed) != len(trained):
        return {"skipped": "the engine would not feed the draft's slots"}
    if blocked and cfg.serving.replay == "engine":
        return {"skipped": f"not served through {cfg.serving.engine}: the slot or release check already blocks it"}
    ps = acceptance.prompts(cfg, fp)
    ref = acceptance.reference(cfg, art, ps, fed)
    if cfg.serving.replay == "engine":
        served = getattr(acceptance, cfg.serving.engine)(cfg, art, draft_cfg_path, ps)
        out = {**served, "reference": ref}
    else:
        out = ref
    return {**out, "predicted_accepted_per_step": acceptance.predicted_accepted_per_step(manifest, cfg.speculative_tokens)}


def record(cfg: ValidateConfig, report: ValidationReport, sc: ServingConfig, art: Path) -> None:
    import os

    from pipeline.registry.registry import Registry
    from pipeline.registry.store import open_store
    from schemas.registry import ValidationRecord

    reg = Registry(open_store(cfg.registry, os.environ.get("AWS_ENDPOINT_URL")))
    reg.add_artifact(art)
    reg.add_record(ValidationRecord(record_id=uuid.uuid4().hex[:12], artifact_digest=report.artifact_digest, serving=sc,
                                    decision=report.decision, reasons=report.reasons, report_uri=report.report_dir))
