"""Every residual boundary of the target on the probe conversations, once, and the state its head reads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline import conventions
from pipeline.data.chat import Encoded
from pipeline.draft.model import TargetBatch
from pipeline.draft.target_head import TargetHead
from pipeline.identity import target_config, text_config
from schemas.capture import CapturePoint


@dataclass
class ProbeCapture:
    """Padded to the longest conversation; ``states[i]`` is boundary ``points[i]`` ([P, T, H], fp32)."""

    points: list[CapturePoint]  # r_0 .. r_N
    states: list[torch.Tensor]
    tokens: torch.Tensor  # [P, T] (0 past each conversation's end)
    lengths: torch.Tensor  # [P]
    final: torch.Tensor  # [P, T, H] the post-norm state the target's head reads
    trained: torch.Tensor  # [P, T] bool: assistant tokens, the ones a draft is trained to predict
    head: TargetHead

    @property
    def num_layers(self) -> int:
        return len(self.points) - 1

    def index(self, point: CapturePoint) -> int:
        return self.points.index(point)

    def targets(self, draft_ids: torch.Tensor) -> TargetBatch:
        """What the target says at each position, over a draft's vocabulary (as training computes it)."""
        return self.head.targets(self.final, self.trained, draft_ids)


def capture_boundaries(
    target_dir: str | Path, conversations: list[Encoded], dtype: str = "float32", device: str = "cpu"
) -> ProbeCapture:
    """Run the target (HF transformers) over the conversations and keep r_0..r_N and its predictions."""
    from pipeline.engines.hf import HFEngine

    n = int(text_config(target_config(target_dir))["num_hidden_layers"])
    *points, final = conventions.all_boundaries(n)  # r_0 .. r_N, then the post-norm state the head reads
    prompts = [c.input_ids for c in conversations]
    engine = HFEngine(target_dir, [*points, final], dtype, device)
    try:
        got = engine.capture_tensors(prompts)
    finally:
        engine.close()
    head = TargetHead(target_dir)
    P, T = len(prompts), max(len(p) for p in prompts)
    H = got[str(points[0])][0].shape[-1]
    states = [torch.zeros(P, T, H) for _ in points]
    post = torch.zeros(P, T, H)
    tokens = torch.zeros(P, T, dtype=torch.long)
    trained = torch.zeros(P, T, dtype=torch.bool)
    for i, c in enumerate(conversations):
        L = len(c.input_ids)
        tokens[i, :L] = torch.as_tensor(c.input_ids)
        trained[i, :L] = torch.as_tensor(c.loss_mask, dtype=torch.bool)
        for j, p in enumerate(points):
            states[j][i, :L] = got[str(p)][i].float()
        post[i, :L] = got[str(final)][i].float()
    lengths = torch.as_tensor([len(p) for p in prompts])
    return ProbeCapture(points, states, tokens, lengths, post, trained, head)
