"""Drafts in other tools' layouts, written by those tools' own released code, run from their
wheels (downloaded by .ci/setup, never installed: their pins clash with this environment):

- SpecForge 0.2.0's SGLang exporter (``specforge/export/to_sglang.py``): the weight map and its
  required-keys check (``_serving_state``), the embedding dropped as ``export_to_sglang`` does, the
  config written by its draft class's config class (``LlamaConfig``), then its
  ``apply_legacy_rope_scaling``;
- speculators 0.9.0's ``Eagle3Converter`` (``speculators/convert/eagle/eagle3_converter.py``),
  which converts such a SpecForge/SGLang draft into the speculators format (``layers.0.*``,
  ``transformer_layer_config``, ``speculators_config.verifier``).

Only the package ``__init__`` files are bypassed (they import training stacks these writers do
not use); every writer function runs as released.
"""

from __future__ import annotations

import importlib
import json
import sys
import types
import zipfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

WHEELS = {"specforge": "specforge-0.2.0-py3-none-any.whl", "speculators": "speculators-0.9.0-py3-none-any.whl"}
_loaded: dict[str, object] = {}


def wheel_dir() -> Path:
    return Path(sys.prefix) / "share" / "strata-wheels"


def _unpacked(tool: str, into: Path) -> Path:
    from conftest import require

    whl = wheel_dir() / WHEELS[tool]
    name, version = WHEELS[tool].split("-")[:2]
    require(
        f"the {name} {version} wheel",
        whl.exists(),
        f"{whl}: .ci/setup downloads it (pip download --no-deps {name}=={version} -d {wheel_dir()})",
    )
    root = into / tool
    if not root.exists():
        with zipfile.ZipFile(whl) as z:
            z.extractall(root)
    return root


def _namespace(root: Path, *packages: str) -> None:
    """Packages whose ``__init__`` is not run: their modules import from the wheel's files."""
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    for name in packages:
        m = types.ModuleType(name)
        m.__path__ = [str(root / name.replace(".", "/"))]
        sys.modules[name] = m


def specforge(into: Path):
    """SpecForge's ``export.to_sglang`` module (and ``export.checkpoint_io`` behind it)."""
    if "specforge" not in _loaded:
        _namespace(_unpacked("specforge", into), "specforge", "specforge.export")
        _loaded["specforge"] = importlib.import_module("specforge.export.to_sglang")
    return _loaded["specforge"]


def speculators(into: Path):
    """speculators' ``convert.eagle.eagle3_converter`` module."""
    if "speculators" not in _loaded:
        _namespace(
            _unpacked("speculators", into),
            "speculators",
            "speculators.models",
            "speculators.models.eagle3",
            "speculators.convert",
            "speculators.convert.eagle",
        )
        config = importlib.import_module("speculators.config")
        pkg = sys.modules["speculators"]
        pkg.SpeculatorModelConfig, pkg.SpeculatorsConfig = config.SpeculatorModelConfig, config.SpeculatorsConfig
        pkg.VerifierConfig = config.VerifierConfig
        e3 = importlib.import_module("speculators.models.eagle3.config")
        sys.modules["speculators.models.eagle3"].Eagle3SpeculatorConfig = e3.Eagle3SpeculatorConfig
        pkg.SpeculatorModel = importlib.import_module("speculators.model").SpeculatorModel
        config.reload_schemas()  # what speculators/__init__.py ends with
        _loaded["speculators"] = importlib.import_module("speculators.convert.eagle.eagle3_converter")
    return _loaded["speculators"]


def specforge_export(strata_dir: Path, out: Path, ids: list[int] | None, work: Path) -> Path:
    """The draft in ``strata_dir`` (a Strata export) as SpecForge's exporter writes it, with
    ``ids`` in the nested eagle_config (None: no ids at all, as SpecForge's own configs ship)."""
    from transformers import LlamaConfig

    mod = specforge(work)
    cfg = json.loads((strata_dir / "config.json").read_text())
    for k in ("num_aux_hidden_states", "torch_dtype", "eagle_aux_hidden_state_layer_ids"):
        cfg.pop(k, None)
    if ids is None:
        cfg.pop("eagle_config", None)
    else:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(ids), "use_aux_hidden_state": True}
    state = {k: v for k, v in load_file(str(strata_dir / "model.safetensors")).items() if "embed" not in k.lower()}
    if "d2t" not in state:  # Strata's vLLM export of a full-vocab draft; SpecForge's draft always has the buffers
        state["d2t"] = torch.zeros(cfg["draft_vocab_size"], dtype=torch.int64)  # its defaults (llama3_eagle.py)
        state.setdefault("t2d", torch.ones(cfg["vocab_size"], dtype=torch.bool))
    served = mod._serving_state(state, mod.WEIGHT_MAPS["LlamaForCausalLMEagle3"])
    out.mkdir(parents=True)
    LlamaConfig(**cfg).save_pretrained(str(out))  # what the draft class's save_pretrained writes as config.json
    save_file(served, str(out / "model.safetensors"), metadata={"format": "pt"})
    mod.apply_legacy_rope_scaling(str(out))
    return out


def speculators_export(
    src: Path, out: Path, target: Path, ids: list[int] | None, work: Path, vocab_buffers: bool = True
) -> Path:
    """speculators' converter run on an eagle3 draft directory (SpecForge's, SGLang's, vLLM's): its
    ``eagle_aux_hidden_state_layer_ids`` argument is ``ids`` (None: it writes none).

    ``vocab_buffers=False``: the draft's ``d2t``/``t2d`` are dropped first, so the converter keeps
    the target vocab and writes none -- the only full-vocab form vLLM loads (it has no
    ``draft_id_to_target_id`` parameter for such a draft and refuses one)."""
    mod = speculators(work)
    if not vocab_buffers:
        bare = work / f"{out.name}-input"
        bare.mkdir(parents=True)
        (bare / "config.json").write_bytes((src / "config.json").read_bytes())
        state = {k: v for k, v in load_file(str(src / "model.safetensors")).items() if k not in ("d2t", "t2d")}
        save_file(state, str(bare / "model.safetensors"), metadata={"format": "pt"})
        src = bare
    mod.Eagle3Converter().convert(
        src, out, base_model=str(target), validate=False, eagle_aux_hidden_state_layer_ids=ids
    )
    return out
