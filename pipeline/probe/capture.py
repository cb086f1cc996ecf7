"""Every residual boundary of the target on the probe prompts, once, with its greedy tokens."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline import conventions
from pipeline.draft.target_head import TargetHead
from pipeline.identity import target_config, text_config
from schemas.capture import CapturePoint


@dataclass
class ProbeCapture:
    """Padded to the longest prompt; ``states[i]`` is boundary ``points[i]`` ([P, T, H], fp32)."""

    points: list[CapturePoint]  # r_0 .. r_N
    states: list[torch.Tensor]
    tokens: torch.Tensor  # [P, T] (0 past each prompt's end)
    lengths: torch.Tensor  # [P]
    greedy: torch.Tensor  # [P, T] the target's argmax next token at each position

    @property
    def num_layers(self) -> int:
        return len(self.points) - 1

    def index(self, point: CapturePoint) -> int:
        return self.points.index(point)


def capture_boundaries(
    target_dir: str | Path, prompts: list[list[int]], dtype: str = "float32", device: str = "cpu"
) -> ProbeCapture:
    """Run the target (HF transformers) over ``prompts`` and keep r_0..r_N and its greedy tokens."""
    from pipeline.engines.hf import HFEngine

    n = int(text_config(target_config(target_dir))["num_hidden_layers"])
    *points, final = conventions.all_boundaries(n)  # r_0 .. r_N, then the post-norm state the head reads
    engine = HFEngine(target_dir, [*points, final], dtype, device)
    try:
        got = engine.capture_tensors(prompts)
    finally:
        engine.close()
    head = TargetHead(target_dir)
    P, T = len(prompts), max(len(p) for p in prompts)
    H = got[str(points[0])][0].shape[-1]
    states = [torch.zeros(P, T, H) for _ in points]
    tokens = torch.zeros(P, T, dtype=torch.long)
    greedy = torch.full((P, T), -1, dtype=torch.long)
    for i, seq in enumerate(prompts):
        L = len(seq)
        tokens[i, :L] = torch.as_tensor(seq)
        for j, p in enumerate(points):
            states[j][i, :L] = got[str(p)][i].float()
        greedy[i, :L] = (got[str(final)][i].float() @ head.weight.T).argmax(-1)
    return ProbeCapture(points, states, tokens, torch.as_tensor([len(p) for p in prompts]), greedy)
