"""The validation job's checks, each returning its result and the reasons it blocks.

identity      is the serving target the one the draft was trained against?
release       is there a reading rule for the serving release, and is it what replays here?
reading rule  which boundaries the rule table says the engine feeds (per vLLM runner)
measured feed which boundaries the engine really fed the draft (``feed.py``), vs the rule
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline import conventions
from pipeline.conventions import releases
from pipeline.engines import installed_version, same_release
from pipeline.validate.gate import label
from schemas.capture import CapturePoint
from schemas.identity import TargetIdentity
from schemas.validation import Check, EngineReads, ServingConfig


@dataclass
class Result:
    """A check's findings: ``reasons`` block promotion; ``notes`` are reported only."""

    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def identity(trained: TargetIdentity, serving: TargetIdentity, imported: bool = False) -> tuple[list[Check], Result]:
    checks, res = [], Result()
    if imported:  # its manifest names the target it was probed against, not the one it was trained for
        return [
            Check(
                name=what,
                ok=True,
                message=f"{what}: not available for an imported draft (no training-data "
                "digests; the probe ran against the serving target)",
            )
            for what in ("weights", "config", "tokenizer", "chat template")
        ], res
    for f, what in (
        ("weights_sha256", "weights"),
        ("config_sha256", "config"),
        ("tokenizer_sha256", "tokenizer"),
        ("chat_template_sha256", "chat template"),
    ):
        a, b = getattr(trained, f), getattr(serving, f)
        ok = a == b
        checks.append(
            Check(
                name=what,
                ok=ok,
                message=f"{what}: {'same' if ok else f'training {str(a)[:12]} vs serving {str(b)[:12]}'}",
            )
        )
        if not ok:
            res.reasons.append(
                f"serving target's {what} differ from the training target's ({str(a)[:12]} vs {str(b)[:12]})"
            )
    return checks, res


def serving_release(s: ServingConfig) -> str:
    """The release whose rules apply: as configured, else the installed one (replay: engine),
    else the newest release with a known rule."""
    if s.engine_version:
        return s.engine_version
    if s.replay == "engine" and (got := installed_version(s.engine)):
        return got.split("+")[0]
    return releases.newest_release(s.engine)


def measurable(s: ServingConfig, release: str) -> bool:
    """Can this validation serve the draft through the serving release itself (and so measure
    its feed without any rule)?"""
    got = installed_version(s.engine) if s.replay == "engine" else None
    return got is not None and same_release(got, release)


def installed_release(s: ServingConfig, release: str) -> tuple[str | None, Result]:
    """With replay: engine, the installed engine must be the serving release."""
    res = Result()
    got = installed_version(s.engine) if s.replay == "engine" else None
    if got is not None and not same_release(got, release):
        res.reasons.append(
            f"replayed through {s.engine} {got}, but serving.engine_version is {release}: validate "
            f"where {s.engine} {release} is installed, or set serving.engine_version to {got}"
        )
    return got, res


@dataclass
class Reading:
    """What one rule says an engine release reads from the draft config and feeds."""

    rule: releases.ReadingRule
    ids: list[int] | None
    key: str
    points: list[CapturePoint]
    error: str | None

    def reads(self, n: int) -> EngineReads:
        return EngineReads(
            rule=self.rule.name,
            source=self.rule.source,
            key=self.key,
            ids=self.ids,
            points=[str(p) for p in self.points],
            labels=[label(p, n) for p in self.points],
            error=self.error,
        )


def rule_readings(
    s: ServingConfig, release: str, family: str, draft_cfg: dict, n: int, moe: bool = False
) -> list[Reading]:
    """One reading per runner the deployment may use (``moe``: the target routes to experts, which
    vLLM's runner choice asks); UnknownRelease when a rule is missing."""
    runners = releases.runners_for(release, s.vllm_runner, family, moe) if s.engine == "vllm" else [None]
    out = []
    for runner in runners:
        rule = releases.rule_for(s.engine, release, family, runner)  # type: ignore[arg-type]
        ids, key, points, error = None, "", [], None
        try:
            ids, key = releases.ids_in_config(rule, draft_cfg)
            points = [conventions.boundary_point(k, n) for k in releases.boundaries_read(rule, ids, n)]
        except conventions.UnknownRelease:
            raise
        except conventions.ConventionError as e:
            error = str(e)
        out.append(Reading(rule, ids, key, points, error))
    return out


def reading_rule(readings: list[Reading], trained: list[CapturePoint], engine: str, cfg_name: str, n: int) -> Result:
    """Reasons from the rule table alone: ids the engine cannot capture, silent defaults,
    slot-count mismatches, and runners that would read the config differently."""
    res = Result()
    first = readings[0]
    if first.error:
        res.reasons.append(f"{engine} cannot serve {cfg_name} as written: {first.error}")
    elif first.ids is None:
        res.reasons.append(
            f"{first.rule.name} finds no aux layer ids in {cfg_name} and silently uses its default "
            f"{[label(p, n) for p in first.points]}"
        )
    if not first.error and len(first.points) != len(trained):
        res.reasons.append(
            f"{first.rule.name} would feed {len(first.points)} aux states, the draft was trained on {len(trained)}"
        )
    others = [r for r in readings[1:] if (r.points, r.error) != (first.points, first.error)]
    for r in others:
        what = r.error or f"{r.key} -> {[label(p, n) for p in r.points]}"
        res.reasons.append(
            f"{r.rule.name} reads {cfg_name} differently from {first.rule.name} ({what}): vLLM may pick "
            "either runner on a GPU; set serving.vllm_runner to the one you deploy, or write the "
            "top-level key both read (strata export does)"
        )
    return res


def feed_vs_rule(
    measured: list[CapturePoint | None], predicted: list[CapturePoint], rule: releases.ReadingRule, n: int
) -> list[str]:
    """One line per slot where the measurement and the rule table disagree (a table bug)."""
    lines = []
    for s, m in enumerate(measured):
        p = predicted[s] if s < len(predicted) else None
        if m is not None and (p is None or conventions.boundary(m, n) != conventions.boundary(p, n)):
            said = label(p, n) if p is not None else "no tensor"
            lines.append(
                f"{rule.name} feeds {label(m, n)} to slot {s}; Strata's rule table predicted {said} "
                f"({rule.source}): fix the table"
            )
    return lines
