"""The validation job: resolve the case, open the engine that replays and serves, decide,
add the cost of a blocked configuration, write the report and record the verdict in the
registry. The decision is ``decide.py``'s; the checks are ``checks.py``'s and ``gate.py``'s.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

from pipeline.engines.base import TargetEngine
from pipeline.engines.errors import EngineUnavailable
from pipeline.identity import stop_token_ids, target_config, target_identity
from pipeline.registry.registry import Registry
from pipeline.store.objects import open_store
from pipeline.validate import acceptance, checks
from pipeline.validate.case import Case, ValidationInputError, deployment, load_case, serving_family
from pipeline.validate.cost import cost_table
from pipeline.validate.decide import decide
from pipeline.validate.replay import open_replay_engine
from pipeline.validate.report import write_report
from schemas.config import load_config
from schemas.registry import Deployment, ValidationRecord
from schemas.validation import Cost, ValidateConfig, ValidationReport

log = logging.getLogger(__name__)


def serving_for_channel(validate_config_path: str) -> Deployment:
    """The serving configuration a channel deploys with, from a validation config."""
    cfg = load_config(validate_config_path, ValidateConfig)
    art = Path(cfg.artifact)
    draft_cfg_path = Path(cfg.serving.draft_config) if cfg.serving.draft_config else art / "config.json"
    ident = target_identity(cfg.serving.target.path, cfg.serving.target.name, cfg.serving.target.revision)
    family = serving_family(cfg, target_config(cfg.serving.target.path))
    return deployment(cfg, draft_cfg_path.read_bytes(), ident.key, family)


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
        acceptance.release_served(engine, case.art, case.draft_cfg_path)  # served and costed: done
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


def blocked_cost(case: Case, engine: TargetEngine) -> Cost | None:
    """The cost table for a blocked configuration, where the serving engine itself runs here
    (None when validation was not asked to run it: ``replay: hf`` or no acceptance prompts)."""
    cfg, s = case.cfg, case.cfg.serving
    if s.replay != "engine" or cfg.acceptance_prompts == 0:
        return None
    got, wrong = checks.installed_release(s, case.release)
    if wrong.reasons:
        return Cost(skipped=f"the installed {s.engine} {got} is not the serving release {case.release}")
    reading = case.reading
    if reading is None:
        return Cost(skipped=f"no derived rule for {s.engine} {case.release}: the correct ids are not known")
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
