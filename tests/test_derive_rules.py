"""Rules derived from the engines' own code: the static loop check, the stand-in execution, and
the committed table against a fresh derivation of the newest releases (their wheels are
downloaded by ``.ci/setup``)."""

import json
import textwrap
from pathlib import Path

import pytest
from conftest import require

from pipeline.conventions import derive, derive_sglang, derive_vllm
from pipeline.conventions import releases as R
from pipeline.conventions.capture_loop import capture_range
from pipeline.conventions.engine_code import CodeIndex, ReleasedCode

WHEELS = Path(__file__).resolve().parents[1] / ".venv" / "share" / "strata-wheels"
NEWEST = {"sglang": "0.5.23", "vllm": "0.33.0"}


def model_file(forward_body: str, extra: str = "") -> ReleasedCode:
    """An SGLang-style model file whose inner model's forward is ``forward_body``."""
    src = textwrap.dedent("""
        class Model:
            def forward(self, input_ids, positions, forward_batch):
                hidden_states, residual = self.embed_tokens(input_ids), None
                aux_hidden_states = []
        {body}
                return hidden_states, aux_hidden_states
        {extra}
    """).format(body=textwrap.indent(textwrap.dedent(forward_body), " " * 8), extra=textwrap.dedent(extra))
    return ReleasedCode.from_files("sglang", "0", {"sglang/srt/models/m.py": src})


def reach(forward_body: str, attr: str = "layers_to_capture"):
    code = model_file(forward_body)
    return capture_range(CodeIndex(code, "sglang/srt/models/"), "sglang.srt.models.m:Model", attr)


def test_a_capture_before_the_layer_sees_r_i_and_raises_at_layer_zero_without_a_guard():
    r = reach("""
        for i in range(self.start_layer, self.end_layer):
            if i in self.layers_to_capture:
                aux_hidden_states.append(hidden_states + residual)
            hidden_states, residual = self.layers[i](positions, hidden_states, forward_batch, residual)
    """)
    assert (r.embedding, r.final, r.ids_are_boundaries) == (False, False, True)


def test_a_residual_guard_makes_the_embedding_capturable():
    r = reach("""
        for i in range(self.start_layer, self.end_layer):
            if i in self.layers_to_capture:
                aux_hidden_states.append(hidden_states + residual if residual is not None else hidden_states)
            hidden_states, residual = self.layers[i](positions, hidden_states, forward_batch, residual)
    """)
    assert r.embedding is True and not r.final


def test_captures_after_the_layer_and_after_the_loop_reach_r_n():
    after_layer = reach(
        """
        if self.start_layer in self.aux_hidden_state_layers:
            aux_hidden_states.append(hidden_states)
        for idx, layer in enumerate(self.layers):
            hidden_states, residual = layer(positions, hidden_states, residual)
            if idx + 1 in self.aux_hidden_state_layers:
                aux_hidden_states.append(hidden_states + residual)
    """,
        "aux_hidden_state_layers",
    )
    assert (after_layer.embedding, after_layer.final, after_layer.ids_are_boundaries) == (True, True, True)
    after_loop = reach("""
        for i in range(self.start_layer, self.end_layer):
            if i in self.layers_to_capture:
                aux_hidden_states.append(hidden_states + residual)
            hidden_states, residual = self.layers[i](positions, hidden_states, forward_batch, residual)
        if self.end_layer in self.layers_to_capture:
            aux_hidden_states.append(hidden_states + residual)
    """)
    assert after_loop.final and after_loop.embedding is False


def test_an_index_tested_where_the_stream_is_another_boundary_is_not_a_boundary_id():
    r = reach("""
        for i in range(self.start_layer, self.end_layer):
            hidden_states, residual = self.layers[i](positions, hidden_states, forward_batch, residual)
            if i in self.layers_to_capture:
                aux_hidden_states.append(hidden_states + residual)
    """)
    assert not r.ids_are_boundaries and "i" in r.why


def test_a_capture_handed_into_the_layer_is_unknown_at_layer_zero_unless_the_layer_is_read():
    r = reach("""
        for i in range(self.start_layer, self.end_layer):
            hidden_states, residual = self.layers[i](positions, hidden_states, forward_batch, residual,
                                                     captured=aux_hidden_states if i in self.layers_to_capture else None)
    """)
    assert r.embedding is None and "not read" in r.why


