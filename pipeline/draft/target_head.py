"""The target's frozen LM head (and final norm), read from its safetensors without
instantiating the target, to turn stored final states into target distributions."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from pipeline.draft.model import TargetBatch, rms_norm
from pipeline.identity import target_config, text_config

_LM_HEAD_NAMES = ("lm_head.weight",)
_EMBED_NAMES = ("model.embed_tokens.weight", "embed_tokens.weight", "model.language_model.embed_tokens.weight")
_NORM_NAMES = ("model.norm.weight", "norm.weight", "model.language_model.norm.weight")


def _find_tensor(model_dir: Path, names: tuple[str, ...]) -> torch.Tensor:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weight files")
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for n in names:
                if n in st.keys():  # safe_open has keys(), not __contains__
                    return st.get_tensor(n)
    raise KeyError(f"{model_dir}: none of {names} found in {[f.name for f in files]}")


def load_embedding(model_dir: str | Path) -> torch.Tensor:
    return _find_tensor(Path(model_dir), _EMBED_NAMES)


def load_final_norm(model_dir: str | Path):
    """The target's final norm as a function, for stores and engines that hold pre-norm r_N."""
    root = Path(model_dir)
    cfg = text_config(target_config(root))
    weight, eps = _find_tensor(root, _NORM_NAMES).float(), float(cfg.get("rms_norm_eps", 1e-5))
    return lambda r_n: rms_norm(r_n.float(), weight.to(r_n.device), eps)  # in fp32


class TargetHead:
    def __init__(self, model_dir: str | Path, needs_norm: bool = False):
        root = Path(model_dir)
        cfg = text_config(target_config(root))
        tied = cfg.get("tie_word_embeddings", False)
        self.weight = _find_tensor(root, _EMBED_NAMES if tied else _LM_HEAD_NAMES).float()
        self.norm_weight = _find_tensor(root, _NORM_NAMES).float() if needs_norm else None
        self.eps = float(cfg.get("rms_norm_eps", 1e-5))

    def to(self, device: torch.device) -> TargetHead:
        self.weight = self.weight.to(device)
        if self.norm_weight is not None:
            self.norm_weight = self.norm_weight.to(device)
        return self

    def final_norm(self, r_n: torch.Tensor) -> torch.Tensor:
        return rms_norm(r_n, self.norm_weight, self.eps)

    @torch.no_grad()
    def targets(
        self,
        final: torch.Tensor,
        loss_mask: torch.Tensor,
        draft_ids: torch.Tensor,
        chunk: int = 1024,
        soft_target: str = "draft_vocab",
    ) -> TargetBatch:
        """final [B,T,H] (post-norm, or pre-norm when built with needs_norm) -> TargetBatch.

        ``soft_target="draft_vocab"`` (SpecForge's and EAGLE's definition) renormalises the
        target over the draft vocabulary -- softmax of the draft-vocab logits -- so every
        position weighs the same and loss values compare across tools; ``"full_vocab"`` keeps
        the full-vocabulary probabilities of the draft-vocab tokens (summing to < 1).
        """
        if soft_target not in ("draft_vocab", "full_vocab"):
            raise ValueError(f"soft_target must be 'draft_vocab' or 'full_vocab' (got {soft_target!r})")
        B, T, _ = final.shape
        x = self.final_norm(final) if self.norm_weight is not None else final.float()
        t2d = torch.zeros(self.weight.shape[0], dtype=torch.bool, device=final.device)
        t2d[draft_ids] = True
        p_draft = torch.empty(B, T, draft_ids.numel(), device=final.device)
        greedy = torch.empty(B, T, dtype=torch.long, device=final.device)
        flat = x.reshape(B * T, -1)
        for s in range(0, B * T, chunk):  # never holds [B*T, V] at once
            logits = flat[s : s + chunk] @ self.weight.T
            greedy.view(-1)[s : s + chunk] = logits.argmax(-1)
            p_draft.view(B * T, -1)[s : s + chunk] = (
                logits[:, draft_ids].softmax(-1) if soft_target == "draft_vocab" else logits.softmax(-1)[:, draft_ids]
            )
        return TargetBatch(p_draft=p_draft, greedy=greedy, in_draft_vocab=t2d[greedy], trained=loss_mask.bool())
