"""Drafts trained elsewhere through the gate: no fingerprints, so the trained points come from
``strata probe`` (recorded as *inferred*, with the margin), then the measured feed, acceptance and
the verdict as for any draft."""

from __future__ import annotations

import atexit
import logging
import shutil
import tempfile
from pathlib import Path

from pipeline.probe.adopt import adopt
from pipeline.probe.job import Probe, run_probe
from schemas.artifact import ARTIFACT_MANIFEST
from schemas.probe import ProbeConfig
from schemas.validation import ValidateConfig

log = logging.getLogger(__name__)


def import_for_validation(cfg: ValidateConfig) -> Path:
    """A draft directory without a Strata manifest, probed and adopted into a temporary artifact
    (removed at exit); ValidationInputError when its trained layers cannot be inferred."""
    from pipeline.validate.case import ValidationInputError

    art = Path(cfg.artifact)
    log.info("%s has no %s: probing which layers it was trained on", art, ARTIFACT_MANIFEST)
    probe = run_probe(
        ProbeConfig.model_validate(
            {**cfg.probe.model_dump(), "draft": str(art), "target": cfg.serving.target.model_dump()}
        ),
        progress=False,
    )
    if probe.admissible is None:
        raise ValidationInputError(
            f"{art}: a draft trained elsewhere, and which layers it was trained on is not known: {probe.report.summary}"
        )
    tmp = Path(tempfile.mkdtemp(prefix="strata-imported-"))
    atexit.register(shutil.rmtree, tmp, True)
    adopt(probe, tmp / "draft")
    return tmp / "draft"


def compare_with_serving(probe: Probe) -> None:
    """The gate on the draft as imported (inferred provenance): what the deployment feeds against the
    inferred training set -- in a tie, against what each slot may have been trained on; fills
    ``report.serving`` and turns the verdict into pass or block."""
    from pipeline.validate.job import run_validate

    r, s = probe.report, probe.cfg.serving
    assert s is not None
    if probe.admissible is None:
        r.serving = {"not_compared": "the training set is not known (the probe settled nothing)"}
        return
    with tempfile.TemporaryDirectory(prefix="strata-probe-") as tmp:
        art = Path(tmp) / "draft"
        adopt(probe, art)
        serving = s.model_copy(update={"draft_config": s.draft_config or str(Path(probe.cfg.draft) / "config.json")})
        v = run_validate(
            ValidateConfig(artifact=str(art), serving=serving, cost=False, acceptance_prompts=4, max_new_tokens=16)
        )
    fed = [
        {
            "slot": x.slot,
            "trained": str(x.trained),
            "could_be": [str(p) for p in x.could_be],
            "fed": str(x.fed) if x.fed else None,
            "fed_by": x.fed_by,
            "ok": x.ok,
        }
        for x in v.slots
    ]
    r.serving = {
        "deployment": v.serving,
        "engine_reads": v.engine_reads.model_dump(mode="json"),
        "slots": fed,
        "acceptance": v.acceptance.model_dump(mode="json"),
        "validation_reasons": v.reasons,
    }
    r.reasons = v.reasons
    r.verdict = v.decision
    wrong = [x.message for x in v.slots if not x.ok] or v.reasons
    r.summary += (
        "; served as configured it is fed the same layers"
        if v.decision == "pass"
        else f"; BLOCKED for {s.engine} {v.serving.get('engine_version')}: {wrong[0]}"
    )
