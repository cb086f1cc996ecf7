"""Packed forwards: several sequences end to end in one row, never padded.

Each sequence keeps its own positions and attends causally to itself alone, through HF's own
SDPA call on its slice -- exactly the call it gets when it runs alone -- so no compute goes to
padding or to attention across sequences, and the values equal a lone forward's bit for bit
wherever the matmuls round a row the same inside a larger matrix (always in bf16 here; see
``tests/test_hf_engine.py``). Needs only torch and transformers (GPU benchmark boxes may lack
the rest).
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import lru_cache
from itertools import pairwise

import torch

PACKED_SDPA = "strata_packed_sdpa"


def pack_by_tokens(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Consecutive samples, in order, while their tokens fit the budget (a longer sample runs
    alone). Nothing is padded, so real tokens are what a batch costs."""
    batches: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i, length in enumerate(lengths):
        if cur and used + length > batch_tokens:
            batches.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += length
    if cur:
        batches.append(cur)
    return batches


def packed_sdpa(module, query, key, value, attention_mask, cu_seq_lens_q=None, cu_seq_lens_k=None, **kwargs):
    """SDPA for sequences packed end to end (boundaries in ``cu_seq_lens_q``), one call per
    sequence on its slice. Without boundaries this is plain SDPA."""
    # imported here: the module costs ~2 s, which a driver that never loads a model should not pay
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    outs = [
        sdpa_attention_forward(module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], None, **kwargs)[0]
        for s, e in pairwise(cu_seq_lens_q.tolist())
    ]
    return torch.cat(outs, dim=1), None


@lru_cache(maxsize=1)
def register_packed_sdpa() -> None:
    """Make :func:`packed_sdpa` an attention implementation transformers can dispatch to."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_SDPA, packed_sdpa)


@contextmanager
def packed_attention(model):
    """Route ``model``'s attention through :func:`packed_sdpa` for the forwards inside; decoding
    and serving keep the implementation the model was loaded with."""
    register_packed_sdpa()
    configs = {id(c): c for c in (model.config, model.config.get_text_config())}.values()
    before = [c._attn_implementation for c in configs]
    for c in configs:
        c._attn_implementation = PACKED_SDPA
    try:
        yield
    finally:
        for c, impl in zip(configs, before, strict=True):
            c._attn_implementation = impl


def packed_forward(model, decoder, sequences: list[list[int]], device: torch.device) -> None:
    """``decoder`` (the model's decoder stack, no LM head) over ``sequences`` end to end in one row."""
    lengths = torch.tensor([len(s) for s in sequences])
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long)[None]
    positions = torch.cat([torch.arange(n) for n in lengths.tolist()])[None]
    bounds = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])
    with packed_attention(model):
        decoder(
            input_ids=ids.to(device, non_blocking=True),
            position_ids=positions.to(device, non_blocking=True),
            use_cache=False,
            cu_seq_lens_q=bounds,
            cu_seq_lens_k=bounds,
        )
