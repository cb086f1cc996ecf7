"""Draft-input records written inside an engine's worker process and read back by the gate.

One safetensors file per step (``token_ids``, ``positions``, ``aux``), published by rename so a
reader never sees half a file; ``token_offset`` in the metadata says whether a row's token is
the token at its position (0, vLLM) or the next one (1, SGLang's draft inputs). The writer runs
inside the engines' processes -- SGLang's live in an environment of their own -- so this module
needs only torch and safetensors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file


@dataclass
class FeedCall:
    """One step's input to the draft's fc, as the engine handed it over.

    ``token_ids[j]`` is the token at ``positions[j]`` (``token_offset`` 0), or the token after
    it (1: SGLang hands the draft the next tokens); ``aux`` is [T, n_slots * H].
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    aux: torch.Tensor
    token_offset: int = 0


def write_call(
    out: Path, index: int, token_ids: torch.Tensor, positions: torch.Tensor, aux: torch.Tensor, token_offset: int = 0
) -> None:
    if positions.dim() > 1:  # M-RoPE positions [3, T]: the text position is the first row
        positions = positions[0]
    tensors = {
        "token_ids": token_ids.detach().to("cpu", torch.int64).contiguous(),
        "positions": positions.detach().to("cpu", torch.int64).contiguous(),
        "aux": aux.detach().to("cpu", torch.float32).contiguous(),
    }
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{index:08d}.tmp"
    save_file(tensors, str(tmp), metadata={"token_offset": str(token_offset)})
    os.replace(tmp, out / f"{index:08d}.st")


def take_calls(out_dir: str | Path) -> list[FeedCall]:
    """Read and remove the calls recorded so far, in call order."""
    calls = []
    for f in sorted(Path(out_dir).glob("*.st")):
        with safe_open(str(f), framework="pt") as st:
            offset = int((st.metadata() or {}).get("token_offset", "0"))
        t = load_file(str(f))
        calls.append(FeedCall(t["token_ids"], t["positions"], t["aux"], offset))
        f.unlink()
    return calls
