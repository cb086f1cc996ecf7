"""Where a capture point lives in an HF transformers model: which module's hook sees it.

Part of the conventions package because placing a hook is layer-id arithmetic (r_k is the
output of layer k-1, r_0 the input of layer 0, r_N the final norm's input). Used by the HF
capture engine and by reference speculative decoding.
"""

from __future__ import annotations

import torch

from pipeline.conventions.boundaries import boundary
from schemas.capture import CapturePoint


def decoder_parts(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.ModuleList, torch.nn.Module]:
    base = getattr(model, "model", None) or model.base_model
    layers = getattr(base, "layers", None)
    norm = getattr(base, "norm", None)
    if layers is None or norm is None:
        raise TypeError(
            f"{type(model).__name__}: cannot find decoder layers and final norm (expected .model.layers "
            "and .model.norm, as in Llama/Qwen/Mistral); add this architecture to pipeline/conventions/hf_hooks.py"
        )
    return base, layers, norm


def hook_capture_point(
    layers: torch.nn.ModuleList,
    norm: torch.nn.Module,
    point: CapturePoint,
    store: dict,
    key,
):
    """Register the forward hook that puts ``point`` into ``store[key]`` on every forward."""
    n = len(layers)

    def save_output(_mod, _args, out):
        store[key] = out[0] if isinstance(out, tuple) else out

    def save_input(_mod, args, kwargs):
        store[key] = args[0] if args else kwargs["hidden_states"]

    k = boundary(point, n)
    if k is None:  # final post-norm: what the LM head reads
        return norm.register_forward_hook(save_output)
    if k == n:  # r_N: the final norm's input
        return norm.register_forward_pre_hook(save_input, with_kwargs=True)
    if k == 0:  # r_0: what enters layer 0 (after any embedding scaling)
        return layers[0].register_forward_pre_hook(save_input, with_kwargs=True)
    return layers[k - 1].register_forward_hook(save_output)  # r_k = o_{k-1}: output of layer k-1
