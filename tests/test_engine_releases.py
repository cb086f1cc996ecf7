"""The versioned reading rules, release by release, on deep targets.

The table is derived from the wheels (``test_derive_rules.py`` re-derives the newest releases);
the expectations here are written from the released sources (quoted in each test),
independently of the derivation: ``set_eagle3_layers_to_capture`` bodies for SGLang, the
runners' ``get_eagle3_aux_layers_from_config`` and ``config/vllm.py``'s runner choice for vLLM.
"""

import pytest

from pipeline import conventions as cv
from pipeline.conventions import releases as R
from pipeline.validate import checks
from schemas.capture import CapturePoint as C
from schemas.validation import ServingConfig

O, E, PRE = C.layer_output, C.embedding(), C.final("pre")  # noqa: E741
N = 61  # DeepSeek-V3 / Kimi-K2(.5)


def loop(*ks):
    """Points for loop indices / boundaries r_k."""
    return [cv.boundary_point(k, N) for k in ks]


def nested(ids):
    return {"eagle_config": {cv.AUX_KEY: ids}}


# -- SGLang deepseek_v2: the incident's ids ------------------------------------------------------
def test_incident_ids_on_sglang_before_and_after_0_5_13():
    # 0.5.5-0.5.12: `layers_to_capture = [val + 1 for val in layer_ids]`
    for rel in ("0.5.5", "0.5.12", "0.5.12.post1"):
        assert cv.points_read_from([2, 30, 58], "sglang", N, "deepseek_v2", rel) == loop(3, 31, 59), rel
    # >= 0.5.13: `if layer_ids and layer_ids[0] == 1: +1 else: list(layer_ids)`
    for rel in ("0.5.13", "0.5.23"):
        assert cv.points_read_from([2, 30, 58], "sglang", N, "deepseek_v2", rel) == loop(2, 30, 58), rel
        assert cv.points_read_from([1, 29, 57], "sglang", N, "deepseek_v2", rel) == loop(2, 30, 58), rel
    # The same tensors need different ids per release, and each reads back as written.
    want = loop(3, 31, 59)
    old = cv.aux_ids_for(want, "sglang", N, "deepseek_v2", "0.5.12")
    new = cv.aux_ids_for(want, "sglang", N, "deepseek_v2", "0.5.13")
    assert old == [2, 30, 58] and new == [3, 31, 59]
    assert cv.points_read_from(new, "sglang", N, "deepseek_v2", "0.5.12") == loop(4, 32, 60) != want


def test_architectures_decide_the_rule_and_wrappers_without_a_hook_cannot_serve():
    assert (
        cv.engine_family("sglang", {"architectures": ["KimiK25ForConditionalGeneration"]})
        == "KimiK25ForConditionalGeneration"
    )
    assert cv.engine_family("vllm", {"model_type": "deepseek_v3"}) == "DeepseekV3ForCausalLM"  # no architectures
    assert cv.engine_family("sglang", {"architectures": ["X"]}, "deepseek_v2") == "DeepseekV2ForCausalLM"  # forced
    # Kimi-K2.5's wrapper delegates to DeepseekV3ForCausalLM: the same rule, from 0.5.10 only (0.5.9's
    # kimi_k25.py has no set_eagle3_layers_to_capture: SGLang raises at startup).
    assert cv.points_read_from([1, 29, 57], "sglang", N, "KimiK25ForConditionalGeneration", "0.5.23") == loop(2, 30, 58)
    with pytest.raises(cv.ConventionError, match=r"sglang 0.5.9 KimiK25ForConditionalGeneration cannot serve EAGLE-3"):
        cv.points_read_from([1, 29, 57], "sglang", N, "KimiK25ForConditionalGeneration", "0.5.9")
    with pytest.raises(cv.ConventionError, match="Qwen2ForCausalLM cannot serve EAGLE-3"):  # qwen2.py before 0.5.2
        cv.points_read_from([1, 29, 57], "sglang", N, "Qwen2ForCausalLM", "0.5.1")
    # SGLang's mistral3 / llava wrappers have no hook in any release: no rule, and the message says why.
    for arch in ("Mistral3ForConditionalGeneration", "LlavaForConditionalGeneration"):
        with pytest.raises(cv.ConventionError, match="cannot serve EAGLE-3 for it in any derived release"):
            cv.engine_family("sglang", {"architectures": [arch]})


