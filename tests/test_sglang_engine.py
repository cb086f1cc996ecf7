"""SGLang adapter: everything that can be checked without SGLang (it needs CUDA and cannot
be imported on these machines) -- exported configs SGLang reads as intended per model
family, engine arguments, reading of its responses -- plus a GPU-cluster test.

What SGLang captures for a draft config is not transcribed here: it is computed by running
``set_eagle3_layers_to_capture`` from the released wheel's own model files (``.ci/setup``
downloads the wheel; it is read as text, never imported), so the expectation comes from
SGLang, not from ``pipeline.conventions``."""

import ast
import importlib.util
import json
import os
import textwrap
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import pytest
import torch
from conftest import require

from pipeline.draft.export import ExportError, export_draft
from pipeline.draft.model import DraftConfig, Eagle3Draft
from pipeline.engines import sglang_engine as sg
from pipeline.engines.errors import EngineError, EngineUnavailable
from pipeline.identity import target_identity
from schemas.capture import CapturePoint

lo, E = CapturePoint.layer_output, CapturePoint.embedding()
AUX_KEY = "eagle_aux_hidden_state_layer_ids"
SGLANG_RELEASE = "0.5.23"
WHEEL_DIR = Path(__file__).resolve().parents[1] / ".venv" / "share" / "strata-wheels"
MODEL_FILES = {"llama": ("llama", "LlamaForCausalLM"), "qwen3": ("qwen3", "Qwen3ForCausalLM"),
               "deepseek_v2": ("deepseek_v2", "DeepseekV2ForCausalLM"), "gpt_oss": ("gpt_oss", "GptOssForCausalLM")}


def released_source(module: str) -> str:
    wheels = sorted(WHEEL_DIR.glob(f"sglang-{SGLANG_RELEASE}-*.whl"))
    require(f"the sglang {SGLANG_RELEASE} wheel", bool(wheels), f"bash .ci/setup downloads it to {WHEEL_DIR}")
    with zipfile.ZipFile(wheels[0]) as z:
        return z.read(f"sglang/srt/models/{module}.py").decode()


def released_method(module: str, cls: str, name: str) -> str:
    src = released_source(module)
    for node in ast.parse(src).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and f.name == name:
                    return textwrap.dedent(ast.get_source_segment(src, f, padded=True))
    raise AssertionError(f"sglang {SGLANG_RELEASE} {module}.py has no {cls}.{name}")


def sglang_captures(ids: list[int] | None, family: str, n: int) -> list[int]:
    """The residual boundaries r_k SGLang captures for a nested id list: its released
    ``set_eagle3_layers_to_capture`` run on a stand-in model object. Its decoder loop appends
    the stream entering layer i for each i in ``layers_to_capture``
    (``test_sglang_layer_loop_captures_the_input_of_layer_i``), so index i is r_i."""
    module, cls = MODEL_FILES[family]
    inner = SimpleNamespace(layers_to_capture=None)
    inner.set_eagle3_layers_to_capture = lambda ids: setattr(inner, "layers_to_capture", ids)
    self = SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True), config=SimpleNamespace(num_hidden_layers=n),
                           model=inner)
    ns: dict = {"Optional": Optional, "List": list}
    exec(released_method(module, cls, "set_eagle3_layers_to_capture"), ns)  # the released source, read as text
    ns["set_eagle3_layers_to_capture"](self, ids)
    return sorted(set(inner.layers_to_capture))


def test_sglang_layer_loop_captures_the_input_of_layer_i():
    """In the released Llama model file, layer i is asked to capture when i is in
    ``layers_to_capture``, and the layer hands that request to its attention stage's
    ``prepare`` -- the stream entering the layer, before its attention runs -- so i means r_i."""
    model = released_method("llama", "LlamaModel", "forward")
    loop = model[model.index("for i in range("):]
    call = loop[loop.index("self.layers[i]("):]
    assert "capture_output=aux_hidden_states.capture" in call and "if i in self.layers_to_capture" in call
    layer = released_method("llama", "LlamaDecoderLayer", "forward")
    prepare = layer.index("self.attn_boundary.prepare(")
    assert "capture=capture_output" in layer[prepare:layer.index(")", prepare)]
    assert prepare < layer.index("self.self_attn(")


@pytest.fixture(scope="module")
def draft(tiny_target):
    tcfg = json.loads((tiny_target / "config.json").read_text())
    return Eagle3Draft(DraftConfig.from_target(tcfg, 3, tcfg["vocab_size"])), target_identity(tiny_target)


