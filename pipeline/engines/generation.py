"""The target's own responses, through HF transformers, vLLM or SGLang (what regeneration runs).

Every generator stops at the target's end of turn (``identity.stop_token_ids``) or the token
budget, and is deterministic for greedy decoding; sampled decoding takes one seed per prompt,
so a response does not depend on which other prompts shared its batch or its worker.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pipeline.engines.errors import EngineUnavailable
from pipeline.engines.sglang.server import SGLangServer
from pipeline.identity import stop_token_ids
from schemas.regenerate import GenerateEngineConfig, SamplingConfig

log = logging.getLogger(__name__)


class HFGenerator:
    """HF ``generate`` with the KV cache, one prompt at a time (batches would pad, and padding
    changes the arithmetic)."""

    name = "hf"

    def __init__(self, model_dir: str | Path, dtype: str, device: str):
        import transformers
        from transformers import AutoModelForCausalLM

        from pipeline.dtypes import torch_dtype

        self.version = transformers.__version__
        self.device = (
            "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
        )
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype(dtype)).to(self.device).eval()
        self.stop = sorted(stop_token_ids(model_dir))

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingConfig, seeds: list[int]
    ) -> list[list[int]]:
        out = []
        sample = sampling.temperature > 0
        for p, seed in zip(prompts, seeds, strict=True):
            if sample:
                torch.manual_seed(seed)
            ids = torch.tensor([p], device=self.device)
            kw = (
                {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p}
                if sample
                else {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
            )
            gen = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                eos_token_id=self.stop or None,
                pad_token_id=self.stop[0] if self.stop else 0,
                **kw,
            )
            out.append(gen[0, len(p) :].tolist())
        return out

    def close(self) -> None:
        self.model = None


class VLLMGenerator:
    """vLLM without speculation or capture, as a plain deployment serves the target."""

    name = "vllm"

    def __init__(self, model_dir: str | Path, e: GenerateEngineConfig):
        from pipeline.engines.vllm.engine import VLLMPlain, vllm_version

        self.version = vllm_version()
        self.engine = VLLMPlain(model_dir, e.dtype, e.tp_size, e.max_model_len)

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingConfig, seeds: list[int]
    ) -> list[list[int]]:
        return self.engine.sample(prompts, max_new_tokens, sampling.temperature, sampling.top_p, seeds)

    def close(self) -> None:
        self.engine.close()


class SGLangGenerator:
    """SGLang's HTTP server for the target alone (greedy)."""

    name = "sglang"

    def __init__(self, model_dir: str | Path, e: GenerateEngineConfig):
        self.server = SGLangServer(model_dir, e.dtype, e.tp_size, max_model_len=e.max_model_len).start()
        self.version = self.server.install.version

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingConfig, seeds: list[int]
    ) -> list[list[int]]:
        if sampling.temperature > 0:
            raise EngineUnavailable("seeded sampling through SGLang is not supported here: use hf or vllm")
        return [list(o["output_ids"]) for o in self.server.generate(prompts, max_new_tokens)]

    def close(self) -> None:
        self.server.close()


def open_generator(model_dir: str | Path, e: GenerateEngineConfig) -> HFGenerator | VLLMGenerator | SGLangGenerator:
    log.info("loading %s for generation through %s (%s)", model_dir, e.name, e.dtype)
    if e.name == "vllm":
        return VLLMGenerator(model_dir, e)
    if e.name == "sglang":
        return SGLangGenerator(model_dir, e)
    return HFGenerator(model_dir, e.dtype, e.device)
