"""Acceptance of the draft on held-out prompts: measured by the serving engine itself (through
the engine contract's ``serve_draft``), and by Strata's reference speculative decoding (the
HF engine serving the same draft) for comparison.

Both decode greedily; losslessness is checked against the same engine's target-only
greedy output. The prompts are prefixes of the probe samples (never trained on).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

from pipeline.draft.model import simulated_acceptance_length
from pipeline.engines.base import ServeResult, TargetEngine
from pipeline.engines.hf import HFEngine
from pipeline.fingerprint import Fingerprints
from schemas.acceptance import Acceptance, HeldoutAcceptance
from schemas.artifact import DraftArtifactManifest
from schemas.capture import CapturePoint
from schemas.validation import AcceptanceSection, Tolerances, ValidateConfig, VersusHeldout


def prompts(cfg: ValidateConfig, fp: Fingerprints) -> list[list[int]]:
    return fp.prompts(cfg.acceptance_prompts)


def predicted_accepted_per_step(manifest: DraftArtifactManifest, k: int) -> float | None:
    """Expected accepted tokens per verify step if the teacher-forced training accuracy held.
    Reported, not gated: free-running text drifts from the training text, so this overestimates
    acceptance by a factor that depends on the target (calibrate_acceptance.py measures it)."""
    acc = (manifest.metrics.get("eval") or {}).get("acc_per_pos") or []
    return simulated_acceptance_length(acc[:k]) if acc else None


def step_variance(per_pos: list[float], steps: int) -> float:
    """Variance of the accepted-draft count per verify step, from per-position acceptance rates.

    Chain speculation accepts position j only together with every earlier one, so the
    indicators nest (E[I_i I_j] = a_j for i < j) and the variance follows exactly from the
    rates. Rates are shrunk towards 1/2 by half a step ((a*S + 1/2) / (S + 1)) so that a short
    measurement with no (or every) acceptance does not claim zero noise."""
    a = [(x * steps + 0.5) / (steps + 1) for x in per_pos]
    return sum(x * (1 - x) for x in a) + 2 * sum(a[j] * (1 - a[i]) for j in range(len(a)) for i in range(j))


def versus_heldout(measured: Acceptance, heldout: HeldoutAcceptance | None, tol: Tolerances) -> VersusHeldout:
    """Acceptance through the serving engine against the same quantity measured at training on
    held-out prompts, where the trained points were fed by construction (``train.heldout``).

    Accepted drafts per step over the first k positions (k = the smaller of the two runs'):
    low when ``measured < acceptance_vs_heldout * heldout - acceptance_z * SE`` (SE of the
    difference: over prompts where both runs report it, else steps taken as independent). Gated
    only when the held-out figure stands clear of its own noise; otherwise reported."""
    if heldout is None or not heldout.verify_steps:
        return VersusHeldout(gated=False, why="no held-out acceptance was recorded at training")
    k = min(measured.k, heldout.k)
    h_pos, m_pos = (heldout.acceptance_per_pos or [])[:k], (measured.acceptance_per_pos or [])[:k]
    if (not h_pos and heldout.k != k) or (not m_pos and measured.k != k):
        return VersusHeldout(
            gated=False, why=f"k differs ({measured.k} vs {heldout.k}) and per-position acceptance is missing"
        )
    s_h, s_m = heldout.verify_steps, max(measured.verify_steps, 1)
    h_mean = sum(h_pos) if h_pos else heldout.accepted_per_step
    m_mean = sum(m_pos) if m_pos else measured.accepted_per_step
    var_h = step_variance(h_pos, s_h) if h_pos else k * k / 4
    var_m = step_variance(m_pos, s_m) if m_pos else var_h
    same_k = k == measured.k == heldout.k
    if same_k and measured.se is not None and heldout.se is not None:
        # prompts as the independent units (pipeline.acceptance); never below the per-step figure
        se_h = max(heldout.se, math.sqrt(var_h / s_h))
        se = math.sqrt(max(measured.se**2, var_m / s_m) + se_h**2)
        var_h = se_h**2 * s_h
    else:
        se = math.sqrt(var_m / s_m + var_h / s_h)
    threshold = tol.acceptance_vs_heldout * h_mean - tol.acceptance_z * se
    gated = h_mean - tol.acceptance_z * math.sqrt(var_h / s_h) > 0 and threshold > 0
    return VersusHeldout(
        k=k,
        measured=m_mean,
        heldout=h_mean,
        heldout_verify_steps=s_h,
        verify_steps=s_m,
        se=se,
        threshold=threshold,
        gated=gated,
        low=gated and m_mean < threshold,
        why=None if gated else "the held-out acceptance is within its noise of zero: reported, not gated",
    )


def check(cfg: ValidateConfig, section: AcceptanceSection) -> tuple[AcceptanceSection, list[str]]:
    """The acceptance check -- floor, held-out comparison, losslessness (gated at float32) --
    as a pure function: (the section with what it found, reasons to block)."""
    out: list[str] = []
    a = section.measured
    if a is None:
        return section, out
    if a.mean_acceptance_length < cfg.tolerances.acceptance_floor:
        out.append(f"mean acceptance length {a.mean_acceptance_length:.2f} < floor {cfg.tolerances.acceptance_floor}")
    vs = versus_heldout(a, section.heldout_at_training, cfg.tolerances)
    if vs.low:
        out.append(
            f"accepted tokens per step {vs.measured:.2f} (first {vs.k} positions) is below "
            f"{cfg.tolerances.acceptance_vs_heldout:g} x the {vs.heldout:.2f} measured at training on "
            f"held-out prompts, beyond the noise (threshold {vs.threshold:.2f}): the engine does not "
            "serve the draft as it was trained"
        )
    note = None
    if not a.lossless and cfg.serving.dtype == "float32":
        out.append(f"speculative decoding ({a.measured_by}) changed the greedy output: not lossless")
    elif not a.lossless:
        # Verifying k+1 tokens in one forward rounds differently from one token at a time
        # in 16-bit types, which can flip near-tied argmaxes: reported, not gated.
        note = (
            f"output differs from target-only greedy decoding in {cfg.serving.dtype}; "
            "16-bit verification can flip near-ties; gated at float32 only"
        )
    return section.model_copy(update={"vs_heldout": vs, "lossless_note": note}), out


def reference(cfg: ValidateConfig, art: Path, ps: list[list[int]], fed: list[CapturePoint]) -> Acceptance:
    """Strata's reference speculative decoding (HF target + Strata's draft) fed ``fed``."""
    eng = HFEngine(cfg.serving.target.path, [], cfg.serving.dtype, "cpu", cfg.serving.attn_implementation)
    try:
        return serve(eng, cfg, art, ps, feed_points=fed).acceptance
    finally:
        eng.close()


def serve(
    engine: TargetEngine,
    cfg: ValidateConfig,
    draft_dir: Path,
    ps: list[list[int]],
    feed_points: list[CapturePoint] | None = None,
) -> ServeResult:
    """Serve the draft through ``engine``; its acceptance says whether the output equals the same
    engine's target-only greedy decoding (``lossless``)."""
    res = engine.serve_draft(draft_dir, ps, cfg.max_new_tokens, cfg.speculative_tokens, feed_points=feed_points)
    lossless = res.outputs == engine.greedy(ps, cfg.max_new_tokens)
    return replace(res, acceptance=res.acceptance.model_copy(update={"lossless": lossless}))