def test_vllm_wrappers_that_hand_the_ids_to_the_checkpoints_text_model_use_its_rule():
    """vLLM's Llava / Mistral3 / Pixtral build their language model from the checkpoint's
    ``text_config`` (no ``architectures`` in the code): the derivation runs the wrapper's released
    ``set_aux_hidden_state_layers`` on a stand-in text model and finds the ids handed on unchanged,
    so the text architecture's row decides -- from the release that made the wrapper SupportsEagle3."""

    def cfg(wrapper, text):
        return {"architectures": [wrapper], "text_config": {"architectures": [text]}}

    assert cv.engine_family("vllm", cfg("LlavaForConditionalGeneration", "LlamaForCausalLM")) == "LlamaForCausalLM"
    assert (
        cv.engine_family("vllm", cfg("Mistral3ForConditionalGeneration", "MistralForCausalLM")) == "MistralForCausalLM"
    )
    family = cv.engine_family("vllm", cfg("PixtralForConditionalGeneration", "MistralForCausalLM"))
    assert cv.points_read_from([2, 30, 58], "vllm", N, family, "0.33.0") == loop(2, 30, 58)
    wrappers = [
        r for r in cv.releases.RULES if r.engine == "vllm" and r.architecture == "LlavaForConditionalGeneration"
    ]
    assert wrappers and all(r.text_model for r in wrappers)
    assert min(cv.releases.release_tuple(r.first) for r in wrappers) > (0, 14, 0)  # 0.14 Llava: not SupportsEagle3
    with pytest.raises(cv.ConventionError, match="text_config names \\(NoSuchForCausalLM\\)"):
        cv.engine_family("vllm", cfg("LlavaForConditionalGeneration", "NoSuchForCausalLM"))


def test_sglang_qwen3_vl_language_model_captures_the_embedding_through_its_base_layers():
    """0.5.23's Qwen3-VL family loops in qwen3_vl.py over qwen3.py's layers, which hand the collector
    to the shared attention-boundary ``prepare`` (it captures the embedding at layer 0)."""
    for arch in ("Qwen3VLForConditionalGeneration", "Qwen3_5ForConditionalGeneration"):
        assert cv.points_read_from([-1, 29], "sglang", N, arch, "0.5.23") == [E, O(29)]


def test_embedding_via_minus_one_by_release():
    # qwen2/qwen3: `hidden_states + residual if residual is not None else hidden_states` (all releases)
    for rel in ("0.5.2", "0.5.23"):
        assert cv.points_read_from([-1, 29], "sglang", N, "Qwen2ForCausalLM", rel) == [E, O(29)]
    # qwen3_moe: the layer's prepare_attn sets the residual at layer 0 before it is captured
    assert cv.points_read_from([-1, 29], "sglang", N, "Qwen3MoeForCausalLM", "0.5.23") == [E, O(29)]
    # llama: `hidden_states + residual` at layer 0 raises until 0.5.22
    with pytest.raises(cv.ConventionError, match=r"the embedding \(r_0\)"):
        cv.points_read_from([-1, 29], "sglang", N, "llama", "0.5.21")
    assert cv.points_read_from([-1, 29], "sglang", N, "llama", "0.5.22") == [E, O(29)]
    # deepseek: capturable from 0.5.14; there the list is read as loop indices (first id != 1)
    with pytest.raises(cv.ConventionError, match="the embedding"):
        cv.aux_ids_for([E, O(29)], "sglang", N, "deepseek_v2", "0.5.13")
    assert cv.aux_ids_for([E, O(29)], "sglang", N, "deepseek_v2", "0.5.14") == [0, 30]
    with pytest.raises(cv.ConventionError, match="r_-1"):  # -1 is no loop index for deepseek
        cv.points_read_from([-1, 29], "sglang", N, "deepseek_v2", "0.5.14")


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM", "GptOssForCausalLM"])
def test_sglang_feeds_loop_order_each_once(arch):
    """Aux states are appended inside the layer loop: a permuted list feeds ascending order."""
    rel = "0.5.23"
    ids = [29, 1, 57]
    assert cv.points_read_from(ids, "sglang", N, arch, rel) == sorted(
        cv.points_read_from(sorted(ids), "sglang", N, arch, rel), key=lambda p: cv.boundary(p, N)
    )
    repeated = ids[:1] * 2 + ids[1:]
    assert cv.points_read_from(repeated, "sglang", N, arch, rel) == cv.points_read_from(ids, "sglang", N, arch, rel)


