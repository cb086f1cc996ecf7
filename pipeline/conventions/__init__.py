"""The only package that turns typed capture points into engines' integer layer ids.

Every engine numbers the residual stream differently. For N decoder layers ``r_k`` is the
stream entering layer k (``r_0`` the embedding output, ``r_N`` the last layer's output before
the final norm), ``o_j = r_{j+1}`` is the output of layer j, and ``final_post = norm(r_N)`` is
what the LM head reads:

================  =================================================  ======================
tool              integer k means                                    default EAGLE-3 aux
================  =================================================  ======================
hf                hidden_states[k] = r_k, k<N; [N] is POST-norm      --
vllm, sglang      by release, architecture, runner: ``releases``     r[2, N//2, N-3]
specforge/modelopt/trtllm  o_j                                       o[1, N//2-1, N-4]
eagle (SafeAILab) hard-coded, no ids                                 r[2, N//2, N-3]
================  =================================================  ======================

All defaults name the same tensors; bugs come from reading a list written in one
labelling with the other, or from an engine release that changed its rule. Nothing outside
this package may do arithmetic on layer ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pipeline.conventions import releases
from pipeline.conventions.boundaries import (
    boundary,
    eagle3_default,
    position,
    same_tensor,
    sort_key,
)
from pipeline.conventions.releases import AUX_KEY, NEWEST, ConventionError, UnknownRelease
from schemas.capture import CapturePoint

Tool = Literal["hf", "vllm", "sglang", "specforge", "modelopt", "trtllm", "eagle"]

__all__ = [
    "AUX_KEY",
    "NEWEST",
    "ConventionError",
    "UnknownRelease",
    "boundary",
    "eagle3_default",
    "position",
    "releases",
    "same_tensor",
    "sort_key",
]


def engine_family(engine: str, target_config: dict, override: str | None = "auto") -> str:
    """The architecture whose capture rule ``engine`` applies to this target (from its config.json's
    ``architectures``), unless the user forced one (``override``: an architecture or model file)."""
    if engine not in ("vllm", "sglang"):
        return "llama"
    return releases.architecture(engine, target_config, override)  # type: ignore[arg-type]


def is_moe(target_config: dict) -> bool:
    return releases.is_moe(target_config)


def hf_residual_states(hidden_states: Sequence) -> Sequence:
    """r_0 .. r_{N-1} from HF's ``output_hidden_states`` (its last entry is post-norm, not r_N)."""
    return hidden_states[:-1]


# -- boundaries -------------------------------------------------------------------------
def boundary_point(k: int, num_layers: int) -> CapturePoint:
    """The capture point equal to r_k (k = 0..N)."""
    if not 0 <= k <= num_layers:
        raise ConventionError(f"boundary r_{k} does not exist for {num_layers} layers (0..{num_layers})")
    if k == 0:
        return CapturePoint.embedding()
    return CapturePoint.layer_output(k - 1)


def boundary_label(point: CapturePoint, num_layers: int) -> str:
    """Boundary notation for a point: 'r_3', or 'final_post' for the post-norm state."""
    k = boundary(point, num_layers)
    return "final_post" if k is None else f"r_{k}"


def all_boundaries(num_layers: int) -> list[CapturePoint]:
    """r_0..r_N (as embedding, layer outputs) followed by final post-norm."""
    return [boundary_point(k, num_layers) for k in range(num_layers + 1)] + [CapturePoint.final("post")]


def describe_point(point: CapturePoint, num_layers: int) -> str:
    """A capture point in words, for messages: 'the embedding (r_0)', 'the output of layer 2 (r_3)'."""
    k = boundary(point, num_layers)
    return (
        "the post-norm final state (final_post, what the LM head reads)"
        if k is None
        else releases.describe(k, num_layers)
    )


def _r(point: CapturePoint, num_layers: int, tool: str) -> int:
    k = boundary(point, num_layers)
    if k is None:
        raise ConventionError(
            f"{tool} cannot feed a draft {describe_point(point, num_layers)}: it feeds residual-"
            "stream states before the final norm (the embedding or a layer's output)"
        )
    return k


