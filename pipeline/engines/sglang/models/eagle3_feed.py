"""SGLang's own EAGLE-3 draft, plus a record of the aux states entering its ``fc``.

Same class name as SGLang's ``LlamaForCausalLMEagle3``, so the draft's config.json is served
unchanged (architecture, ids, everything). The subclass adds one forward pre-hook on the
draft's decoder: when ``forward_batch.spec_info.hidden_states`` is the target's aux
concatenation (wider than the draft's hidden size, i.e. what ``fc`` is about to read), it
writes those rows with their positions and input tokens (SGLang feeds the draft the *next*
token at each position: ``token_offset=1``) to ``$STRATA_SGLANG_FEED_DIR``. On CPU (no CUDA graphs) every prefill and
verify step is seen; on a GPU, steps replayed from a CUDA graph run no Python and are not, so the
report says how many verify rows were recorded.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import torch
from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3 as _SGLangEagle3

from pipeline.engines.feed_files import write_call
from pipeline.engines.sglang.models import FEED_DIR_ENV


class LlamaForCausalLMEagle3(_SGLangEagle3):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        out = os.environ.get(FEED_DIR_ENV)
        if out and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
            calls = itertools.count()
            hidden = self.config.hidden_size

            def record(_module, args, kwargs):
                input_ids, positions, forward_batch = (
                    list(args) + [kwargs.get("input_ids"), kwargs.get("positions"), kwargs.get("forward_batch")]
                )[:3]
                aux = getattr(getattr(forward_batch, "spec_info", None), "hidden_states", None)
                if aux is not None and aux.shape[-1] != hidden and aux.shape[0] == input_ids.shape[0]:
                    write_call(Path(out), next(calls), input_ids, positions, aux, token_offset=1)

            self.model.register_forward_pre_hook(record, with_kwargs=True)


EntryClass = [LlamaForCausalLMEagle3]