def test_sglang_deepseek_refuses_repeated_ids_from_0_5_17_and_empty_means_nothing():
    # 0.5.17: `aux_hidden_states = AuxHiddenStatePacker(len(self.layers_to_capture))` -- fewer captures raise
    assert cv.points_read_from([30, 30, 58], "sglang", N, "deepseek_v2", "0.5.16") == loop(30, 58)
    with pytest.raises(cv.ConventionError, match="fails at startup on repeated ids"):
        cv.points_read_from([30, 30, 58], "sglang", N, "deepseek_v2", "0.5.17")
    # `if layer_ids is None: default` -- [] is a list: layers_to_capture = [], nothing is captured
    with pytest.raises(cv.ConventionError, match="capture nothing"):
        cv.points_read_from([], "sglang", N, "llama", "0.5.23")
    assert cv.points_read_from([], "vllm", N, "llama", "0.33.0") == loop(2, 30, 58)  # vLLM: `if not layer_ids`


def test_use_aux_hidden_state_false_is_a_verdict():
    cfg = {cv.AUX_KEY: [2, 30, 58], "eagle_config": {cv.AUX_KEY: [1, 29, 57], "use_aux_hidden_state": False}}
    for engine in ("sglang", "vllm"):
        with pytest.raises(cv.ConventionError, match="use_aux_hidden_state: false"):
            cv.ids_in_draft_config(cfg, engine, "newest")


@pytest.mark.parametrize(
    "arch",
    [
        "Glm4MoeForCausalLM",
        "Glm4MoeLiteForCausalLM",
        "Glm5NextForConditionalGeneration",
        "Qwen2MoeForCausalLM",
        "Qwen3NextForCausalLM",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3VLForConditionalGeneration",
        "Qwen3VLMoeForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration",
        "MiniMaxM2ForCausalLM",
        "MiniMaxM3SparseForCausalLM",
        "MiniMaxM3SparseForConditionalGeneration",
        "Gemma3ForCausalLM",
        "Gemma4ForCausalLM",
        "LongcatFlashForCausalLM",
        "BailingMoeV2ForCausalLM",
        "ExaoneMoEForCausalLM",
        "ApertusForCausalLM",
        "Llama4ForConditionalGeneration",
        "DeepseekV32ForCausalLM",
        "GlmMoeDsaForCausalLM",
        "MistralLarge3ForCausalLM",
        "Phi3ForCausalLM",
        "InternLM3ForCausalLM",
    ],
)
def test_newest_sglang_families_have_derived_rules(arch):
    rule = R.rule_for("sglang", "0.5.23", arch)
    assert rule.serves and rule.source.startswith("sglang 0.5.23 ") and "set_eagle3_layers_to_capture" in rule.source


def test_sglang_family_specifics_the_derivation_found():
    # glm4_moe_lite uses deepseek's `layer_ids[0] == 1` test; glm4_moe plain +1
    assert cv.points_read_from([2, 30, 58], "sglang", N, "Glm4MoeLiteForCausalLM", "0.5.23") == loop(2, 30, 58)
    assert cv.points_read_from([2, 30, 58], "sglang", N, "Glm4MoeForCausalLM", "0.5.23") == loop(3, 31, 59)
    # minimax_m3_vl adds 1 to its default too; minimax_m3 captures r_N after its last layer
    assert cv.points_read_from(None, "sglang", N, "MiniMaxM3SparseForConditionalGeneration", "0.5.23") == loop(
        3, 31, 59
    )
    assert cv.points_read_from([1, 29, N - 1], "sglang", N, "MiniMaxM3SparseForCausalLM", "0.5.23") == loop(2, 30, N)
    # gemma3/4 capture r_N (`if num_layers in self.layers_to_capture` after the loop)
    assert cv.points_read_from([1, N - 1], "sglang", N, "Gemma3ForCausalLM", "0.5.23") == loop(2, N)


