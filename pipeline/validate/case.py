"""One validation's inputs, resolved before any engine starts: the artifact (verified against
its manifest), the config the engine will read, the serving target and the reading rules of
the serving release -- or why there is no rule (then the engine must run here and measure)."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from pipeline import conventions
from pipeline.errors import UnusableInput
from pipeline.fingerprint import Fingerprints
from pipeline.identity import target_config, target_identity
from pipeline.validate import checks
from schemas.artifact import (
    ARTIFACT_FINGERPRINTS,
    ARTIFACT_MANIFEST,
    DraftArtifactManifest,
    content_digest,
)
from schemas.capture import CapturePoint
from schemas.identity import TargetIdentity
from schemas.registry import Deployment
from schemas.validation import ValidateConfig

log = logging.getLogger(__name__)


class ValidationInputError(UnusableInput):
    """The artifact or serving spec cannot be validated (exit code 2)."""


def serving_family(cfg: ValidateConfig, tcfg: dict) -> str:
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

    @property
    def alternatives(self) -> list[list[CapturePoint]]:
        """Per slot, the other points an imported draft may have been trained on ([]: none)."""
        return [list(a) for a in self.manifest.aux_alternatives]


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
        family = serving_family(cfg, tcfg)
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