def served_draft_dir(art: Path, draft_config: Path) -> tuple[Path, bool]:
    """A directory the engine can load: the artifact, or a copy carrying the served config.

    The copy's path is fixed by this process, the artifact's files and the config, so the
    validation's serving and its cost table load one engine for it; :func:`release_served`
    unloads and removes it when the validation is done."""
    config = json.loads(draft_config.read_text())
    if draft_config.resolve() == (art / "config.json").resolve() or config == json.loads(
        (art / "config.json").read_text()
    ):
        return art, False
    dest = _served_copy_path(art, config)
    if not (dest / "config.json").exists():
        partial = Path(tempfile.mkdtemp(prefix=dest.name + ".partial-", dir=dest.parent))
        draft_dir_with(art, config, partial)
        try:
            partial.rename(dest)
        except OSError:  # made meanwhile by another thread of this process: use that one
            shutil.rmtree(partial, ignore_errors=True)
    return dest, True


def release_served(engine: TargetEngine, art: Path, draft_config: Path) -> None:
    """Unload and remove the served copy :func:`served_draft_dir` made for this config, if any."""
    dest = _served_copy_path(art, json.loads(draft_config.read_text()))
    if dest.exists():
        engine.release_draft(dest)
        shutil.rmtree(dest, ignore_errors=True)


def _served_copy_path(art: Path, config: dict) -> Path:
    """Changed weights or another config give another path: an engine serving one never stands in."""
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    h.update(str(art.resolve()).encode())
    for f in sorted(art.iterdir()):
        if f.is_file() and f.name != "config.json":
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return Path(tempfile.gettempdir()) / f"strata-served-draft-{os.getpid()}-{h.hexdigest()[:16]}"


def draft_dir_with(art: Path, config: dict, dest: Path) -> Path:
    """A copy of the artifact's files in ``dest`` with ``config`` as its config.json."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in art.iterdir():
        if f.is_file() and f.name != "config.json":
            shutil.copy2(f, dest / f.name)
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    return dest


def serve_as_configured(
    engine: TargetEngine, cfg: ValidateConfig, art: Path, draft_config: Path, ps: list[list[int]]
) -> ServeResult:
    """The serving engine with the draft directory as it will be deployed (the served config.json);
    a copy made for the config stays loaded until :func:`release_served`."""
    return serve(engine, cfg, served_draft_dir(art, draft_config)[0], ps)