# -- vLLM: releases and runners ------------------------------------------------------------------
def test_vllm_keys_by_release_and_runner():
    top_and_nested = {cv.AUX_KEY: [2, 30, 58], **nested([1, 29, 57])}
    only_nested = nested([1, 29, 57])
    assert cv.ids_in_draft_config(top_and_nested, "vllm", "0.33.0")[0] == [2, 30, 58]
    # V1 runner: nested fallback from 0.22 (`if eagle_config and isinstance(eagle_config, dict)`)
    assert cv.ids_in_draft_config(only_nested, "vllm", "0.22.0")[0] == [1, 29, 57]
    assert cv.ids_in_draft_config(only_nested, "vllm", "0.21.0")[0] is None
    # Model Runner V2 never reads the nested eagle ids: the model's default
    assert cv.ids_in_draft_config(only_nested, "vllm", "0.33.0", runner="v2")[0] is None
    assert cv.points_read_from(None, "vllm", N, "llama", "0.33.0", "v2") == loop(2, 30, 58)
    # ...but both fall back to DFlash's `target_layer_ids` (+1: "convert DFlash's aux layer id semantics")
    dflash = {"dflash_config": {"target_layer_ids": [1, 29, 57]}}
    assert cv.ids_in_draft_config(dflash, "vllm", "0.33.0", runner="v2")[0] == [2, 30, 58]
    dspark = {"dspark_target_layer_ids": [1, 29, 57]}
    assert cv.ids_in_draft_config(dspark, "vllm", "0.33.0", runner="v2")[0] == [2, 30, 58]
    assert cv.ids_in_draft_config(dspark, "vllm", "0.33.0", runner="v1")[0] is None
    assert cv.ids_in_draft_config({"eagle_config": {"layer_ids": [2, 30, 58]}}, "vllm", "0.33.0", runner="v2")[0] == [
        2,
        30,
        58,
    ]
    # 0.11 ignores the draft's ids altogether
    assert cv.points_read_from([5, 6, 7], "vllm", N, "llama", "0.11.0") == loop(2, 30, 58)
    with pytest.raises(cv.ConventionError, match="no id list makes vllm 0.11.0"):
        cv.aux_ids_for(loop(3, 31, 59), "vllm", N, "llama", "0.11.0")


def test_vllm_capture_range_by_release():
    # 0.17 llama: `if idx in self.aux_hidden_state_layers: aux_hidden_states.append(hidden_states + residual)`
    # before each layer -- id 0 raises (residual None) and r_N is never captured.
    with pytest.raises(cv.ConventionError, match=r"the embedding \(r_0\)"):
        cv.points_read_from([0, 30, 58], "vllm", N, "llama", "0.17.0")
    with pytest.raises(cv.ConventionError, match="pre-norm final"):
        cv.points_read_from([2, 30, N], "vllm", N, "llama", "0.17.0")
    # newest llama: `_maybe_add_hidden_state` before the loop (0) and after every layer (idx + 1)
    assert cv.points_read_from([0, 30, N], "vllm", N, "llama", "0.33.0") == [E, *loop(30, N)]
    # deepseek_v2: no embedding; r_N from 0.25 (`if self.end_layer in self.aux_hidden_state_layers`)
    with pytest.raises(cv.ConventionError, match=r"the embedding \(r_0\)"):
        cv.points_read_from([0, 30, 58], "vllm", N, "deepseek_v2", "0.33.0")
    with pytest.raises(cv.ConventionError, match="pre-norm final"):
        cv.points_read_from([2, 30, N], "vllm", N, "DeepseekV3ForCausalLM", "0.24.0")
    assert cv.points_read_from([2, 30, N], "vllm", N, "DeepseekV3ForCausalLM", "0.25.0") == loop(2, 30, N)


def test_unknown_release_is_refused_naming_the_known_ranges():
    with pytest.raises(R.UnknownRelease, match=r"vllm 0.40.0 .*known: vllm 0.11.0"):
        cv.points_read_from([2, 30, 58], "vllm", N, "llama", "0.40.0")
    with pytest.raises(R.UnknownRelease, match=r"sglang 0.6.0 \(DeepseekV2ForCausalLM\).*derive --engine sglang"):
        cv.points_read_from([2, 30, 58], "sglang", N, "deepseek_v2", "0.6.0")
    # A release the table knows cannot serve EAGLE-3 for the architecture is a verdict, not "unknown".
    with pytest.raises(
        cv.ConventionError,
        match=r"sglang 0.4.9-0.5.4 DeepseekV2ForCausalLM cannot serve EAGLE-3: "
        r"DeepseekV2ForCausalLM has no set_eagle3_layers_to_capture",
    ):
        cv.points_read_from([2, 30, 58], "sglang", N, "deepseek_v2", "0.5.4")
    with pytest.raises(R.UnknownRelease, match="cannot read release"):
        R.release_tuple("latest")


def spec(**kw):
    return ServingConfig.model_validate({"engine": "vllm", "target": {"path": "/nonexistent"}, **kw})


def test_runner_ambiguity_is_a_reason_and_pinning_resolves_it():
    trained = loop(1, 29, 57)
    cfg = nested([1, 29, 57])  # an SGLang-format config handed to vLLM
    auto = checks.rule_readings(spec(), "0.33.0", "llama", cfg, N)
    assert [r.rule.runner for r in auto] == ["v1", "v2"]
    assert [r.points for r in auto] == [loop(1, 29, 57), loop(2, 30, 58)]
    reasons = checks.reading_rule(auto, trained, "vllm", "config.json", N).reasons
    assert any("V2 runner) reads config.json differently" in x and "serving.vllm_runner" in x for x in reasons)
    pinned = checks.rule_readings(spec(vllm_runner="v1"), "0.33.0", "llama", cfg, N)
    assert checks.reading_rule(pinned, trained, "vllm", "config.json", N).reasons == []
    # Top-level ids (what strata export writes) read the same on both runners: no reason.
    both = checks.rule_readings(spec(), "0.33.0", "llama", {cv.AUX_KEY: [1, 29, 57]}, N)
    assert checks.reading_rule(both, trained, "vllm", "config.json", N).reasons == []