def test_a_forward_that_hands_on_to_super_is_read_in_the_base_class():
    """SGLang's TeleFLMModel and vLLM's MistralModel override forward only to return
    ``super().forward(...)``: the base class's loop is what runs."""
    base = model_file("""
        for i in range(self.start_layer, self.end_layer):
            if i in self.layers_to_capture:
                aux_hidden_states.append(hidden_states + residual if residual is not None else hidden_states)
            hidden_states, residual = self.layers[i](positions, hidden_states, forward_batch, residual)
    """)
    files = {
        **base._files,
        "sglang/srt/models/sub.py": textwrap.dedent("""
        from sglang.srt.models.m import Model
        class Sub(Model):
            def forward(self, input_ids, positions, forward_batch):
                return super().forward(input_ids * 2, positions, forward_batch)
    """),
    }
    code = ReleasedCode.from_files("sglang", "0", files)
    r = capture_range(CodeIndex(code, "sglang/srt/models/"), "sglang.srt.models.sub:Sub", "layers_to_capture")
    assert (r.embedding, r.ids_are_boundaries, r.why) == (True, True, "")


def test_a_capture_handed_into_a_layer_of_the_base_class_module_is_followed():
    """SGLang 0.5.23's Qwen3-VL language model loops in qwen3_vl.py but its layers are qwen3.py's,
    which hand the collector to the shared ``attn_boundary.prepare`` (safe at layer 0)."""
    files = {
        "sglang/srt/layers/layer_boundary/stage.py": "def prepare(hidden_states, capture=None):\n    pass\n",
        "sglang/srt/models/base.py": textwrap.dedent("""
            class Layer:
                def forward(self, positions, hidden_states, forward_batch, capture_output=None):
                    hidden_states = self.attn_boundary.prepare(hidden_states, forward_batch, capture=capture_output)
                    return hidden_states
            class BaseModel:
                def __init__(self, config):
                    self.layers = [Layer() for _ in range(4)]
        """),
        "sglang/srt/models/vl.py": textwrap.dedent("""
            from sglang.srt.models.base import BaseModel
            class VLModel(BaseModel):
                def forward(self, input_ids, positions, forward_batch):
                    hidden_states, aux = input_ids, []
                    for layer_idx, layer in enumerate(self.layers):
                        capture_output = aux.append if layer_idx in self.layers_to_capture else None
                        hidden_states = layer(positions, hidden_states, forward_batch, capture_output=capture_output)
                    return hidden_states, aux
        """),
    }
    code = ReleasedCode.from_files("sglang", "0", files)
    r = capture_range(CodeIndex(code, "sglang/srt/models/"), "sglang.srt.models.vl:VLModel", "layers_to_capture")
    assert (r.embedding, r.why) == (True, "")


SET_IDS = """
class Inner:
    def forward(self, input_ids, positions, forward_batch):
        hidden_states, residual, aux_hidden_states = input_ids, None, []
        for i in range(self.start_layer, self.end_layer):
            if i in self.layers_to_capture:
                aux_hidden_states.append(hidden_states + residual)
            hidden_states, residual = self.layers[i](positions, hidden_states, forward_batch, residual)
        return hidden_states, aux_hidden_states

class Target:
    def __init__(self, config):
        self.model = Inner(config)
    def set_eagle3_layers_to_capture(self, layer_ids=None):
        if not self.pp_group.is_last_rank:
            return
        if layer_ids is None:
            num_layers = self.config.num_hidden_layers
            self.model.layers_to_capture = [2, num_layers // 2, num_layers - 3]
        elif layer_ids and layer_ids[0] == 1:
            self.model.layers_to_capture = [val + 1 for val in layer_ids]
        else:
            self.model.layers_to_capture = list(layer_ids)

class Wrapper:
    def __init__(self, config):
        self.language_model = None
        self.language_model = Target(config)
    def set_eagle3_layers_to_capture(self, layer_ids=None):
        self.language_model.set_eagle3_layers_to_capture(layer_ids)

class NoHook:
    pass

EntryClass = [Target, Wrapper, NoHook]
"""


def test_the_released_method_runs_on_stand_ins_and_delegation_is_followed():
    code = ReleasedCode.from_files("sglang", "0", {"sglang/srt/models/m.py": SET_IDS})
    rows = {d.architecture: d for d in derive_sglang.derive(code)}
    for arch in ("Target", "Wrapper"):  # the wrapper runs the inner model's released method
        d = rows[arch]
        assert (d.serves, d.id_rule, d.default_shift, d.embedding, d.final) == (True, "first_is_one", 0, False, False)
    assert not rows["NoHook"].serves and "no set_eagle3_layers_to_capture" in rows["NoHook"].why


