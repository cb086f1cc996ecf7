"""Dtype names (``schemas.provenance.DType``, what configs and provenance say) to torch dtypes:
the one map; byte widths are ``schemas.provenance.DTYPE_BYTES``."""

from __future__ import annotations

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(TORCH_DTYPES)}") from None