@pytest.mark.parametrize("family, points, nested_ids", [
    ("llama", [lo(1), lo(2), lo(3)], [1, 2, 3]),
    ("qwen3", [lo(1), lo(2), lo(3)], [1, 2, 3]),
    ("deepseek_v2", [lo(1), lo(2), lo(3)], [1, 2, 3]),       # first id 1: read as o-labels (+1)
    ("deepseek_v2", [lo(2), lo(3), lo(4)], [3, 4, 5]),       # first id not 1: read as r-labels
    ("gpt_oss", [lo(1), lo(2), lo(5)], [1, 2, 5]),           # o-labels also reach pre-norm r_N (>= 0.5.17)
])
def test_exported_config_is_read_by_sglang_as_intended(draft, tmp_path, family, points, nested_ids):
    model, ident = draft
    conv_family = "qwen" if family == "qwen3" else family
    export_draft(model, tmp_path / "d", "sglang", points, ident, family=conv_family, dtype="float32")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["eagle_config"][AUX_KEY] == nested_ids and AUX_KEY not in cfg
    n = ident.num_layers
    assert sglang_captures(cfg["eagle_config"][AUX_KEY], family, n) == [p.boundary(n) for p in points]


def test_sglang_families_refuse_what_they_cannot_capture(draft, tmp_path):
    model, ident = draft
    with pytest.raises(ExportError, match=r"sglang 0.5.21 \(llama\).*the embedding \(r_0\)"):
        export_draft(model, tmp_path / "a", "sglang", [E, lo(1), lo(2)], ident, family="llama", release="0.5.21")
    with pytest.raises(ExportError, match="pre-norm final"):
        export_draft(model, tmp_path / "b", "sglang", [lo(1), lo(2), lo(5)], ident, family="llama")
    with pytest.raises(ExportError, match="no id list makes"):
        export_draft(model, tmp_path / "c", "sglang", [lo(0), lo(2), lo(3)], ident, family="deepseek_v2")


def test_engine_args_and_capture_rules(tmp_path, tiny_target):
    args = sg.engine_args(tiny_target, tmp_path, 3, "bfloat16", tp_size=4)
    assert args["speculative_algorithm"] == "EAGLE3" and args["speculative_num_steps"] == 3
    assert args["speculative_num_draft_tokens"] == 4 and args["speculative_eagle_topk"] == 1
    assert args["tp_size"] == 4 and args["disable_radix_cache"] and args["skip_tokenizer_init"]
    assert sg.can_capture(lo(2), 6, "llama") and not sg.can_capture(E, 6, "llama", "0.5.21")
    assert sg.can_capture(E, 6, "llama", "0.5.22")
    assert sg.can_capture(lo(5), 6, "gpt_oss") and not sg.can_capture(lo(5), 6, "llama")


def test_reading_sglang_responses():
    T, n_ids, H = 5, 3, 8
    flat = torch.arange(T * n_ids * H, dtype=torch.float32).view(T, n_ids * H)
    states = sg.parse_hidden_states({"hidden_states": [flat.tolist(), [0.0] * (n_ids * H)]}, T, n_ids, H)
    assert states.shape == (T, n_ids, H) and torch.equal(states[:, 1], flat[:, H:2 * H])  # slot-major
    with pytest.raises(EngineError, match=r"shape \(5, 16\).*expected \(5, 24\)"):
        sg.parse_hidden_states({"hidden_states": [flat[:, :16].tolist()]}, T, n_ids, H)
    with pytest.raises(EngineError, match="return_hidden_states"):
        sg.parse_hidden_states({}, T, n_ids, H)
    acc = sg.acceptance_from_meta([{"spec_verify_ct": 4, "completion_tokens": 10, "spec_accept_length": 2.5},
                                   {"spec_verify_ct": 6, "completion_tokens": 12, "spec_accept_length": 2.0}], 3)
    assert acc["verify_steps"] == 10 and acc["mean_acceptance_length"] == pytest.approx(2.2)
    assert acc["accepted_per_step"] == pytest.approx(1.2) and acc["spec_accept_length_reported"] == 2.25
    with pytest.raises(EngineError, match="did not run"):
        sg.acceptance_from_meta([{"completion_tokens": 5}], 3)


