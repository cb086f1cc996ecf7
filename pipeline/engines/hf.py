"""HF transformers engine: forward hooks capture typed points; never output_hidden_states.

A batch is packed, not padded (``pipeline.engines.packing``): its sequences run end to end in one
row, each attending to itself alone, so the captured values equal capturing each sequence
alone. Hooks keep references to tensors the forward pass creates anyway; after the forward
they are split into byte planes on the device and copied to pinned host memory with one
synchronisation per batch.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import transformers

from pipeline.acceptance import PromptCounts, from_prompts
from pipeline.conventions.hf_hooks import decoder_parts, hook_capture_point
from pipeline.draft.export import load_draft
from pipeline.draft.speculate import TargetRunner, greedy_generate, speculative_generate
from pipeline.dtypes import torch_dtype
from pipeline.engines.base import (
    CapturedBatch,
    ServeResult,
    TargetEngine,
    captured_batch,
)
from pipeline.engines.packing import pack_by_tokens, packed_forward
from pipeline.engines.refs import hf_engine_ref
from pipeline.identity import stop_token_ids
from pipeline.store.encoding import split_planes
from schemas.capture import CapturePoint
from schemas.provenance import EngineRef

log = logging.getLogger(__name__)


class HFEngine(TargetEngine):
    """The target in HF transformers with forward hooks; serves drafts by reference speculation."""

    name = "hf"

    def __init__(
        self,
        model_dir: str | Path,
        points: list[CapturePoint],
        dtype: str = "bfloat16",
        device: str = "auto",
        attn_implementation: str = "sdpa",
        batch_tokens: int = 16384,
    ):
        from transformers import AutoModelForCausalLM

        self.version = transformers.__version__
        self.model_dir = str(model_dir)
        self.dtype = dtype
        self.device = torch.device(
            "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
        )
        self.batch_tokens = batch_tokens
        self.attn_implementation = attn_implementation
        # A target larger than one GPU is split layer-wise over the actor's GPUs.
        multi_gpu = self.device.type == "cuda" and torch.cuda.device_count() > 1
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir),
            dtype=torch_dtype(dtype),
            attn_implementation=attn_implementation,
            local_files_only=True,
            device_map="auto" if multi_gpu else None,
        )
        model.eval()
        if not multi_gpu:
            model.to(self.device)
        self.model = model
        self.base, self.layers, self.norm = decoder_parts(model)
        self.num_layers = len(self.layers)
        self.hidden_size = int(model.config.get_text_config().hidden_size)
        self.points = [p.validate_for(self.num_layers) for p in points]
        self._captured: dict[str, torch.Tensor] = {}
        self._hooks: list = []
        self._install_hooks()

    # -- hooks ------------------------------------------------------------------------
    def _install_hooks(self) -> None:
        for p in self.points:
            self._hooks.append(hook_capture_point(self.layers, self.norm, p, self._captured, str(p)))

    def engine_ref(self, point: CapturePoint) -> EngineRef:
        return hf_engine_ref(point, self.num_layers)

    def plan_batches(self, lengths: list[int]) -> list[list[int]]:
        return pack_by_tokens(lengths, self.batch_tokens)

    # -- forward ----------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, sequences: list[list[int]]) -> None:
        """Bare packed forward through the decoder stack (the benchmark baseline; no LM head)."""
        packed_forward(self.model, self.base, sequences, self.device)
        self._captured.clear()

    @torch.inference_mode()
    def capture(self, sequences: list[list[int]]) -> CapturedBatch:
        if self.attn_implementation != "sdpa":  # packing is SDPA's; other kernels run one sequence at a time
            return captured_batch(self.capture_tensors, sequences, self.dtype)
        self._captured.clear()
        t0 = time.perf_counter()
        packed_forward(self.model, self.base, sequences, self.device)
        t1 = time.perf_counter()
        on_gpu = self.device.type == "cuda"
        planes: dict[str, torch.Tensor] = {}
        devices = set()
        for p in self.points:
            key = str(p)
            t = self._captured.pop(key)
            devices.add(t.device)
            dev_planes = split_planes(t[0].to(torch_dtype(self.dtype)))  # [B, sum T, H] uint8, batch order
            if on_gpu:
                host = torch.empty(dev_planes.shape, dtype=torch.uint8, pin_memory=True)
                host.copy_(dev_planes, non_blocking=True)
                planes[key] = host
            else:
                planes[key] = dev_planes
        if on_gpu:
            for d in devices:  # one sync per batch (per GPU the model spans), not per layer
                torch.cuda.current_stream(d).synchronize()
        self._captured.clear()
        return CapturedBatch(
            lengths=[len(s) for s in sequences],
            planes={k: v.numpy() for k, v in planes.items()},
            seconds={"forward": t1 - t0, "byte_split": time.perf_counter() - t1},
        )

    @torch.inference_mode()
    def capture_tensors(self, sequences: list[list[int]]) -> dict[str, list[torch.Tensor]]:
        """One sequence per forward (no padding in the batch: exactly what serving one request sees)."""
        out: dict[str, list[torch.Tensor]] = {str(p): [] for p in self.points}
        for seq in sequences:
            self._captured.clear()
            ids = torch.as_tensor([seq], dtype=torch.long, device=self.device)
            self.base(input_ids=ids, use_cache=False)
            for p in self.points:
                out[str(p)].append(self._captured.pop(str(p))[0].to("cpu"))
        self._captured.clear()
        return out

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        return [greedy_generate(self.model, p, max_new_tokens, self.stop_ids) for p in prompts]

    @property
    def stop_ids(self) -> frozenset[int]:
        """The target's end-of-turn tokens (generation config, else model config), where vLLM
        and SGLang stop too."""
        return stop_token_ids(self.model_dir)

    def serve_draft(self, draft_dir, prompts, max_new_tokens, k, feed_points=None) -> ServeResult:
        """Strata's reference speculative decoding; HF has no reading rules, so it feeds ``feed_points``."""
        if not feed_points:
            raise ValueError("the HF engine serves a draft with the points it is told to feed: pass feed_points")
        draft = load_draft(draft_dir, self.model_dir, dtype=torch_dtype(self.dtype))
        runner = TargetRunner(self.model, feed_points)
        try:
            runs = [speculative_generate(runner, draft, p, max_new_tokens, k, self.stop_ids) for p in prompts]
        finally:
            runner.close()
        counts = [PromptCounts(r.verify_steps, tuple(r.accepted_per_pos)) for r in runs]
        return ServeResult(
            [r.tokens for r in runs], from_prompts("reference (HF target + Strata draft)", k, counts), None
        )

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