# -- HF transformers ----------------------------------------------------------------------
def hf_hidden_states_index(point: CapturePoint, num_layers: int, last_is_post_norm: bool = True) -> int | None:
    """Index into HF ``output_hidden_states``; None when HF does not expose the point there.

    ``hidden_states[N]`` is post-norm unless ``config.tie_last_hidden_states=False``.
    """
    k = boundary(point, num_layers)
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
def native_id(
    point: CapturePoint, tool: Tool, num_layers: int, family: str = "llama", release: str = NEWEST
) -> int | None:
    """The integer ``tool`` uses for ``point`` when writing an explicit id (None: not capturable)."""
    point.validate_for(num_layers)
    try:
        return aux_ids_for([point], tool, num_layers, family, release)[0]
    except UnknownRelease:
        raise
    except ConventionError:
        return None


def native_id_convention(tool: Tool, family: str = "llama") -> str:
    if tool == "hf":
        return "hf_hidden_states_index"
    if tool == "sglang":
        return f"sglang_{releases.module_of('sglang', family)}_aux_layer_id"
    return f"{tool}_aux_layer_id"


# -- writing id lists -----------------------------------------------------------------------
def aux_ids_for(
    points: Sequence[CapturePoint],
    tool: Tool,
    num_layers: int,
    family: str = "llama",
    release: str = NEWEST,
    runner: releases.Runner | None = None,
) -> list[int]:
    """The ids to write so that ``tool`` (at ``release``) captures exactly ``points``, in slot order.

    Raises ConventionError when the tool cannot capture a point, or would read the list as
    anything else (reordered, merged, shifted), instead of writing a list it would misread.
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
    if tool in ("specforge", "modelopt", "trtllm"):
        if 0 in rs:
            raise ConventionError(f"{tool} ids are layer outputs; it cannot name the embedding (r_0)")
        return [k - 1 for k in rs]
    if tool in ("vllm", "sglang"):
        return releases.ids_to_write(releases.rule_for(tool, release, family, runner), rs, n)
    raise ConventionError(f"unknown tool {tool!r}")


def vllm_capture_plan(points: Sequence[CapturePoint], num_layers: int) -> tuple[list[int], list[int]]:
    """Ids to hand vLLM's hidden-state extraction so it captures ``points``, and the slot of each.

    vLLM captures the sorted, de-duplicated ids in ascending order ([T, n_ids, H]), so any
    requested order works: ``slots[i]`` is where ``points[i]`` lands.
    """
    rs = [_r(p.validate_for(num_layers), num_layers, "vllm") for p in points]
    ids = sorted(set(rs))
    return ids, [ids.index(k) for k in rs]


# -- reading id lists -----------------------------------------------------------------------
def default_aux_points(tool: Tool, num_layers: int) -> list[CapturePoint]:
    """What a tool captures when no ids are given (vLLM and SGLang: in loop order, each once)."""
    n = num_layers
    if tool == "hf":
        raise ConventionError("HF transformers has no EAGLE-3 default")
    rs = eagle3_default(n)
    if tool in ("specforge", "modelopt", "trtllm"):  # the same tensors, as o-labels
        return [CapturePoint.layer_output(k - 1) for k in rs]
    if tool in ("vllm", "sglang"):
        rs = sorted(set(rs))
    return [boundary_point(k, n) for k in rs]


def points_read_from(
    ids: Sequence[int] | None,
    tool: Tool,
    num_layers: int,
    family: str = "llama",
    release: str = NEWEST,
    runner: releases.Runner | None = None,
) -> list[CapturePoint]:
    """What ``tool`` (at ``release``) feeds the draft for an id list (None: the key is absent)."""
    n = num_layers
    if tool in ("vllm", "sglang"):
        rule = releases.rule_for(tool, release, family, runner)
        return [boundary_point(k, n) for k in releases.boundaries_read(rule, ids, n)]
    if ids is None or tool == "eagle":
        return default_aux_points(tool, n)
    ids = [int(i) for i in ids]
    if not ids:
        raise ConventionError(f"{tool}: an empty aux id list")
    if tool == "hf":
        return [from_hf_hidden_states_index(i, n) for i in ids]
    if tool in ("specforge", "modelopt", "trtllm"):
        return [boundary_point(j + 1, n) for j in ids]
    raise ConventionError(f"unknown tool {tool!r}")


def ids_in_draft_config(
    config: dict, tool: Tool, release: str = NEWEST, family: str = "llama", runner: releases.Runner | None = None
) -> tuple[list[int] | None, str]:
    """The id list an engine release reads from a draft's config.json, and the key it came from."""
    if tool not in ("vllm", "sglang"):
        raise ConventionError(f"draft config reading rules are defined for vllm and sglang, not {tool!r}")
    return releases.ids_in_config(releases.rule_for(tool, release, family, runner), config)


