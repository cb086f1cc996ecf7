"""The versioned reading rules, release by release, on deep targets.

Expectations are written from the released sources (quoted in each test), independently of
the rule table's encoding: ``set_eagle3_layers_to_capture`` bodies for SGLang, the runners'
``get_eagle3_aux_layers_from_config`` for vLLM.
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


def test_kimi_k25_model_type_and_text_config_wrappers():
    assert cv.engine_family("sglang", {"model_type": "kimi_k25"}) == "deepseek_v2"
    assert cv.engine_family("vllm", {"model_type": "kimi_k25"}) == "deepseek_v2"
    wrapped = {"model_type": "some_vlm_wrapper", "text_config": {"model_type": "deepseek_v3"}}
    assert cv.engine_family("sglang", wrapped) == "deepseek_v2"
    with pytest.raises(cv.ConventionError, match="model_type 'mamba'"):
        cv.engine_family("sglang", {"model_type": "mamba"})


def test_embedding_via_minus_one_by_release():
    # qwen2/qwen3: `hidden_states + residual if residual is not None else hidden_states` (all releases)
    for rel in ("0.4.9", "0.5.23"):
        assert cv.points_read_from([-1, 29], "sglang", N, "qwen", rel) == [E, O(29)]
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


@pytest.mark.parametrize("family", ["llama", "qwen", "deepseek_v2", "gpt_oss"])
def test_sglang_feeds_loop_order_each_once(family):
    """Aux states are appended inside the layer loop: a permuted list feeds ascending order."""
    rel = "0.5.23"
    ids = [29, 1, 57] if family != "deepseek_v2" else [30, 2, 58]
    assert cv.points_read_from(ids, "sglang", N, family, rel) == sorted(
        cv.points_read_from(sorted(ids), "sglang", N, family, rel), key=lambda p: p.boundary(N))
    repeated = ids[:1] * 2 + ids[1:]
    assert cv.points_read_from(repeated, "sglang", N, family, rel) == cv.points_read_from(ids, "sglang", N, family, rel)


def test_gpt_oss_rule_changed_at_0_5_17():
    # <= 0.5.16: +1 always; >= 0.5.17: as-is when max(ids) == num_layers
    assert cv.points_read_from([1, 30, N], "sglang", N, "gpt_oss", "0.5.17") == loop(1, 30, N)  # r_N: pre-norm final
    with pytest.raises(cv.ConventionError, match=r"r_62 \(no such boundary: the target has 61 layers\)"):
        cv.points_read_from([1, 30, N], "sglang", N, "gpt_oss", "0.5.16")
    with pytest.raises(cv.ConventionError, match="pre-norm final state"):
        cv.aux_ids_for(loop(1, 30, N), "sglang", N, "gpt_oss", "0.5.16")
    assert cv.points_read_from([1, 30, 57], "sglang", N, "gpt_oss", "0.5.16") == loop(2, 31, 58)
    assert cv.points_read_from([1, 30, 57], "sglang", N, "gpt_oss", "0.5.17") == loop(2, 31, 58)


# -- vLLM: releases and runners ------------------------------------------------------------------
def test_vllm_keys_by_release_and_runner():
    top_and_nested = {cv.AUX_KEY: [2, 30, 58], **nested([1, 29, 57])}
    only_nested = nested([1, 29, 57])
    assert cv.ids_in_draft_config(top_and_nested, "vllm", "0.32.0")[0] == [2, 30, 58]
    # V1 runner: nested fallback from 0.22 (`if eagle_config and isinstance(eagle_config, dict)`)
    assert cv.ids_in_draft_config(only_nested, "vllm", "0.22.0")[0] == [1, 29, 57]
    assert cv.ids_in_draft_config(only_nested, "vllm", "0.21.0")[0] is None
    assert cv.ids_in_draft_config(only_nested, "vllm", "0.20.1")[0] is None
    # Model Runner V2 never reads the nested eagle ids: the model's default
    assert cv.ids_in_draft_config(only_nested, "vllm", "0.32.0", runner="v2")[0] is None
    assert cv.points_read_from(None, "vllm", N, "llama", "0.32.0", "v2") == loop(2, 30, 58)
    # 0.11 ignores the draft's ids altogether
    assert cv.points_read_from([5, 6, 7], "vllm", N, "llama", "0.11.0") == loop(2, 30, 58)
    with pytest.raises(cv.ConventionError, match="no id list makes vllm 0.11.0-0.11.2"):
        cv.aux_ids_for(loop(3, 31, 59), "vllm", N, "llama", "0.11.0")


def test_vllm_deepseek_cannot_capture_the_embedding():
    with pytest.raises(cv.ConventionError, match=r"the embedding \(r_0\)"):
        cv.points_read_from([0, 30, 58], "vllm", N, "deepseek_v2", "0.32.0")
    assert cv.points_read_from([0, 30, 58], "vllm", N, "llama", "0.32.0") == [E, *loop(30, 58)]


def test_unknown_release_is_refused_naming_the_known_ranges():
    with pytest.raises(R.UnknownRelease, match=r"vllm 0.33.0 .*known: vllm 0.11.0-0.11.2 llama"):
        cv.points_read_from([2, 30, 58], "vllm", N, "llama", "0.33.0")
    with pytest.raises(R.UnknownRelease, match=r"sglang 0.5.4 \(deepseek_v2\).*sglang 0.5.5-0.5.12 deepseek_v2"):
        cv.points_read_from([2, 30, 58], "sglang", N, "deepseek_v2", "0.5.4")
    with pytest.raises(R.UnknownRelease, match="cannot read release"):
        R.release_tuple("latest")


def spec(**kw):
    return ServingConfig.model_validate({"engine": "vllm", "target": {"path": "/nonexistent"}, **kw})


def test_runner_ambiguity_is_a_reason_and_pinning_resolves_it():
    trained = loop(1, 29, 57)
    cfg = nested([1, 29, 57])  # an SGLang-format config handed to vLLM
    auto = checks.rule_readings(spec(), "0.32.0", "llama", cfg, N)
    assert [r.rule.runner for r in auto] == ["v1", "v2"]
    assert [r.points for r in auto] == [loop(1, 29, 57), loop(2, 30, 58)]
    reasons = checks.reading_rule(auto, trained, "vllm", "config.json", N).reasons
    assert any("V2 runner) reads config.json differently" in x and "serving.vllm_runner" in x for x in reasons)
    pinned = checks.rule_readings(spec(vllm_runner="v1"), "0.32.0", "llama", cfg, N)
    assert checks.reading_rule(pinned, trained, "vllm", "config.json", N).reasons == []
    # Before V2 could be vLLM's default, auto means V1 only.
    assert [r.rule.runner for r in checks.rule_readings(spec(), "0.24.0", "llama", cfg, N)] == ["v1"]
    # Top-level ids (what strata export writes) read the same on both runners: no reason.
    both = checks.rule_readings(spec(), "0.32.0", "llama", {cv.AUX_KEY: [1, 29, 57]}, N)
    assert checks.reading_rule(both, trained, "vllm", "config.json", N).reasons == []


def test_feed_vs_rule_names_each_disagreement():
    rule = R.rule_for("vllm", "0.32.0", "llama", "v1")
    lines = checks.feed_vs_rule(loop(3, 30, 58), loop(2, 30, 58), rule, N)
    assert lines == ["vllm 0.22.0-0.32.0 llama (V1 runner) feeds o_2 (r_3) to slot 0; Strata's rule table predicted "
                     f"o_1 (r_2) ({rule.source}): fix the table"]


def test_slot_count_the_engines_can_load():
    # SGLang llama_eagle3.py: `hidden_size_in * 3` up to 0.5.11; from 0.5.12 `num_aux_hidden_states`
    assert not R.serves_slots("sglang", "0.5.11", 2) and R.serves_slots("sglang", "0.5.12", 2)
    assert R.serves_slots("sglang", "0.5.11", 3)
    # vLLM llama_eagle3.py: `hidden_size * 3` up to 0.21; from 0.22 from the config
    assert not R.serves_slots("vllm", "0.21.0", 4) and R.serves_slots("vllm", "0.22.0", 4)


def test_every_rule_cites_its_release_and_file():
    for rule in R.RULES:
        assert rule.last in rule.source and ".py" in rule.source, rule
        assert R.release_tuple(rule.first) <= R.release_tuple(rule.last)


@pytest.mark.parametrize("engine, release, where", [
    ("vllm", "0.32.0", "top"), ("vllm", "0.21.0", "top"), ("sglang", "0.5.23", "nested")])
def test_corrected_config_is_read_back_as_the_trained_points(engine, release, where):
    """The cost table's 'correct ids' row: the served config with the ids the release needs,
    everything else kept, read back through the same rule."""
    from pipeline import conventions
    from schemas.capture import CapturePoint

    points = [CapturePoint.parse(p) for p in ("layer_output:1", "layer_output:5", "layer_output:8")]
    served = {"architectures": ["LlamaForCausalLMEagle3"], "eagle_aux_hidden_state_layer_ids": [0, 2, 6],
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 6], "use_aux_hidden_state": True}}
    fixed = conventions.draft_config_feeding(served, points, engine, 12, "llama", release)
    ids, key = conventions.ids_in_draft_config(fixed, engine, release, "llama")
    assert conventions.points_read_from(ids, engine, 12, "llama", release) == points
    assert fixed["architectures"] == served["architectures"] and served["eagle_aux_hidden_state_layer_ids"] == [0, 2, 6]
    assert key.startswith("eagle_config.") == (where == "nested")
    with pytest.raises(conventions.ConventionError):  # no engine feeds the post-norm final state
        conventions.draft_config_feeding(served, [*points[:2], CapturePoint.parse("final:post_norm")], engine, 12,
                                           "llama", release)