# -- the committed table against the wheels ---------------------------------------------------------
def _wheel(engine: str) -> Path:
    found = sorted(WHEELS.glob(f"{engine}-{NEWEST[engine]}-*.whl"))
    require(f"the {engine} {NEWEST[engine]} wheel", bool(found), f"bash .ci/setup downloads it to {WHEELS}")
    return found[0]


def _body(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in ("first", "last", "source")}


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_the_committed_table_is_what_the_newest_release_derives(engine):
    """Re-derive the newest release from its wheel: every row must be in rules.json as derived, and
    the table's recorded wheel hash must be this wheel's. A difference means the engine changed
    (or the derivation did): run ``python -m pipeline.conventions.derive --all --write``."""
    code = ReleasedCode.from_wheel(_wheel(engine))
    table = json.loads(derive.TABLE.read_text())
    assert table["releases"][engine][code.version]["sha256"] == code.sha256
    derived = derive.release_rows(code)
    committed = [
        r
        for r in table["rules"]
        if r["engine"] == engine
        and R.release_tuple(r["first"]) <= R.release_tuple(code.version) <= R.release_tuple(r["last"])
    ]
    serving = {(r["architecture"], r["runner"]) for r in committed}
    want = sorted(
        json.dumps(_body(r), sort_keys=True)
        for r in derived
        if (r["architecture"], r["runner"]) in serving or r["serves"]
    )
    got = sorted(json.dumps(_body(r), sort_keys=True) for r in committed)
    assert got == want
    assert all(code.version in r["source"] for r in committed if r["last"] == code.version)


def test_the_readme_known_releases_paragraph_is_generated_from_the_table():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert R.known_releases_markdown() in " ".join(readme.split())  # as wrapped in the README


def test_vllm_readers_of_the_newest_release():
    """V1 reads the nested key, Model Runner V2 never does (it falls back to other tools' keys)."""
    rel = derive_vllm.derive(ReleasedCode.from_wheel(_wheel("vllm")))
    assert rel.readers["v1"].keys[:2] == ("top", "nested")
    assert "nested" not in rel.readers["v2"].keys and rel.readers["v2"].keys[0] == "top"
    assert rel.readers["v2"].shifts["dflash"] == 1
    # DSpark's key: a V2 fallback after dflash's (+1, capture-after ids), unknown to V1
    v2 = rel.readers["v2"].keys
    assert rel.readers["v2"].shifts["dspark"] == 1
    # precedence as the reader's `if not layer_ids:` chain runs; nested layer_ids comes last
    assert v2 == ("top", "dflash", "dspark", "target_layer_ids", "layer_ids")
    assert rel.readers["v1"].keys == ("top", "nested", "dflash")  # V1: the nested key overrides dflash's
    assert "dspark" not in rel.readers["v1"].keys


def test_submodules_are_followed_through_annotations_factories_and_init_helpers():
    """``self.language_model: X = factory(...)``, a registry factory naming the architecture, and
    ``self.model = self._init_model(...)`` all resolve to the class the engine would build."""
    src = textwrap.dedent("""
        class Inner:
            pass
        class Other:
            pass
        class Annotated:
            def __init__(self, config):
                self.language_model: Inner = init_vllm_registered_model(config)
        class Factory:
            def __init__(self, config):
                self.language_model = init_vllm_registered_model(config, architectures=["OtherArch"])
        class Helper:
            def __init__(self, config):
                self.model = self._init_model(config)
            def _init_model(self, config):
                return Other(config)
    """)
    index = CodeIndex(
        ReleasedCode.from_files("vllm", "0", {"vllm/model_executor/models/m.py": src}), "vllm/model_executor/models/"
    )
    index.factories["init_vllm_registered_model"] = lambda call: (
        "vllm.model_executor.models.m:Other" if any(k.arg == "architectures" for k in call.keywords) else None
    )
    key = "vllm.model_executor.models.m:{}".format
    assert index.attribute_class(key("Annotated"), "language_model") == key("Inner")
    assert index.attribute_class(key("Factory"), "language_model") == key("Other")
    assert index.attribute_class(key("Helper"), "model") == key("Other")
