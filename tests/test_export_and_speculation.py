import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.draft.export import ExportError, export_draft, load_draft
from pipeline.draft.model import DraftConfig, Eagle3Draft, init_weights
from pipeline.draft.speculate import TargetRunner, greedy_generate, speculative_generate
from pipeline.draft.vocab import build_draft_vocab
from pipeline.identity import target_identity
from schemas.artifact import ARTIFACT_MANIFEST
from schemas.capture import CapturePoint as C
from schemas.identity import TargetIdentity

AUX_KEY = "eagle_aux_hidden_state_layer_ids"


def fake_target(n: int) -> TargetIdentity:
    return TargetIdentity(
        model_name=f"fake-{n}",
        model_path="/nowhere",
        architecture="LlamaForCausalLM",
        num_layers=n,
        hidden_size=16,
        vocab_size=40,
        weights=[],
        weights_sha256="w",
        config_sha256="c",
        tokenizer=[],
        tokenizer_sha256="t",
        chat_template_sha256="x",
    )


def tiny_draft(num_aux=3, vocab=40, hidden=16) -> Eagle3Draft:
    cfg = DraftConfig(
        hidden_size=hidden,
        target_hidden_size=hidden,
        num_aux=num_aux,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        vocab_size=vocab,
        draft_vocab_size=vocab // 2,
    )
    m = Eagle3Draft(cfg)
    init_weights(m, seed=3)
    _, d2t, t2d = build_draft_vocab(torch.arange(vocab), vocab // 2)
    m.d2t.copy_(d2t)
    m.t2d.copy_(t2d)
    return m


@pytest.mark.parametrize(
    "n, points, sglang_ids, vllm_ids",
    [
        (6, [C.layer_output(1), C.layer_output(2), C.layer_output(3)], [1, 2, 3], [2, 3, 4]),
        (32, [C.layer_output(1), C.layer_output(15), C.layer_output(28)], [1, 15, 28], [2, 16, 29]),
        (61, [C.layer_output(1), C.layer_output(29), C.layer_output(57)], [1, 29, 57], [2, 30, 58]),
        (61, [C.layer_output(2), C.layer_output(30), C.layer_output(58)], [2, 30, 58], [3, 31, 59]),  # non-default
        (32, [C.layer_output(0), C.layer_output(7), C.layer_output(30)], [0, 7, 30], [1, 8, 31]),  # non-default
    ],
)
def test_exported_configs_carry_conventions_ids(tmp_path, n, points, sglang_ids, vllm_ids):
    m = tiny_draft()
    s = export_draft(m, tmp_path / "sglang", "sglang", points, fake_target(n))
    v = export_draft(m, tmp_path / "vllm", "vllm", points, fake_target(n))
    sc = json.loads((tmp_path / "sglang" / "config.json").read_text())
    vc = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert sc["eagle_config"] == {AUX_KEY: sglang_ids, "use_aux_hidden_state": True} and AUX_KEY not in sc
    assert vc[AUX_KEY] == vllm_ids and "eagle_config" not in vc
    for c in (sc, vc):
        assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["draft_vocab_size"] == 20
        assert c["target_hidden_size"] == 16 and c["tie_word_embeddings"] is False
    assert s.aux_layer_ids == sglang_ids and s.aux_layer_ids_convention == "sglang_llama_aux_layer_id"
    assert v.aux_layer_ids == vllm_ids and s.content_digest != v.content_digest
    assert s.aux_capture_points == points and s.fingerprints is None


def test_export_refuses_what_the_engine_cannot_capture(tmp_path):
    m = tiny_draft()
    with pytest.raises(ExportError, match=r"sglang 0.5.21 \(llama\).*the embedding \(r_0\)"):
        export_draft(
            m,
            tmp_path / "x",
            "sglang",
            [C.embedding(), C.layer_output(2), C.layer_output(3)],
            fake_target(6),
            release="0.5.21",
        )
    with pytest.raises(ExportError, match="fixed three-slot fc"):
        export_draft(
            tiny_draft(num_aux=2),
            tmp_path / "x",
            "sglang",
            [C.layer_output(2), C.layer_output(3)],
            fake_target(6),
            release="0.5.11",
        )
    with pytest.raises(ExportError, match="ascending"):
        export_draft(
            m, tmp_path / "x", "vllm", [C.layer_output(3), C.layer_output(1), C.layer_output(2)], fake_target(6)
        )
    assert not (tmp_path / "x").exists()
    # vLLM can capture the embedding: same points export fine there.
    v = export_draft(m, tmp_path / "v", "vllm", [C.embedding(), C.layer_output(2), C.layer_output(3)], fake_target(6))
    assert v.aux_layer_ids == [0, 3, 4]
    # The artifact says which releases read these ids as the trained points: not 0.11.0 (ignores
    # them), nor those whose llama loop adds the residual at layer 0 unguarded (before 0.18).
    assert v.engine_release == "0.33.0" and "vllm 0.11.0 LlamaForCausalLM (V1 runner)" not in v.ids_valid_for
    assert "vllm 0.11.1-0.17.1 LlamaForCausalLM (V1 runner)" not in v.ids_valid_for
    assert {"vllm 0.22.0-0.33.0 LlamaForCausalLM (V1 runner)", "vllm 0.33.0 LlamaForCausalLM (V2 runner)"} <= set(
        v.ids_valid_for
    )
    assert json.loads((tmp_path / "v" / "config.json").read_text())["num_aux_hidden_states"] == 3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_exported_weights_load_back_bit_exactly(tmp_path, dtype):
    m = tiny_draft()
    pts = [C.layer_output(1), C.layer_output(2), C.layer_output(3)]
    export_draft(m, tmp_path / "d", "vllm", pts, fake_target(6), dtype=dtype)
    back = load_draft(tmp_path / "d", dtype=torch.float32)
    want = {k: (v.to(getattr(torch, dtype)).float() if v.is_floating_point() else v) for k, v in m.state_dict().items()}
    for k, v in back.state_dict().items():
        if k != "embed_tokens.weight":
            assert torch.equal(v, want[k]), k
    manifest = json.loads((tmp_path / "d" / ARTIFACT_MANIFEST).read_text())
    assert "embed_tokens.weight" not in str(manifest) and manifest["serving_engine"] == "vllm"


def test_reference_speculation_is_lossless(tiny_target):
    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    ident = target_identity(tiny_target)
    pts = [C.layer_output(1), C.layer_output(2), C.layer_output(3)]
    cfg = DraftConfig.from_target(json.loads((tiny_target / "config.json").read_text()), 3, 256)
    draft = Eagle3Draft(cfg)
    init_weights(draft, seed=0)
    _, d2t, t2d = build_draft_vocab(torch.arange(ident.vocab_size).flip(0), 256)
    draft.d2t.copy_(d2t)
    runner = TargetRunner(target, pts)
    prompt = [1, 40, 41, 42, 43]
    ref = greedy_generate(target, prompt, 24)
    res = speculative_generate(runner, draft, prompt, 24, k=3)
    assert res.tokens == ref
    # The counts reconcile with the tokens: each verify step emits its accepted drafts and one
    # target token (the last step's may be cut by max_new_tokens), plus prefill's first token.
    emitted = 1 + res.verify_steps + res.accepted_tokens
    assert res.verify_steps > 0 and 0 <= emitted - len(res.tokens) <= 3
    # Chain speculation: draft position j is accepted only after position j-1 was.
    assert res.accepted_per_pos == sorted(res.accepted_per_pos, reverse=True)


@pytest.mark.parametrize(
    "budget, stop_at, steps, per_pos",
    [
        (10, None, 3, [3, 3, 3]),  # prefill 1 + 4 + 4, then a step accepting 3 of which 1 fits the budget
        (40, 5, 2, [2, 2, 2]),  # prefill 1 + 4, then a step accepting 3 whose first ends the turn
    ],
)
def test_a_verify_step_is_counted_whole_where_the_text_stops_inside_it(
    tiny_target, monkeypatch, budget, stop_at, steps, per_pos
):
    """pipeline.acceptance counts each verify step whole, as vLLM's and SGLang's counters do; the
    emitted text still stops at the end of turn or the budget. An oracle draft (proposing the
    target's own greedy tokens) makes every count known."""
    from pipeline.draft import speculate

    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    prompt = [1, 40, 41, 42, 43]
    ref = greedy_generate(target, prompt, 40)
    stop = frozenset()
    if stop_at is not None:  # the first position whose token did not occur before it
        stop_at = next(i for i in range(stop_at, 40) if ref[i] not in ref[:i])
        # ref[0] comes with the prefill, then every step emits 4 (3 accepted + the target's)
        stop, steps = frozenset([ref[stop_at]]), (stop_at - 1) // 4 + 1
        per_pos = [steps] * 3
        assert greedy_generate(target, prompt, 40, stop) == ref[: stop_at + 1]

    def oracle(draft, aux, next_tokens, k):
        done = next_tokens.shape[1] + 1 - len(prompt)
        return (ref + [0] * k)[done : done + k]

    monkeypatch.setattr(speculate, "draft_chain", oracle)
    runner = TargetRunner(target, [C.layer_output(1)])
    res = speculative_generate(runner, None, prompt, budget, 3, stop)
    assert res.tokens == (ref[:budget] if stop_at is None else ref[: stop_at + 1])
    assert (res.verify_steps, res.accepted_per_pos) == (steps, per_pos)
