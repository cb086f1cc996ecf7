"""SGLang engine (GPU clusters): capture, replay and EAGLE-3 acceptance through SGLang.

SGLang cannot be imported on the CPU machines Strata is developed on, so this adapter
is split in two. The pure parts -- which ids to write for a model family (from
``conventions``, via the draft export), the engine arguments, and the reading of SGLang's
responses -- are tested everywhere. The parts that start
``sglang.Engine`` run only where SGLang is installed (README, "SGLang on a GPU cluster";
``tests/test_sglang_engine.py::test_gpu_*``).

Capture: SGLang captures the aux states an EAGLE-3 draft's nested
``eagle_config.eagle_aux_hidden_state_layer_ids`` names (llama/qwen: o-labels, it
captures before layer id+1; deepseek_v2: +1 only if the first id is 1; gpt-oss:
r-labels). Strata serves a stub draft whose config carries exactly the ids for the wanted
points and asks for ``return_hidden_states`` on the prompt: the prefill's states come back
as ``[T, n_ids * H]``, slot-major, in the order of the id list.
Acceptance: ``meta_info["spec_verify_ct"]`` (verify steps) and ``completion_tokens`` per
request, plus ``spec_accept_length`` where the version reports it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from pipeline import conventions
from pipeline.draft.export import export_draft
from pipeline.draft.model import DraftConfig, Eagle3Draft
from pipeline.engines.base import ServeResult, TargetEngine, acceptance
from pipeline.engines.errors import EngineError, EngineUnavailable
from pipeline.engines.feed_files import take_calls
from pipeline.engines.refs import sglang_engine_ref, sglang_release
from pipeline.engines.sglang_models import FEED_DIR_ENV
from pipeline.identity import target_config, target_identity
from pipeline.packing import pack_by_tokens
from schemas.capture import CapturePoint
from schemas.provenance import EngineRef


def can_capture(point: CapturePoint, num_layers: int, family: str,
                version: str = conventions.NEWEST) -> bool:
    return conventions.native_id(point, "sglang", num_layers, family, sglang_release(version)) is not None


def engine_args(target_dir: str | Path, draft_dir: str | Path, k: int, dtype: str = "bfloat16",
                tp_size: int = 1) -> dict:
    """Keyword arguments for ``sglang.Engine`` serving ``draft_dir`` as an EAGLE-3 draft."""
    return {
        "model_path": str(target_dir), "speculative_algorithm": "EAGLE3",
        "speculative_draft_model_path": str(draft_dir), "speculative_num_steps": k, "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": k + 1, "dtype": dtype, "tp_size": tp_size, "skip_tokenizer_init": True,
        "disable_radix_cache": True, "enable_return_hidden_states": True, "random_seed": 0,
    }


def parse_hidden_states(meta_info: dict, seq_len: int, n_ids: int, hidden: int) -> torch.Tensor:
    """The prefill's ``[T, n_ids, H]`` aux states from one response's ``meta_info``."""
    hs = meta_info.get("hidden_states")
    if not hs:
        raise EngineError("SGLang returned no hidden_states: start the engine with enable_return_hidden_states=True "
                          "and send return_hidden_states=True")
    first = torch.as_tensor(hs[0], dtype=torch.float32)
    if first.dim() == 1:
        first = first[None]
    if tuple(first.shape) != (seq_len, n_ids * hidden):
        raise EngineError(f"SGLang returned prefill hidden states of shape {tuple(first.shape)}; expected "
                          f"{(seq_len, n_ids * hidden)} ({n_ids} aux ids x hidden {hidden}). This SGLang version "
                          "returns something else: capture with the HF engine instead")
    return first.view(seq_len, n_ids, hidden)


def acceptance_from_meta(meta_infos: list[dict], k: int) -> dict:
    """Aggregate SGLang's per-request speculative counters."""
    steps = sum(int(m.get("spec_verify_ct", 0)) for m in meta_infos)
    tokens = sum(int(m.get("completion_tokens", 0)) for m in meta_infos)
    if steps == 0:
        raise EngineError("SGLang reported spec_verify_ct = 0: speculative decoding did not run")
    reported = [float(m["spec_accept_length"]) for m in meta_infos if "spec_accept_length" in m]
    # each verify step emits the accepted drafts plus one target token
    return acceptance("sglang meta_info (spec_verify_ct, spec_accept_length)", k, steps, None,
                      accepted=tokens - steps,
                      spec_accept_length_reported=sum(reported) / len(reported) if reported else None)


def _sglang():
    try:
        import sglang
    except Exception as e:  # ImportError, or CUDA-only dependencies failing at import
        raise EngineUnavailable(f"SGLang is not usable here ({type(e).__name__}: {e}); it needs a CUDA GPU "
                                "(pip install 'sglang[all]' on the cluster image)") from None
    return sglang


def _generate(engine, prompts: list[list[int]], max_new_tokens: int, **extra) -> list[dict]:
    outs = engine.generate(input_ids=[list(p) for p in prompts],
                           sampling_params={"temperature": 0.0, "max_new_tokens": max_new_tokens}, **extra)
    return outs if isinstance(outs, list) else [outs]


