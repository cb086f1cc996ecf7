"""Replay the probe samples through the serving target and sketch every boundary.

``replay: engine`` runs them through the serving engine itself (vLLM here, SGLang on GPU
clusters); ``replay: hf`` through HF transformers, for machines where the engine cannot
run. Either way every boundary r_0..r_N plus final post-norm is sketched, so the gate can
say which boundary a slot's training values really match. Which boundaries the engine
*feeds* the draft is decided separately, by its id-reading rules in ``conventions``.
"""

from __future__ import annotations

import torch

from pipeline import conventions
from pipeline.draft.target_head import load_final_norm
from pipeline.fingerprint import Fingerprints, projection, sketch
from schemas.validation import ValidateConfig


def replay(cfg: ValidateConfig, fp: Fingerprints, n: int) -> dict[str, torch.Tensor]:
    """Sketches of r_0..r_N and final post-norm for the probe samples, keyed by point."""
    if cfg.serving.replay == "hf":
        return _replay_hf(cfg, fp, n)
    if cfg.serving.engine == "vllm":
        return _replay_vllm(cfg, fp, n)
    return _replay_sglang(cfg, fp, n)


@torch.no_grad()
def _replay_hf(cfg: ValidateConfig, fp: Fingerprints, n: int) -> dict[str, torch.Tensor]:
    from pipeline.engines.hf import HFEngine
    from pipeline.store.encoding import bits_to_torch, join_planes

    points = conventions.all_boundaries(n)
    eng = HFEngine(cfg.serving.target.path, points, cfg.serving.dtype, "auto", cfg.serving.attn_implementation)
    proj = projection(eng.hidden_size, fp.dim, fp.seed)
    out: dict[str, list[torch.Tensor]] = {str(p): [] for p in points}
    for i in range(len(fp.sample_ids)):
        b = eng.capture([fp.tokens(i)])  # one sequence per forward, like nothing else in the batch
        for p in points:
            x = bits_to_torch(join_planes(list(b.planes[str(p)])), cfg.serving.dtype)
            out[str(p)].append(sketch(x, proj)[0])
    eng.close()
    return {k: torch.cat(v) for k, v in out.items()}


def _sketch_all(per_point: dict[str, list[torch.Tensor]], hidden: int, fp: Fingerprints, n: int,
                target_dir: str) -> dict[str, torch.Tensor]:
    """Sketch captured boundaries; final post-norm is derived from r_N when it was captured."""
    proj = projection(hidden, fp.dim, fp.seed)
    r_n, post = str(conventions.boundary_point(n, n)), str(conventions.all_boundaries(n)[-1])
    if r_n in per_point:
        # Engines never feed post-norm states to an EAGLE-3 draft; the gate needs them only to
        # diagnose a draft trained on the wrong side of the norm, so apply the target's norm here.
        norm = load_final_norm(target_dir)
        per_point = {**per_point, post: [norm(x) for x in per_point[r_n]]}
    return {k: torch.cat([sketch(x.float(), proj)[0] for x in v]) for k, v in per_point.items()}


def _replay_vllm(cfg: ValidateConfig, fp: Fingerprints, n: int) -> dict[str, torch.Tensor]:
    from pipeline.engines import vllm_engine

    s = cfg.serving
    points = conventions.all_boundaries(n)[:-1]  # r_0..r_N: all vLLM can capture
    eng = vllm_engine.shared("capture", s.target.path, points, dtype=s.dtype, tp_size=s.tp_size,
                             max_model_len=s.max_model_len)
    per_point = eng.capture_tensors([fp.tokens(i) for i in range(len(fp.sample_ids))])
    return _sketch_all(per_point, eng.hidden_size, fp, n, s.target.path)


def _replay_sglang(cfg: ValidateConfig, fp: Fingerprints, n: int) -> dict[str, torch.Tensor]:
    """SGLang cannot capture r_0 (nor r_N outside gpt-oss): those boundaries are not compared."""
    from pipeline.engines import sglang_engine

    s = cfg.serving
    family = sglang_engine.family_for(s.target.path, s.engine_family)
    version = s.engine_version or conventions.NEWEST
    points = [p for p in conventions.all_boundaries(n)[:-1] if sglang_engine.can_capture(p, n, family, version)]
    eng = sglang_engine.SGLangEngine(s.target.path, points, dtype=s.dtype, tp_size=s.tp_size, family=family)
    try:
        per_point = eng.capture_tensors([fp.tokens(i) for i in range(len(fp.sample_ids))])
    finally:
        eng.close()
    return _sketch_all(per_point, eng.hidden_size, fp, n, s.target.path)