def test_sglang_replay_without_sglang_is_a_clear_input_error(trained_run, tiny_target):
    from pipeline.validate.job import ValidationInputError, run_validate
    from schemas.validation import ValidateConfig

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("SGLang is installed here; the GPU test covers it")
    with pytest.raises(EngineUnavailable):
        sg._sglang()
    cfg = ValidateConfig.model_validate({"artifact": str(trained_run / "export" / "sglang"), "serving": {
        "engine": "sglang", "replay": "engine", "dtype": "float32", "target": {"path": str(tiny_target)}}})
    with pytest.raises(ValidationInputError, match="set serving.replay: hf"):
        run_validate(cfg)


class FakeSGLang:
    """Stands in for ``sglang`` (which cannot run here): an HF target that captures what
    SGLang 0.5.23's llama model file captures for the draft config it is given, decodes
    greedily, and -- when served with Strata's recorder package, as ``serve_eagle3`` asks --
    writes the draft inputs the recorder would (next tokens, ``token_offset`` 1). The draft
    itself is not run: every step verifies one token (no drafts accepted)."""

    __version__ = "0.5.23"

    class Engine:
        def __init__(self, **kw):
            from transformers import AutoModelForCausalLM

            self.kw, self.calls = kw, 0
            self.model = AutoModelForCausalLM.from_pretrained(kw["model_path"], dtype=torch.float32)
            n = self.model.config.num_hidden_layers
            self.rs = None
            if kw.get("speculative_draft_model_path"):
                cfg = json.loads((Path(kw["speculative_draft_model_path"]) / "config.json").read_text())
                self.rs = sglang_captures((cfg.get("eagle_config") or {}).get(AUX_KEY), "llama", n)
            # Read when the engine starts, like SGLang's scheduler processes do.
            self.feed = os.environ.get("STRATA_SGLANG_FEED_DIR") if os.environ.get(
                "SGLANG_EXTERNAL_MODEL_PACKAGE") == "pipeline.engines.sglang_models" else None

        @torch.no_grad()
        def generate(self, input_ids, sampling_params, return_hidden_states=False):
            from pipeline.engines.feed_files import write_call

            outs = []
            for ids in input_ids:
                seq = list(ids)
                for _ in range(sampling_params["max_new_tokens"]):
                    seq.append(int(self.model(torch.tensor([seq])).logits[0, -1].argmax()))
                meta = {}
                if self.rs is not None:
                    hs = self.model(torch.tensor([seq]), output_hidden_states=True).hidden_states
                    flat = torch.cat([hs[k][0] for k in self.rs], dim=-1)
                    if return_hidden_states:
                        meta["hidden_states"] = [flat[: len(ids)].tolist()]
                    new = len(seq) - len(ids)
                    meta.update(spec_verify_ct=new, completion_tokens=new)
                    if self.feed:  # prefill: the prompt's rows; then one row per verified token
                        n_in = len(ids)
                        write_call(Path(self.feed), self.calls, torch.tensor(seq[1:n_in + 1]), torch.arange(n_in),
                                   flat[:n_in], token_offset=1)
                        for q in range(n_in, len(seq) - 1):
                            write_call(Path(self.feed), self.calls + q, torch.tensor([seq[q + 1]]), torch.tensor([q]),
                                       flat[q:q + 1], token_offset=1)
                        self.calls += len(seq)
                outs.append({"output_ids": seq[len(ids):], "meta_info": meta})
            return outs

        def shutdown(self):
            self.model = None


def test_sglang_capture_plumbing_with_a_fake_engine(tiny_target, monkeypatch):
    """Stub draft -> nested ids -> SGLang capture -> slots back in the caller's order."""
    import sys

    from pipeline.engines.hf import HFEngine
    from pipeline.store.encoding import bits_to_torch, join_planes

    monkeypatch.setitem(sys.modules, "sglang", FakeSGLang)
    points = [lo(3), lo(0), lo(2)]
    eng = sg.SGLangEngine(tiny_target, points, dtype="float32")
    seqs = [list(range(4, 30)), [7, 8, 9, 10]]
    got = eng.capture(seqs)
    eng.close()
    want = HFEngine(tiny_target, points, "float32", "cpu").capture(seqs)
    for p in points:
        a = bits_to_torch(join_planes(list(got.planes[str(p)])), "float32")
        b = bits_to_torch(join_planes(list(want.planes[str(p)])), "float32")
        assert torch.allclose(a, b, atol=1e-6), p
    assert eng.engine_ref(lo(0)).native_id == 0 and eng.engine_ref(lo(0)).native_id_convention == "sglang_llama_aux_layer_id"


