"""SGLang's reading rules, read from the newest release's own source (it cannot run here).

What SGLang captures for a draft config is not transcribed here: it is computed by running
``set_eagle3_layers_to_capture`` from the released wheel's own model files (``.ci/setup``
downloads the wheel; it is read as text, never imported), so the expectation comes from
SGLang, not from ``pipeline.conventions``. SGLang 0.5.18, which runs here, is tested for real
in ``test_sglang_server.py``."""

import ast
import json
import textwrap
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import pytest
from conftest import require

from pipeline.conventions import boundary
from pipeline.draft.export import ExportError, export_draft
from pipeline.draft.model import DraftConfig, Eagle3Draft
from pipeline.identity import target_identity
from schemas.capture import CapturePoint

lo, E = CapturePoint.layer_output, CapturePoint.embedding()
AUX_KEY = "eagle_aux_hidden_state_layer_ids"
SGLANG_RELEASE = "0.5.23"
WHEEL_DIR = Path(__file__).resolve().parents[1] / ".venv" / "share" / "strata-wheels"
MODEL_FILES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "deepseek_v2": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "gpt_oss": ("gpt_oss", "GptOssForCausalLM"),
}


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
    self = SimpleNamespace(
        pp_group=SimpleNamespace(is_last_rank=True), config=SimpleNamespace(num_hidden_layers=n), model=inner
    )
    ns: dict = {"Optional": Optional, "List": list}
    exec(released_method(module, cls, "set_eagle3_layers_to_capture"), ns)  # the released source, read as text
    ns["set_eagle3_layers_to_capture"](self, ids)
    return sorted(set(inner.layers_to_capture))


def test_sglang_layer_loop_captures_the_input_of_layer_i():
    """In the released Llama model file, layer i is asked to capture when i is in
    ``layers_to_capture``, and the layer hands that request to its attention stage's
    ``prepare`` -- the stream entering the layer, before its attention runs -- so i means r_i."""
    model = released_method("llama", "LlamaModel", "forward")
    loop = model[model.index("for i in range(") :]
    call = loop[loop.index("self.layers[i](") :]
    assert "capture_output=aux_hidden_states.capture" in call and "if i in self.layers_to_capture" in call
    layer = released_method("llama", "LlamaDecoderLayer", "forward")
    prepare = layer.index("self.attn_boundary.prepare(")
    assert "capture=capture_output" in layer[prepare : layer.index(")", prepare)]
    assert prepare < layer.index("self.self_attn(")


@pytest.fixture(scope="module")
def draft(tiny_target):
    tcfg = json.loads((tiny_target / "config.json").read_text())
    return Eagle3Draft(DraftConfig.from_target(tcfg, 3, tcfg["vocab_size"])), target_identity(tiny_target)


@pytest.mark.parametrize(
    "family, points, nested_ids",
    [
        ("llama", [lo(1), lo(2), lo(3)], [1, 2, 3]),
        ("qwen3", [lo(1), lo(2), lo(3)], [1, 2, 3]),
        ("deepseek_v2", [lo(1), lo(2), lo(3)], [1, 2, 3]),  # first id 1: read as o-labels (+1)
        ("deepseek_v2", [lo(2), lo(3), lo(4)], [3, 4, 5]),  # first id not 1: read as r-labels
        ("gpt_oss", [lo(1), lo(2), lo(5)], [1, 2, 5]),  # o-labels also reach pre-norm r_N (>= 0.5.17)
    ],
)
def test_exported_config_is_read_by_sglang_as_intended(draft, tmp_path, family, points, nested_ids):
    model, ident = draft
    export_draft(model, tmp_path / "d", "sglang", points, ident, family=family, dtype="float32")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["eagle_config"][AUX_KEY] == nested_ids and AUX_KEY not in cfg
    n = ident.num_layers
    assert sglang_captures(cfg["eagle_config"][AUX_KEY], family, n) == [boundary(p, n) for p in points]


def test_sglang_families_refuse_what_they_cannot_capture(draft, tmp_path):
    model, ident = draft
    with pytest.raises(ExportError, match=r"sglang 0.5.21 \(llama\).*the embedding \(r_0\)"):
        export_draft(model, tmp_path / "a", "sglang", [E, lo(1), lo(2)], ident, family="llama", release="0.5.21")
    with pytest.raises(ExportError, match="pre-norm final"):
        export_draft(model, tmp_path / "b", "sglang", [lo(1), lo(2), lo(5)], ident, family="llama")
    with pytest.raises(ExportError, match="no id list makes"):
        export_draft(model, tmp_path / "c", "sglang", [lo(0), lo(2), lo(3)], ident, family="deepseek_v2")