def draft_config_feeding(
    config: dict,
    points: Sequence[CapturePoint],
    tool: Tool,
    num_layers: int,
    family: str = "llama",
    release: str = NEWEST,
    runner: releases.Runner | None = None,
) -> dict:
    """``config`` with the ids that make ``tool`` (at ``release``) feed exactly ``points`` -- the
    fix for a blocked config, or a deliberate misconfiguration -- read back through the same rule."""
    rule = releases.rule_for(tool, release, family, runner)  # type: ignore[arg-type]
    out = releases.config_with_ids(rule, config, aux_ids_for(points, tool, num_layers, family, release, runner))
    read = releases.boundaries_read(rule, releases.ids_in_config(rule, out)[0], num_layers)
    if read != [_r(p, num_layers, tool) for p in points]:
        raise ConventionError(f"{rule.name} would read the corrected config as {[f'r_{k}' for k in read]}")
    return out


def releases_reading(
    config: dict, points: Sequence[CapturePoint], engine: str, family: str, num_layers: int
) -> list[str]:
    """Every known release (range) of ``engine`` that feeds exactly ``points`` for this config."""
    rs = [_r(p, num_layers, engine) for p in points]
    return [r.name for r in releases.rules_reading_as(engine, family, config, rs, num_layers)]  # type: ignore[arg-type]


# -- every reading of a config (what a draft found elsewhere may have been trained on) ---------
def readings_of_config(
    config: dict, num_layers: int, archs: dict[str, str]
) -> dict[tuple[CapturePoint, ...], list[str]]:
    """Every list of points some tool reads a draft config's ids as -- each engine release's rule for
    the target's architecture (``archs``: engine -> architecture), the training tools' and HF's
    labellings -- and every tool's default: points -> who reads them so. Readings a tool refuses
    are left out."""
    n, out = num_layers, {}

    def add(points, who: str) -> None:
        out.setdefault(tuple(points), []).append(who)

    nested = (config.get("eagle_config") or {}).get(AUX_KEY) if isinstance(config.get("eagle_config"), dict) else None
    ids = nested if nested is not None else config.get(AUX_KEY)
    for engine, arch in archs.items():
        try:
            arch = releases._resolve(engine, arch)  # type: ignore[arg-type]
        except ConventionError:
            continue
        for rule in releases.RULES:
            if rule.engine != engine or rule.architecture != arch:
                continue
            try:
                read = releases.boundaries_read(rule, releases.ids_in_config(rule, config)[0], n)
            except ConventionError:
                continue
            add([boundary_point(k, n) for k in read], rule.name)
    for tool, label in (
        ("specforge", "SpecForge/ModelOpt/TRT-LLM layer-output ids"),
        ("hf", "HF hidden_states indices"),
    ):
        if ids:
            try:
                add(points_read_from(ids, tool, n), f"{label} {list(ids)}")  # type: ignore[arg-type]
            except (ConventionError, ValueError):
                pass
    for tool in ("vllm", "sglang", "specforge"):
        add(default_aux_points(tool, n), f"{tool}'s default")  # type: ignore[arg-type]
    return out


def shifted(points: Sequence[CapturePoint], delta: int, num_layers: int) -> list[CapturePoint] | None:
    """Each point moved ``delta`` boundaries along the residual stream (None when one falls off, or
    is not on the residual stream: the post-norm final state)."""
    if any(boundary(p, num_layers) is None for p in points):
        return None
    ks = [_r(p, num_layers, "a shift") + delta for p in points]
    return [boundary_point(k, num_layers) for k in ks] if all(0 <= k <= num_layers for k in ks) else None


def evenly_spread(num_aux: int, num_layers: int) -> list[CapturePoint]:
    """``num_aux`` boundaries spread evenly between the embedding and r_N (exclusive): a start for a
    search when no reading of a config fits the draft's slot count."""
    return [boundary_point(round(i * num_layers / (num_aux + 1)), num_layers) for i in range(1, num_aux + 1)]


def embedding_inserted(points: Sequence[CapturePoint], num_layers: int) -> list[CapturePoint]:
    """The incident's misreading: the embedding first, the last point dropped."""
    return [CapturePoint.embedding(), *points[:-1]] if points else []
