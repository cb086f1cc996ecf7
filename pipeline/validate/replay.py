"""Replay the probe samples through the serving target and sketch every boundary.

``replay: engine`` runs them through the serving engine itself (vLLM, and SGLang from its own
environment); ``replay: hf`` through HF transformers, for machines where the engine cannot
run. Either way every boundary the engine can capture (r_0..r_N, plus final post-norm) is
sketched, so the gate can say which boundary a slot's training values really match.
"""

from __future__ import annotations

import logging

import torch

from pipeline import conventions
from pipeline.draft.target_head import load_final_norm
from pipeline.engines import installed_version
from pipeline.engines.base import TargetEngine
from pipeline.engines.hf import HFEngine
from pipeline.engines.sglang import engine as sglang_engine
from pipeline.engines.vllm import engine as vllm_engine
from pipeline.fingerprint import Fingerprints, projection, sketch
from pipeline.identity import target_config
from schemas.validation import ValidateConfig

log = logging.getLogger(__name__)


def open_replay_engine(cfg: ValidateConfig, n: int) -> tuple[TargetEngine, bool]:
    """The engine that replays (and, with ``replay: engine``, serves); True when the caller owns
    it and must close it (vLLM engines are shared per process and closed at exit)."""
    s = cfg.serving
    if s.replay == "hf":
        return HFEngine(s.target.path, conventions.all_boundaries(n), s.dtype, "auto", s.attn_implementation), True
    if s.engine == "vllm":
        points = conventions.all_boundaries(n)[:-1]  # r_0..r_N: all vLLM can capture
        return vllm_engine.shared(
            "capture", s.target.path, points, dtype=s.dtype, tp_size=s.tp_size, max_model_len=s.max_model_len
        ), False

    version = installed_version("sglang") or conventions.NEWEST  # what the replaying servers can capture
    try:
        family = conventions.engine_family("sglang", target_config(s.target.path), s.engine_family)
        points = [p for p in conventions.all_boundaries(n)[:-1] if sglang_engine.can_capture(p, n, family, version)]
    except conventions.UnknownRelease:
        # No rule says which ids make this SGLang capture which boundary: HF transformers captures
        # every boundary of the same weights as the reference, and SGLang serves the draft.
        log.warning(
            "no derived rule for sglang %s on this target: the boundaries come from HF transformers (%s) "
            "and SGLang only serves the draft",
            version,
            s.dtype,
        )
        ref = HFEngine(s.target.path, conventions.all_boundaries(n)[:-1], s.dtype, "auto", s.attn_implementation)
        return sglang_engine.SGLangEngine(
            s.target.path, [], dtype=s.dtype, tp_size=s.tp_size, max_model_len=s.max_model_len, reference=ref
        ), True
    return sglang_engine.SGLangEngine(
        s.target.path, points, dtype=s.dtype, tp_size=s.tp_size, family=family, max_model_len=s.max_model_len
    ), True


@torch.no_grad()
def replay(engine: TargetEngine, fp: Fingerprints, n: int, target_dir: str) -> dict[str, torch.Tensor]:
    """Sketches of every boundary the engine captures for the probe samples, keyed by point;
    final post-norm is derived from r_N where the engine cannot capture it itself."""
    per_point = engine.capture_tensors([fp.tokens(i) for i in range(len(fp.sample_ids))])
    proj = projection(engine.hidden_size, fp.dim, fp.seed)
    r_n, post = str(conventions.boundary_point(n, n)), str(conventions.all_boundaries(n)[-1])
    if r_n in per_point and post not in per_point:
        # Engines never feed post-norm states to an EAGLE-3 draft; the gate needs them only to
        # diagnose a draft trained on the wrong side of the norm, so apply the target's norm here.
        norm = load_final_norm(target_dir)
        per_point = {**per_point, post: [norm(x) for x in per_point[r_n]]}
    return {k: torch.cat([sketch(x.float(), proj)[0] for x in v]) for k, v in per_point.items()}
