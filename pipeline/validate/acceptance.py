"""Acceptance of the draft on held-out prompts: measured by the serving engine itself, and
by Strata's reference speculative decoding (HF target + reference draft) for comparison.

Both decode greedily; losslessness is checked against the same engine's target-only
greedy output. The prompts are prefixes of the probe samples (never trained on).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.fingerprint import Fingerprints
from schemas.artifact import DraftArtifactManifest
from schemas.capture import CapturePoint
from schemas.validation import ValidateConfig

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def prompts(cfg: ValidateConfig, fp: Fingerprints) -> list[list[int]]:
    out = []
    for i in range(min(cfg.acceptance_prompts, len(fp.sample_ids))):
        toks = fp.tokens(i)
        out.append(toks[: max(4, min(48, len(toks) // 2))])
    return out


def predicted_accepted_per_step(manifest: DraftArtifactManifest, k: int) -> float | None:
    """Expected accepted tokens per verify step if the training per-position accuracy held."""
    acc = (manifest.metrics.get("eval") or {}).get("acc_per_pos") or []
    if not acc:
        return None
    prod, total = 1.0, 0.0
    for a in acc[:k]:
        prod *= a
        total += prod
    return total


def reference(cfg: ValidateConfig, art: Path, ps: list[list[int]], fed: list[CapturePoint]) -> dict:
    """Strata's reference speculative decoding with the points the engine feeds."""
    from transformers import AutoModelForCausalLM

    from pipeline.draft.export import load_draft
    from pipeline.draft.speculate import TargetRunner, greedy_generate, speculative_generate

    dtype = _DTYPES[cfg.serving.dtype]
    target = AutoModelForCausalLM.from_pretrained(cfg.serving.target.path, dtype=dtype, local_files_only=True)
    draft = load_draft(art, cfg.serving.target.path, dtype=dtype)
    runner = TargetRunner(target, fed)
    k = cfg.speculative_tokens
    per_pos = [0] * k
    steps = accepted = 0
    lossless = True
    for prompt in ps:
        res = speculative_generate(runner, draft, prompt, cfg.max_new_tokens, k)
        lossless &= res.tokens == greedy_generate(target, prompt, cfg.max_new_tokens)
        steps += res.verify_steps
        accepted += res.accepted_tokens
        per_pos = [a + b for a, b in zip(per_pos, res.accepted_per_pos, strict=True)]
    return {"measured_by": "reference (HF target + Strata draft)", "verify_steps": steps,
            "accepted_per_step": accepted / max(steps, 1), "mean_acceptance_length": 1 + accepted / max(steps, 1),
            "acceptance_per_pos": [a / max(steps, 1) for a in per_pos], "lossless": lossless, "k": k}


def served_draft_dir(art: Path, draft_config: Path) -> tuple[Path, bool]:
    """A directory the engine can load: the artifact, or a temp copy carrying the served config."""
    if draft_config.resolve() == (art / "config.json").resolve() or (
            json.loads(draft_config.read_text()) == json.loads((art / "config.json").read_text())):
        return art, False
    tmp = Path(tempfile.mkdtemp(prefix="strata-served-draft-"))
    for f in art.iterdir():
        if f.is_file() and f.name != "config.json":
            shutil.copy2(f, tmp / f.name)
    shutil.copy2(draft_config, tmp / "config.json")
    return tmp, True


@dataclass
class Served:
    """One serving run: acceptance as the engine counted it, what it emitted, what it fed the draft."""

    acceptance: dict
    outputs: list[list[int]]
    feed_calls: list[list] | None      # per prompt, the recorded draft inputs (None: not recorded)


def vllm(cfg: ValidateConfig, art: Path, draft_config: Path, ps: list[list[int]]) -> Served:
    """vLLM serving the draft with EAGLE-3 as configured; its own spec-decode counters and the
    inputs its draft's fc received on every step."""
    from pipeline import conventions
    from pipeline.engines import vllm_engine
    from pipeline.identity import target_identity

    s = cfg.serving
    n = target_identity(s.target.path).num_layers
    capture = vllm_engine.shared("capture", s.target.path, conventions.all_boundaries(n)[:-1], dtype=s.dtype,
                                 tp_size=s.tp_size, max_model_len=s.max_model_len)
    expected = capture.greedy(ps, cfg.max_new_tokens)
    draft_dir, temporary = served_draft_dir(art, draft_config)
    try:
        if temporary:
            eng = vllm_engine.VLLMEagle3(s.target.path, draft_dir, cfg.speculative_tokens, dtype=s.dtype,
                                         tp_size=s.tp_size, max_model_len=s.max_model_len)
        else:
            eng = vllm_engine.shared("eagle3", s.target.path, str(draft_dir), cfg.speculative_tokens, dtype=s.dtype,
                                     tp_size=s.tp_size, max_model_len=s.max_model_len)
        try:
            tokens, st, calls = eng.generate_recording(ps, cfg.max_new_tokens)
        finally:
            if temporary:
                eng.close()
    finally:
        if temporary:
            shutil.rmtree(draft_dir, ignore_errors=True)
    acc = {"measured_by": f"vllm {vllm_engine.vllm_version()} spec-decode counters", "verify_steps": st.num_drafts,
           "draft_tokens": st.num_draft_tokens, "accepted_per_step": st.num_accepted_tokens / max(st.num_drafts, 1),
           "mean_acceptance_length": st.mean_acceptance_length, "acceptance_per_pos": st.acceptance_per_pos,
           "lossless": tokens == expected, "k": cfg.speculative_tokens}
    return Served(acc, tokens, calls)


def sglang(cfg: ValidateConfig, art: Path, draft_config: Path, ps: list[list[int]]) -> dict:
    """SGLang serving the draft with EAGLE3; acceptance from its ``meta_info``."""
    from pipeline.engines import sglang_engine

    s = cfg.serving
    draft_dir, temporary = served_draft_dir(art, draft_config)
    try:
        tokens, st = sglang_engine.serve_eagle3(s.target.path, draft_dir, ps, cfg.max_new_tokens,
                                                cfg.speculative_tokens, dtype=s.dtype, tp_size=s.tp_size)
        expected = sglang_engine.greedy(s.target.path, ps, cfg.max_new_tokens, dtype=s.dtype, tp_size=s.tp_size)
    finally:
        if temporary:
            shutil.rmtree(draft_dir, ignore_errors=True)
    return Served({"measured_by": "sglang meta_info (spec_verify_ct, spec_accept_length)", **st,
                   "lossless": tokens == expected, "k": cfg.speculative_tokens}, tokens, None)
