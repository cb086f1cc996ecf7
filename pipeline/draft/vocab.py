"""Draft vocabulary: the most frequent target tokens where loss_mask=1, sorted by id.

``d2t[i] = token_i - i`` (target_id = draft_id + d2t[draft_id], the offset form vLLM and
SGLang read); ``t2d`` is a bool mask over the target vocab.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def count_trained_tokens(samples: Iterable[tuple[torch.Tensor, torch.Tensor]], vocab_size: int) -> torch.Tensor:
    """Token frequencies over (input_ids, loss_mask) pairs, assistant tokens only."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in samples:
        counts += torch.bincount(ids[mask.bool()], minlength=vocab_size)[:vocab_size]
    return counts


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token ids sorted ascending, d2t offsets, t2d mask). Ties broken by lower id."""
    v = counts.numel()
    k = min(draft_vocab_size, v)
    # Stable: sort by (-count, id) so the choice is deterministic.
    order = sorted(range(v), key=lambda t: (-int(counts[t]), t))[:k]
    ids = torch.tensor(sorted(order), dtype=torch.long)
    d2t = ids - torch.arange(k, dtype=torch.long)
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[ids] = True
    return ids, d2t, t2d
