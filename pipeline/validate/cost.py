"""What a blocked configuration would have cost, measured through the serving engine.

A blocked verdict says *that* the engine would feed the draft the wrong layers; this table
says what it would have cost a user, on the validation's own (held-out) prompts: the
target alone, the draft with the configuration as written, and the draft with the ids the
conventions module gives for the trained capture points -- mean acceptance length,
per-position acceptance (``pipeline.acceptance``) and single-stream decode tokens/s on
generations stopped at the end of the turn, as served, each with its standard error over
prompts, each configuration timed the same way. It is a measurement for the report: nothing here is recorded as servable, and
every draft it loaded is unloaded before the validation returns.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

from pipeline import conventions
from pipeline.engines.base import DecodeTiming, TargetEngine
from pipeline.engines.errors import EngineError, EngineUnavailable
from pipeline.validate.acceptance import draft_dir_with, served_draft_dir
from schemas.capture import CapturePoint
from schemas.validation import Cost, CostRow

log = logging.getLogger(__name__)

NOTE = (
    "measured for this report only: the configuration is blocked, nothing was promoted, and every draft "
    "loaded for the measurement was unloaded"
)


def _row(name: str, config: str, t: DecodeTiming, base: DecodeTiming | None, stop_ids: frozenset[int]) -> CostRow:
    acc = t.acceptance
    se = t.decode_tokens_per_s_se
    # What one engine step costs after the prefill (a verify step with a draft, one token without):
    # speed-up = mean acceptance length x plain step / verify step.
    steps = acc.verify_steps if acc else t.decode_tokens
    return CostRow(
        configuration=name,
        draft_config=config,
        new_tokens=t.new_tokens,
        ended_turn=sum(1 for o in t.outputs if o and o[-1] in stop_ids),
        decode_tokens_per_s=round(t.decode_tokens_per_s, 2),
        decode_tokens_per_s_se=round(se, 2) if se is not None else None,
        mean_acceptance_length=round(acc.mean_acceptance_length, 3) if acc else None,
        mean_acceptance_length_se=round(acc.se, 3) if acc and acc.se is not None else None,
        verify_steps=acc.verify_steps if acc else None,
        acceptance_per_pos=[round(a, 3) for a in acc.acceptance_per_pos or []] if acc else None,
        decode_ms_per_step=round(1000 * t.decode_seconds / steps, 3) if steps else None,
        speedup_vs_no_speculation=round(t.decode_tokens_per_s / base.decode_tokens_per_s, 3) if base else None,
        same_output_as_no_speculation=t.outputs == base.outputs if base else None,
    )


def _timed(engine: TargetEngine, draft_dir: Path, prompts, max_new_tokens: int, k: int) -> DecodeTiming | str:
    """The draft's timing, or why the engine refused to serve it (that is the row's finding; a
    bug in Strata is not caught)."""
    try:
        return engine.timed_decode(draft_dir, prompts, max_new_tokens, k)
    except EngineError as e:
        return f"{engine.name} failed to serve it: {type(e).__name__}: {str(e)[:200]}"


def _draft_row(name: str, config: str, t: DecodeTiming | str, base: DecodeTiming, stop_ids: frozenset[int]) -> CostRow:
    if isinstance(t, str):
        return CostRow(configuration=name, draft_config=config, skipped=t)
    return _row(name, config, t, base, stop_ids)


def cost_table(
    engine: TargetEngine,
    art: Path,
    draft_config: Path,
    trained: list[CapturePoint],
    n: int,
    family: str,
    release: str,
    runner: str | None,
    prompts: list[list[int]],
    max_new_tokens: int,
    k: int,
    stop_ids: frozenset[int],
) -> Cost:
    """Rows for: no speculation, the draft as configured, the draft with the correct ids;
    ``ended_turn`` counts the generations that stopped at the target's end of turn (``stop_ids``)."""
    served = json.loads(draft_config.read_text())
    ids_written = conventions.ids_in_draft_config(served, engine.name, release, family, runner)[0]
    try:
        fixed, why = conventions.draft_config_feeding(served, trained, engine.name, n, family, release, runner), ""
    except conventions.ConventionError as e:
        fixed, why = None, str(e)
    log.info(
        "cost of the blocked configuration: timing %d prompts x %d new tokens through %s %s "
        "(no speculation / as written / correct ids)",
        len(prompts),
        max_new_tokens,
        engine.name,
        engine.version,
    )
    tmp = Path(tempfile.mkdtemp(prefix="strata-cost-"))
    loaded: list[Path] = []  # every draft directory served for this table: unloaded before returning
    try:
        # The drafts are timed first, the target alone last: validation has just served the config
        # as written from the same directory (served_draft_dir), so a pooled engine is still running.
        written_dir = served_draft_dir(art, draft_config)[0]
        loaded.append(written_dir)
        written = _timed(engine, written_dir, prompts, max_new_tokens, k)
        if fixed is None:
            ids_fixed, fixed_t = None, f"no id list feeds the trained points: {why}"
        else:
            ids_fixed = conventions.ids_in_draft_config(fixed, engine.name, release, family, runner)[0]
            own = json.loads((art / "config.json").read_text())
            fixed_dir = art  # the engine reads the same ids from the artifact's own config: reuse its engine
            if conventions.ids_in_draft_config(own, engine.name, release, family, runner)[0] != ids_fixed:
                fixed_dir = draft_dir_with(art, fixed, tmp / "fixed")
                loaded.append(fixed_dir)
            fixed_t = _timed(engine, fixed_dir, prompts, max_new_tokens, k)
        base = engine.timed_decode(None, prompts, max_new_tokens, k)
        rows = [
            _row("no speculation", "-", base, None, stop_ids),
            _draft_row("draft, config as written", f"ids {ids_written}", written, base, stop_ids),
            _draft_row("draft, correct ids", "-" if ids_fixed is None else f"ids {ids_fixed}", fixed_t, base, stop_ids),
        ]
        return Cost(
            rows=rows,
            prompts=len(prompts),
            max_new_tokens=max_new_tokens,
            k=k,
            timing="single stream, one prompt at a time, prefill subtracted, stopped at the end of the turn",
            measured_by=f"{engine.name} {engine.version}",
            note=NOTE,
        )
    except EngineUnavailable as e:
        return Cost(skipped=str(e))
    finally:
        for d in loaded:
            engine.release_draft(d)
        shutil.rmtree(tmp, ignore_errors=True)


