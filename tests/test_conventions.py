"""Every row of the conventions table (``pipeline/conventions``), table-driven, for N = 6, 32 and 61."""

import pytest

from pipeline import conventions as cv
from schemas.capture import CapturePoint as C

E, O, PRE, POST = C.embedding(), C.layer_output, C.final("pre"), C.final("post")  # noqa: E741


def r(k, n):
    return cv.boundary_point(k, n)


@pytest.mark.parametrize("n", [6, 32, 61])
def test_all_tool_defaults_name_the_same_tensors(n):
    """o_1, o_{N//2-1}, o_{N-4} == r_2, r_{N//2}, r_{N-3} in every tool (vLLM may collapse)."""
    want = [O(1), O(n // 2 - 1), O(n - 4)]
    for tool in ("specforge", "modelopt", "trtllm", "eagle"):
        assert cv.default_aux_points(tool, n) == want, tool
    for tool in ("vllm", "sglang"):  # both capture in loop order, each layer once
        assert cv.default_aux_points(tool, n) == sorted(set(want), key=lambda p: cv.boundary(p, n)), tool


def test_vllm_default_collapses_at_six_layers():
    # (2, 6//2, 6-3) = (2, 3, 3): two ids after sort + de-duplicate.
    assert cv.default_aux_points("vllm", 6) == [r(2, 6), r(3, 6)]
    assert cv.points_read_from(None, "vllm", 6) == [O(1), O(2)]


@pytest.mark.parametrize(
    "n, points, hf, vllm, sglang_llama, specforge, gpt_oss",
    [
        # gpt-oss (newest SGLang): o-labels unless the list reaches r_N, see the gpt-oss test
        (6, [O(1), O(2), O(3)], [2, 3, 4], [2, 3, 4], [1, 2, 3], [1, 2, 3], [1, 2, 3]),
        (32, [O(1), O(15), O(28)], [2, 16, 29], [2, 16, 29], [1, 15, 28], [1, 15, 28], [1, 15, 28]),
        (61, [O(1), O(29), O(57)], [2, 30, 58], [2, 30, 58], [1, 29, 57], [1, 29, 57], [1, 29, 57]),
        (61, [O(2), O(30), O(58)], [3, 31, 59], [3, 31, 59], [2, 30, 58], [2, 30, 58], [2, 30, 58]),
    ],
)
def test_ids_for_points(n, points, hf, vllm, sglang_llama, specforge, gpt_oss):
    assert cv.aux_ids_for(points, "hf", n) == hf
    assert cv.aux_ids_for(points, "vllm", n) == vllm
    assert cv.aux_ids_for(points, "sglang", n, "llama") == sglang_llama
    for tool in ("specforge", "modelopt", "trtllm"):
        assert cv.aux_ids_for(points, tool, n) == specforge
    assert cv.aux_ids_for(points, "sglang", n, "gpt_oss") == gpt_oss
    # ...and every tool reads its own list back as the same points.
    for tool, ids, fam in [
        ("vllm", vllm, "llama"),
        ("sglang", sglang_llama, "llama"),
        ("specforge", specforge, "llama"),
        ("sglang", gpt_oss, "gpt_oss"),
    ]:
        assert cv.points_read_from(ids, tool, n, fam) == points


def test_the_original_bug_is_a_misread():
    """61 layers; data held r_3, r_31, r_59 (loop indices). SGLang llama reads [3,31,59] as o-ids."""
    n = 61
    trained_on = [r(3, n), r(31, n), r(59, n)]
    served = cv.points_read_from([3, 31, 59], "sglang", n, "llama")
    assert served == [r(4, n), r(32, n), r(60, n)] != trained_on
    assert cv.aux_ids_for(trained_on, "sglang", n, "llama") == [2, 30, 58]


@pytest.mark.parametrize("n", [6, 32, 61])
def test_hf_hidden_states_index(n):
    assert cv.hf_hidden_states_index(E, n) == 0
    assert cv.hf_hidden_states_index(O(0), n) == 1
    assert cv.hf_hidden_states_index(O(n - 2), n) == n - 1
    assert cv.hf_hidden_states_index(POST, n) == n  # [N] is post-norm
    assert cv.hf_hidden_states_index(O(n - 1), n) is None  # r_N pre-norm is not exposed...
    assert cv.hf_hidden_states_index(PRE, n, last_is_post_norm=False) == n  # ...unless untied
    assert cv.from_hf_hidden_states_index(n, n) == POST
    assert cv.from_hf_hidden_states_index(3, n) == O(2)


@pytest.mark.parametrize("n", [6, 32, 61])
def test_vllm_reads_r_labels_sorted_and_deduplicated(n):
    assert cv.points_read_from([n, 0, 2, 2], "vllm", n) == [E, O(1), O(n - 1)]
    assert cv.aux_ids_for([E, PRE], "vllm", n) == [0, n]
    with pytest.raises(cv.ConventionError, match="ascending layer order, each once"):
        cv.aux_ids_for([O(3), O(1)], "vllm", n)
    with pytest.raises(cv.ConventionError, match="the post-norm final state .* before the final norm"):
        cv.aux_ids_for([POST], "vllm", n)


@pytest.mark.parametrize("n", [6, 32, 61])
def test_sglang_llama_cannot_capture_embedding_or_final(n):
    with pytest.raises(cv.ConventionError, match="the embedding"):
        cv.aux_ids_for([E, O(1)], "sglang", n, "llama", release="0.5.21")
    assert cv.aux_ids_for([E, O(1)], "sglang", n, "llama", release="0.5.22") == [-1, 1]
    with pytest.raises(cv.ConventionError, match=f"r_{n}"):
        cv.aux_ids_for([O(1), O(n - 1)], "sglang", n, "llama")
    with pytest.raises(cv.ConventionError):
        cv.points_read_from([1, n - 1], "sglang", n, "llama")  # id N-1 would need r_N
    assert cv.native_id(E, "sglang", n, "llama", release="0.5.21") is None


@pytest.mark.parametrize("n", [32, 61])
def test_sglang_deepseek_heuristic_both_branches(n):
    # First id 1 -> o-labels (+1).
    assert cv.points_read_from([1, 15, 28], "sglang", n, "deepseek_v2") == [O(1), O(15), O(28)]
    # First id not 1 -> r-labels.
    assert cv.points_read_from([2, 16, 29], "sglang", n, "deepseek_v2") == [O(1), O(15), O(28)]
    assert cv.points_read_from([3, 31], "sglang", n, "deepseek_v2") == [O(2), O(30)]
    # Writing: o-ids when they start with 1, else r-labels.
    assert cv.aux_ids_for([O(1), O(15), O(28)], "sglang", n, "deepseek_v2") == [1, 15, 28]
    assert cv.aux_ids_for([O(2), O(30)], "sglang", n, "deepseek_v2") == [3, 31]
    # r_1 first cannot be expressed: r-label 1 would be read as o_1.
    with pytest.raises(cv.ConventionError, match="no id list makes"):
        cv.aux_ids_for([O(0), O(5)], "sglang", n, "deepseek_v2")


@pytest.mark.parametrize("n", [6, 32, 61])
def test_sglang_gpt_oss_r_labels_reach_final(n):
    # >= 0.5.17: a list whose max is N is read as boundaries; otherwise as o-labels (+1).
    ids = cv.aux_ids_for([O(1), PRE], "sglang", n, "gpt_oss")
    assert ids == [1, n - 1] and cv.points_read_from(ids, "sglang", n, "gpt_oss") == [O(1), O(n - 1)]
    assert cv.points_read_from([2, n], "sglang", n, "gpt_oss") == [O(1), O(n - 1)]
    assert cv.points_read_from([2, n - 1], "sglang", n, "gpt_oss") == [O(2), O(n - 1)]
    # <= 0.5.16: always +1, so r_N (and the embedding) cannot be fed at all.
    with pytest.raises(cv.ConventionError, match="pre-norm final"):
        cv.aux_ids_for([O(1), PRE], "sglang", n, "gpt_oss", release="0.5.16")
    assert cv.points_read_from([2, n - 2], "sglang", n, "gpt_oss", release="0.5.16") == [O(2), O(n - 2)]


@pytest.mark.parametrize("n", [6, 32, 61])
def test_specforge_family_is_output_ids(n):
    for tool in ("specforge", "modelopt", "trtllm"):
        read = cv.points_read_from([0, n - 1], tool, n)
        assert read == [O(0), O(n - 1)] and cv.same_tensor(read[1], PRE, n)
        with pytest.raises(cv.ConventionError, match="embedding"):
            cv.aux_ids_for([E], tool, n)


def test_architecture_decides_the_rule():
    def arch(cfg):
        return cv.engine_family("sglang", cfg)

    assert arch({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}) == "MistralForCausalLM"
    assert arch({"model_type": "qwen3"}) == "Qwen3ForCausalLM"  # a hand-made config without architectures
    assert arch({"architectures": ["KimiK25ForConditionalGeneration"]}) == "KimiK25ForConditionalGeneration"
    assert cv.engine_family("sglang", {"model_type": "llama"}, "gpt_oss") == "GptOssForCausalLM"  # forced (model file)
    with pytest.raises(cv.ConventionError, match="no sglang rule is known for architecture MambaForCausalLM"):
        arch({"architectures": ["MambaForCausalLM"]})


def test_draft_config_reading_rules():
    top = {cv.AUX_KEY: [2, 16, 29], "eagle_config": {cv.AUX_KEY: [1, 15, 28]}}
    nested_only = {"eagle_config": {cv.AUX_KEY: [1, 15, 28]}}
    assert cv.ids_in_draft_config(top, "vllm") == ([2, 16, 29], cv.AUX_KEY)
    assert cv.ids_in_draft_config(nested_only, "vllm")[0] == [1, 15, 28]  # V1 runner falls back (>= 0.22)
    assert cv.ids_in_draft_config(nested_only, "vllm", runner="v2")[0] is None  # Model Runner V2 never does
    assert cv.ids_in_draft_config(top, "sglang")[0] == [1, 15, 28]  # nested only
    assert cv.ids_in_draft_config({cv.AUX_KEY: [2, 16, 29]}, "sglang")[0] is None  # silent default
    # An SGLang-format config read by vLLM's rules: o-ids taken as r-ids, shifted by one.
    ids, _ = cv.ids_in_draft_config(nested_only, "vllm")
    assert cv.points_read_from(ids, "vllm", 32) == [O(0), O(14), O(27)] != [O(1), O(15), O(28)]


def test_boundary_labels_and_list():
    assert cv.boundary_label(O(2), 6) == "r_3" and cv.boundary_label(POST, 6) == "final_post"
    assert [str(p) for p in cv.all_boundaries(2)] == [
        "embedding",
        "layer_output:0",
        "layer_output:1",
        "final:post_norm",
    ]