def test_v2_is_the_gpu_default_per_architecture_long_before_0_28():
    """config/vllm.py: DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES = {"Qwen3ForCausalLM"} in 0.22 (dense only:
    `return not model_config.is_moe ...`); Llama joins in 0.24; from 0.25 every dense model."""

    def runners(rel, arch, moe=False):
        return [r.rule.runner for r in checks.rule_readings(spec(), rel, arch, nested([1, 29, 57]), N, moe)]

    assert runners("0.21.0", "Qwen3ForCausalLM") == ["v1"]
    assert runners("0.22.0", "Qwen3ForCausalLM") == ["v1", "v2"] and runners("0.22.0", "LlamaForCausalLM") == ["v1"]
    assert runners("0.24.0", "LlamaForCausalLM") == ["v1", "v2"]
    assert runners("0.25.0", "Qwen3ForCausalLM") == ["v1", "v2"]
    # A nested-only config on vLLM 0.24 with vllm_runner: auto is blocked: V2 silently uses its default.
    auto = checks.rule_readings(spec(), "0.24.0", "LlamaForCausalLM", nested([1, 29, 57]), N)
    reasons = checks.reading_rule(auto, loop(1, 29, 57), "vllm", "config.json", N).reasons
    assert any("vllm 0.24.0 LlamaForCausalLM (V2 runner)" in x and "default" in x for x in reasons), reasons


def test_feed_vs_rule_names_each_disagreement():
    rule = R.rule_for("vllm", "0.33.0", "llama", "v1")
    lines = checks.feed_vs_rule(loop(3, 30, 58), loop(2, 30, 58), rule, N)
    assert lines == [
        f"{rule.name} feeds o_2 (r_3) to slot 0; Strata's rule table predicted o_1 (r_2) ({rule.source}): fix the table"
    ]


def test_slot_count_the_engines_can_load():
    # SGLang llama_eagle3.py: `hidden_size_in * 3` up to 0.5.11; from 0.5.12 `num_aux_hidden_states`
    assert not R.serves_slots("sglang", "0.5.11", 2) and R.serves_slots("sglang", "0.5.12", 2)
    assert R.serves_slots("sglang", "0.5.11", 3)
    # vLLM llama_eagle3.py: `hidden_size * 3` up to 0.21; from 0.22 from the config
    assert not R.serves_slots("vllm", "0.21.0", 4) and R.serves_slots("vllm", "0.22.0", 4)


def test_every_rule_cites_its_release_and_file():
    for rule in R.RULES:
        assert rule.source.startswith(f"{rule.engine} {rule.last} ") and ".py" in rule.source, rule
        assert R.release_tuple(rule.first) <= R.release_tuple(rule.last)
        assert rule.serves or rule.why, rule


@pytest.mark.parametrize(
    "engine, release, where", [("vllm", "0.33.0", "top"), ("vllm", "0.21.0", "top"), ("sglang", "0.5.23", "nested")]
)
def test_corrected_config_is_read_back_as_the_trained_points(engine, release, where):
    """The cost table's 'correct ids' row: the served config with the ids the release needs,
    everything else kept, read back through the same rule."""
    from pipeline import conventions
    from schemas.capture import CapturePoint

    points = [CapturePoint.parse(p) for p in ("layer_output:1", "layer_output:5", "layer_output:8")]
    served = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "eagle_aux_hidden_state_layer_ids": [0, 2, 6],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 6], "use_aux_hidden_state": True},
    }
    fixed = conventions.draft_config_feeding(served, points, engine, 12, "llama", release)
    ids, key = conventions.ids_in_draft_config(fixed, engine, release, "llama")
    assert conventions.points_read_from(ids, engine, 12, "llama", release) == points
    assert fixed["architectures"] == served["architectures"] and served["eagle_aux_hidden_state_layer_ids"] == [0, 2, 6]
    assert key.startswith("eagle_config.") == (where == "nested")
    with pytest.raises(conventions.ConventionError):  # no engine feeds the post-norm final state
        conventions.draft_config_feeding(
            served, [*points[:2], CapturePoint.parse("final:post_norm")], engine, 12, "llama", release
        )
