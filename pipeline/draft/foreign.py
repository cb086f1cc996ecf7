"""Read an EAGLE-3 draft directory in the layouts people actually have, into Strata's draft.

- **eagle3** (SpecForge's export, SGLang's and vLLM's format): ``LlamaForCausalLMEagle3`` config,
  ids (if any) in the nested ``eagle_config`` (SGLang, SpecForge) or top-level (vLLM); weights
  ``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``/``t2d``, no embedding (SpecForge's
  exporter drops it: the target's is used).
- **speculators**: ``speculators_model_type: eagle3`` with a ``transformer_layer_config``
  and a ``speculators_config.verifier``; weights ``layers.0.*`` for ``midlayer.*``, maybe
  its own ``embed_tokens``.

``d2t`` may be absent when the draft vocab is the target vocab (vLLM refuses the parameter
then). Only safetensors are read: a pickle checkpoint can run code when loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from pipeline.conventions import AUX_KEY
from pipeline.draft.model import DraftConfig, Eagle3Draft
from pipeline.draft.target_head import load_embedding
from pipeline.errors import UnusableInput
from schemas.artifact import ARTIFACT_MANIFEST

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# Draft variants whose step-0 math differs from the reference draft's (speculators / SpecForge flags).
UNSUPPORTED_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm")


class ForeignDraftError(UnusableInput):
    pass


@dataclass
class ForeignDraft:
    """A draft read from ``directory``: the reference model, and what its config claims."""

    directory: Path
    layout: str  # "eagle3" (SpecForge's, SGLang's, vLLM's), "speculators", "strata"
    model: Eagle3Draft
    config: dict  # config.json as written
    claimed: dict[str, list[int]] = field(default_factory=dict)  # key -> ids, every key that holds some
    verifier: str | None = None  # the target the draft names (speculators' verifier)
    notes: list[str] = field(default_factory=list)

    @property
    def num_aux(self) -> int:
        return self.model.config.num_aux

    @property
    def claimed_ids(self) -> list[int] | None:
        """The ids an engine would find first (nested, then top level); None when there are none."""
        for key in (f"eagle_config.{AUX_KEY}", AUX_KEY):
            if key in self.claimed:
                return self.claimed[key]
        return None


def _weights(d: Path) -> dict[str, torch.Tensor]:
    files = sorted(d.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in d.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise ForeignDraftError(
                f"{d}: the weights are a pickle checkpoint ({', '.join(pickles)}); Strata never unpickles (loading a "
                "pickle runs code from the file). Convert it where you trust it: torch.load then "
                "safetensors.torch.save_file(state_dict, 'model.safetensors')"
            )
        raise ForeignDraftError(f"{d}: no *.safetensors weights")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        if f.name.startswith("strata_"):  # Strata's fingerprints travel beside the weights
            continue
        out.update(load_file(str(f)))
    return out


def _config(d: Path) -> dict:
    p = d / "config.json"
    if not p.exists():
        raise ForeignDraftError(f"{d}: no config.json; expected an EAGLE-3 draft directory")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ForeignDraftError(f"{p}: not JSON: {e}") from None


def _claims(cfg: dict) -> dict[str, list[int]]:
    out = {}
    nested = cfg.get("eagle_config") or {}
    if isinstance(nested, dict) and nested.get(AUX_KEY) is not None:
        out[f"eagle_config.{AUX_KEY}"] = [int(i) for i in nested[AUX_KEY]]
    if cfg.get(AUX_KEY) is not None:
        out[AUX_KEY] = [int(i) for i in cfg[AUX_KEY]]
    return out


def _layer_config(cfg: dict) -> tuple[str, dict, str | None]:
    """(layout, the decoder-layer config, the verifier it names)."""
    if cfg.get("speculators_model_type") is not None:
        if cfg["speculators_model_type"] != "eagle3":
            raise ForeignDraftError(
                f"speculators_model_type {cfg['speculators_model_type']!r}: only eagle3 drafts can be probed"
            )
        layer = cfg.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise ForeignDraftError("a speculators config without transformer_layer_config")
        verifier = ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        return "speculators", layer, verifier
    archs = cfg.get("architectures") or []
    if not any("eagle3" in a.lower() for a in archs):
        raise ForeignDraftError(
            f"config.json architectures {archs}: not an EAGLE-3 draft (expected "
            "LlamaForCausalLMEagle3 or a speculators eagle3 config)"
        )
    return "eagle3", cfg, None


def _draft_config(layout_cfg: dict, top: dict, fc_in: int) -> DraftConfig:
    hidden = int(layout_cfg["hidden_size"])
    target_hidden = int(top.get("target_hidden_size") or layout_cfg.get("target_hidden_size") or hidden)
    if fc_in % target_hidden:
        raise ForeignDraftError(
            f"fc.weight reads {fc_in} features, not a multiple of target_hidden_size {target_hidden}"
        )
    heads = int(layout_cfg["num_attention_heads"])
    rope = layout_cfg.get("rope_theta") or (layout_cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    vocab = int(layout_cfg["vocab_size"])
    return DraftConfig(
        hidden_size=hidden,
        target_hidden_size=target_hidden,
        num_aux=fc_in // target_hidden,
        intermediate_size=int(layout_cfg["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(layout_cfg.get("num_key_value_heads") or heads),
        head_dim=int(layout_cfg.get("head_dim") or hidden // heads),
        vocab_size=vocab,
        draft_vocab_size=int(top.get("draft_vocab_size") or layout_cfg.get("draft_vocab_size") or vocab),
        rms_norm_eps=float(layout_cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope),
        max_position_embeddings=int(layout_cfg.get("max_position_embeddings", 4096)),
    )


def read_draft(directory: str | Path, target_dir: str | Path) -> ForeignDraft:
    """The draft in ``directory`` as the reference model (embedding: its own if it has one, else the
    target's); ForeignDraftError naming the file and what is wrong when it cannot be read."""
    d = Path(directory)
    if not d.is_dir():
        raise ForeignDraftError(f"{d}: not a directory")
    cfg = _config(d)
    layout, layer_cfg, verifier = _layer_config(cfg)
    if (d / ARTIFACT_MANIFEST).exists():
        layout = "strata"
    flags = [f for f in UNSUPPORTED_FLAGS if cfg.get(f) or layer_cfg.get(f)]
    if flags:
        raise ForeignDraftError(
            f"{d}: the draft sets {', '.join(flags)}; the reference draft has no such variant, "
            "so its predictions would not be the served draft's"
        )
    if int(layer_cfg.get("num_hidden_layers", 1)) != 1:
        raise ForeignDraftError(f"{d}: {layer_cfg['num_hidden_layers']} draft layers; EAGLE-3 drafts here have one")
    sd = {k.replace("layers.0.", "midlayer.", 1) if k.startswith("layers.0.") else k: v for k, v in _weights(d).items()}
    if "fc.weight" not in sd:
        raise ForeignDraftError(f"{d}: no fc.weight in the safetensors; not an EAGLE-3 draft")
    try:
        c = _draft_config(layer_cfg, cfg, sd["fc.weight"].shape[1])
    except KeyError as e:
        raise ForeignDraftError(f"{d}/config.json: no {e.args[0]}") from None
    model = Eagle3Draft(c)
    notes = []
    if "d2t" not in sd:
        if c.draft_vocab_size != c.vocab_size:
            raise ForeignDraftError(
                f"{d}: draft vocab {c.draft_vocab_size} < target vocab {c.vocab_size} but no d2t mapping in the weights"
            )
        sd["d2t"] = torch.zeros(c.draft_vocab_size, dtype=torch.long)
        notes.append("no d2t: the draft vocab is the target vocab")
    if "t2d" not in sd:
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[torch.arange(c.draft_vocab_size) + sd["d2t"]] = True
        sd["t2d"] = t2d
    own_embedding = "embed_tokens.weight" in sd
    if not own_embedding:
        sd["embed_tokens.weight"] = load_embedding(target_dir)
    sd = {k: (v.float() if v.is_floating_point() else v) for k, v in sd.items()}
    try:
        missing, unexpected = model.load_state_dict(sd, strict=False)
    except RuntimeError as e:  # a shape that does not fit the config
        raise ForeignDraftError(
            f"{d}: the weights do not fit its config.json: {str(e).splitlines()[-1].strip()}"
        ) from None
    if missing or unexpected:
        raise ForeignDraftError(
            f"{d}: the weights do not fit an EAGLE-3 draft of this config: missing {missing}, unexpected {unexpected}"
        )
    notes.append("embedding: the draft's own" if own_embedding else "embedding: the target's (the draft ships none)")
    return ForeignDraft(d, layout, model.eval(), cfg, _claims(cfg), verifier, notes)