def table_lines(cost: Cost) -> list[str]:
    """The cost table as aligned text lines (report and demo); +- is one standard error over prompts."""
    if cost.skipped is not None or not cost.rows:
        return [f"cost not measured: {cost.skipped or 'no table'}"]
    out = [f"{'configuration':<26} {'draft config':<16} {'accept len':>12} {'per position':<16} {'decode tok/s':>18}"]
    for r in cost.rows:
        if r.skipped is not None:
            out.append(f"{r.configuration:<26} {r.skipped}")
            continue
        acc = "-"
        if r.mean_acceptance_length is not None:
            acc = f"{r.mean_acceptance_length:.2f}" + (
                f" +-{r.mean_acceptance_length_se:.2f}" if r.mean_acceptance_length_se is not None else ""
            )
        per = " ".join(f"{a:.2f}" for a in r.acceptance_per_pos) if r.acceptance_per_pos else "-"
        speed = f"{r.decode_tokens_per_s:.1f}"
        if r.decode_tokens_per_s_se is not None:
            speed += f" +-{r.decode_tokens_per_s_se:.1f}"
        if r.speedup_vs_no_speculation is not None:
            speed += f" ({r.speedup_vs_no_speculation:.2f}x)"
        out.append(f"{r.configuration:<26} {r.draft_config:<16} {acc:>12} {per:<16} {speed:>18}")
    return out