def _out_ids(o: dict) -> list[int]:
    return list(o.get("output_ids") or o.get("token_ids") or [])


class SGLangEngine(TargetEngine):
    """Capture through SGLang with a stub draft carrying the capture ids; serve drafts through
    a second SGLang engine whose draft model records its fc input (``sglang_models``)."""

    name = "sglang"

    def __init__(self, model_dir: str | Path, points: list[CapturePoint], dtype: str = "bfloat16", tp_size: int = 1,
                 family: str | None = None, batch_tokens: int = 16384):
        sgl = _sglang()
        self.version = sgl.__version__
        self.model_dir = str(model_dir)
        self.dtype, self.tp_size, self.batch_tokens = dtype, tp_size, batch_tokens
        ident = target_identity(model_dir)
        self.num_layers, self.hidden_size = ident.num_layers, ident.hidden_size
        tcfg = target_config(model_dir)
        self.family = conventions.engine_family("sglang", tcfg, family)
        self.points = [p.validate_for(self.num_layers) for p in points]
        self._dir = Path(tempfile.mkdtemp(prefix="strata-sglang-stub-"))
        ordered = sorted(self.points, key=lambda p: p.sort_key(self.num_layers))
        stub = Eagle3Draft(DraftConfig.from_target(tcfg, len(ordered), tcfg.get("vocab_size", 32000)))
        export_draft(stub, self._dir / "draft", "sglang", ordered, ident, family=self.family, dtype=dtype,
                     release=self.version)
        self.order = ordered
        self.engine = sgl.Engine(**engine_args(model_dir, self._dir / "draft", 1, dtype, tp_size))

    def engine_ref(self, point: CapturePoint) -> EngineRef:
        return sglang_engine_ref(point, self.num_layers, self.family, self.version, self.tp_size)

    def plan_batches(self, lengths: list[int]) -> list[list[int]]:
        return pack_by_tokens(lengths, self.batch_tokens)

    def capture_tensors(self, sequences: list[list[int]]) -> dict[str, list[torch.Tensor]]:
        outs = _generate(self.engine, sequences, 1, return_hidden_states=True)
        per_point: dict[str, list[torch.Tensor]] = {str(p): [] for p in self.points}
        for seq, o in zip(sequences, outs, strict=True):
            states = parse_hidden_states(o["meta_info"], len(seq), len(self.order), self.hidden_size)
            for slot, p in enumerate(self.order):
                per_point[str(p)].append(states[:, slot])
        return per_point

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        return greedy(self.model_dir, prompts, max_new_tokens, self.dtype, self.tp_size)

    def serve_draft(self, draft_dir, prompts, max_new_tokens, k, feed_points=None) -> ServeResult:
        """SGLang's EAGLE3 with the draft's config as written; ``feed_points`` is ignored."""
        return serve_eagle3(self.model_dir, draft_dir, prompts, max_new_tokens, k, self.dtype, self.tp_size,
                            record_feed=True)

    def close(self) -> None:
        if getattr(self, "engine", None) is not None:
            self.engine.shutdown()
            self.engine = None
        shutil.rmtree(self._dir, ignore_errors=True)


FEED_PACKAGE = "pipeline.engines.sglang_models"


def serve_eagle3(target_dir, draft_dir, prompts, max_new_tokens: int, k: int, dtype: str = "bfloat16",
                 tp_size: int = 1, record_feed: bool = False) -> ServeResult:
    """One prompt at a time; with ``record_feed`` the draft is SGLang's own class plus a recorder
    of its fc input (loaded through SGLANG_EXTERNAL_MODEL_PACKAGE in the scheduler processes)."""
    sgl = _sglang()
    feed_dir = tempfile.mkdtemp(prefix="strata-sglang-feed-")
    saved = {k_: os.environ.get(k_) for k_ in (FEED_DIR_ENV, "SGLANG_EXTERNAL_MODEL_PACKAGE")}
    if record_feed:
        os.environ.update({FEED_DIR_ENV: feed_dir, "SGLANG_EXTERNAL_MODEL_PACKAGE": FEED_PACKAGE})
    try:
        engine = sgl.Engine(**engine_args(target_dir, draft_dir, k, dtype, tp_size))
        try:
            outs, calls = [], []
            for p in prompts:
                outs += _generate(engine, [p], max_new_tokens)
                calls.append(take_calls(feed_dir))
        finally:
            engine.shutdown()
    finally:
        for k_, v in saved.items():
            if v is None:
                os.environ.pop(k_, None)
            else:
                os.environ[k_] = v
        shutil.rmtree(feed_dir, ignore_errors=True)
    return ServeResult([_out_ids(o) for o in outs], acceptance_from_meta([o["meta_info"] for o in outs], k),
                       calls if record_feed else None)


def greedy(target_dir, prompts, max_new_tokens: int, dtype: str = "bfloat16", tp_size: int = 1) -> list[list[int]]:
    sgl = _sglang()
    engine = sgl.Engine(model_path=str(target_dir), dtype=dtype, tp_size=tp_size, skip_tokenizer_init=True,
                        disable_radix_cache=True, random_seed=0)
    try:
        return [_out_ids(o) for o in _generate(engine, prompts, max_new_tokens)]
    finally:
        engine.shutdown()
