"""Acceptance of the draft on held-out prompts: measured by the serving engine itself (through
the engine contract's ``serve_draft``), and by Strata's reference speculative decoding (the
HF engine serving the same draft) for comparison.

Both decode greedily; losslessness is checked against the same engine's target-only
greedy output. The prompts are prefixes of the probe samples (never trained on).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from pipeline.draft.model import simulated_acceptance_length
from pipeline.engines.base import ServeResult, TargetEngine
from pipeline.engines.hf import HFEngine
from pipeline.fingerprint import Fingerprints
from schemas.artifact import DraftArtifactManifest
from schemas.capture import CapturePoint
from schemas.validation import ValidateConfig


def prompts(cfg: ValidateConfig, fp: Fingerprints) -> list[list[int]]:
    return fp.prompts(cfg.acceptance_prompts)


def predicted_accepted_per_step(manifest: DraftArtifactManifest, k: int) -> float | None:
    """Expected accepted tokens per verify step if the training per-position accuracy held."""
    acc = (manifest.metrics.get("eval") or {}).get("acc_per_pos") or []
    return simulated_acceptance_length(acc[:k]) if acc else None


def reference(cfg: ValidateConfig, art: Path, ps: list[list[int]], fed: list[CapturePoint]) -> dict:
    """Strata's reference speculative decoding (HF target + Strata's draft) fed ``fed``."""
    eng = HFEngine(cfg.serving.target.path, [], cfg.serving.dtype, "cpu", cfg.serving.attn_implementation)
    try:
        return serve(eng, cfg, art, ps, feed_points=fed).acceptance
    finally:
        eng.close()


def serve(engine: TargetEngine, cfg: ValidateConfig, draft_dir: Path, ps: list[list[int]],
          feed_points: list[CapturePoint] | None = None) -> ServeResult:
    """Serve the draft through ``engine``; acceptance gains ``lossless``: the output equals the
    same engine's target-only greedy decoding."""
    res = engine.serve_draft(draft_dir, ps, cfg.max_new_tokens, cfg.speculative_tokens, feed_points=feed_points)
    res.acceptance["lossless"] = res.outputs == engine.greedy(ps, cfg.max_new_tokens)
    return res


def served_draft_dir(art: Path, draft_config: Path) -> tuple[Path, bool]:
    """A directory the engine can load: the artifact, or a temp copy carrying the served config."""
    if draft_config.resolve() == (art / "config.json").resolve() or (
            json.loads(draft_config.read_text()) == json.loads((art / "config.json").read_text())):
        return art, False
    tmp = Path(tempfile.mkdtemp(prefix="strata-served-draft-"))
    return draft_dir_with(art, json.loads(draft_config.read_text()), tmp), True


def draft_dir_with(art: Path, config: dict, dest: Path) -> Path:
    """A copy of the artifact's files in ``dest`` with ``config`` as its config.json."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in art.iterdir():
        if f.is_file() and f.name != "config.json":
            shutil.copy2(f, dest / f.name)
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    return dest


def serve_as_configured(engine: TargetEngine, cfg: ValidateConfig, art: Path, draft_config: Path,
                        ps: list[list[int]]) -> ServeResult:
    """The serving engine with the draft directory as it will be deployed (the served config.json)."""
    draft_dir, temporary = served_draft_dir(art, draft_config)
    try:
        return serve(engine, cfg, draft_dir, ps)
    finally:
        if temporary:  # a one-off copy: no later validation can reuse an engine serving it
            engine.release_draft(draft_dir)
            shutil.rmtree(draft_dir, ignore_errors=True)