def validate_through_fake_sglang(trained_run, tiny_target, tmp_path, ids=None):
    from pipeline.validate.job import run_validate
    from schemas.validation import ValidateConfig

    art = trained_run / "export" / "sglang"
    cfg = json.loads((art / "config.json").read_text())
    if ids is not None:
        cfg["eagle_config"][AUX_KEY] = ids
    (tmp_path / "served.json").write_text(json.dumps(cfg))
    return run_validate(ValidateConfig.model_validate({
        "artifact": str(art), "acceptance_prompts": 2, "max_new_tokens": 6,
        "tolerances": {"acceptance_floor": 1.0},
        "serving": {"engine": "sglang", "replay": "engine", "dtype": "float32", "target": {"path": str(tiny_target)},
                    "draft_config": str(tmp_path / "served.json")}}))


def test_sglang_measured_feed_plumbing_with_a_fake_engine(trained_run, tiny_target, tmp_path, monkeypatch):
    """serve_eagle3 -> recorder environment -> recorded next-token rows -> per-slot boundaries."""
    import sys

    monkeypatch.setitem(sys.modules, "sglang", FakeSGLang)
    r = validate_through_fake_sglang(trained_run, tiny_target, tmp_path)
    assert r.decision == "pass", r.reasons
    assert all(s.fed_by == "measured" for s in r.slots) and r.feed["disagreements"] == []
    assert r.feed["recorded_rows"]["verify"] > 0 and max(r.feed["vs_training_rel_l2"]) < 1e-4
    assert "STRATA_SGLANG_FEED_DIR" not in os.environ  # restored after serving
    shifted = validate_through_fake_sglang(trained_run, tiny_target, tmp_path, ids=[2, 3, 4])
    assert shifted.decision == "block" and all(s.fed_by == "measured" for s in shifted.slots)
    assert any("slot 0 is fed o_2 (r_3)" in x and "shifted by +1" in x for x in shifted.reasons), shifted.reasons


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and importlib.util.find_spec("sglang")),
                    reason="SGLang needs a CUDA GPU and the sglang package: run `pytest -m gpu` on a GPU cluster")
def test_gpu_sglang_capture_matches_hf_and_serves_losslessly(trained_run, tiny_target):
    from pipeline.engines.hf import HFEngine
    from pipeline.validate.job import run_validate
    from schemas.validation import ValidateConfig

    points = [lo(1), lo(2), lo(3)]
    eng = sg.SGLangEngine(tiny_target, points, dtype="float32")
    seqs = [list(range(4, 60))]
    got = eng.capture_tensors(seqs)
    eng.close()
    want = HFEngine(tiny_target, points, "float32", "cuda")
    from pipeline.store.encoding import bits_to_torch, join_planes

    b = want.capture(seqs)
    for p in points:
        ref = bits_to_torch(join_planes(list(b.planes[str(p)])), "float32")
        assert ((got[str(p)][0].cpu() - ref).norm() / ref.norm()) < 1e-4
    r = run_validate(ValidateConfig.model_validate({
        "artifact": str(trained_run / "export" / "sglang"), "acceptance_prompts": 4,
        "serving": {"engine": "sglang", "replay": "engine", "dtype": "float32", "target": {"path": str(tiny_target)}}}))
    assert r.decision == "pass", r.reasons
    assert r.acceptance["lossless"]
    # The feed was measured inside SGLang (the recorder draft class), on prefill at least; verify
    # rows are recorded where the draft runs eagerly (a CUDA-graph replay runs no Python).
    assert all(s.fed_by == "measured" for s in r.slots) and r.feed["disagreements"] == [], r.feed
    print("SGLang recorded draft-input rows:", r.feed["recorded_rows"])
    art = trained_run / "export" / "sglang"
    cfg = json.loads((art / "config.json").read_text())
    cfg["eagle_config"][AUX_KEY] = [i + 1 for i in cfg["eagle_config"][AUX_KEY]]
    served = trained_run / "served-plus-one.json"
    served.write_text(json.dumps(cfg))
    bad = run_validate(ValidateConfig.model_validate({
        "artifact": str(art), "acceptance_prompts": 2,
        "serving": {"engine": "sglang", "replay": "engine", "dtype": "float32", "target": {"path": str(tiny_target)},
                    "draft_config": str(served)}}))
    assert bad.decision == "block" and all(s.fed_by == "measured" for s in bad.slots)
    assert any("shifted by +1" in x for x in bad.reasons), bad.reasons
