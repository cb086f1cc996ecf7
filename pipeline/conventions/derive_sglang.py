"""SGLang's reading rules, derived from a release's model files.

SGLang serves EAGLE-3 by calling the target's ``set_eagle3_layers_to_capture(ids)`` once at
start (a class without it cannot serve EAGLE-3: startup raises). For every architecture in a
model file's ``EntryClass`` this module runs that released method on a stand-in model with a
battery of id lists, and reads the list it leaves on the object whose forward loop checks it
(``layers_to_capture``, or per-layer ``_is_layer_to_capture`` flags). A small static check of
that forward says what a loop index means (the stream entering layer i, r_i; r_N when the
model also checks after its last layer), whether the collector refuses repeated ids
(``AuxHiddenStatePacker(len(layers_to_capture))`` raises when fewer states arrive), and
whether layer 0 can be captured at all (``hidden_states + residual`` with ``residual is
None`` raises).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from pipeline.conventions.boundaries import eagle3_default
from pipeline.conventions.capture_loop import capture_range
from pipeline.conventions.engine_code import CodeIndex, EngineCodeError, ReleasedCode, StandInModel

MODELS = "sglang/srt/models/"
METHOD = "set_eagle3_layers_to_capture"
DRAFT_HEAD = re.compile(r"(Eagle3?|NextN|MTP|Assistant\w*)$")  # draft / MTP heads registered beside targets
NOT_DERIVED = "not derived"  # rows the derivation could not settle are left out of the table
N = 12  # stand-in depth: large enough that every battery list is distinct
BATTERY = {"first_one": [1, 5, 9], "plain": [2, 6, 9], "zero": [0, 4, 8], "max_n": [3, 7, N]}


@dataclass(frozen=True)
class Derived:
    """What one SGLang release does for one architecture (a row before range merging)."""

    architecture: str
    module: str  # model file of the entry class
    serves: bool
    id_rule: str | None = None  # plus_one / first_is_one / max_is_n / as_is
    default_shift: int = 0  # absent ids: loop indices [2, N//2, N-3] + shift
    embedding: bool | None = None  # r_0 capturable (None: the static check could not tell)
    final: bool = False  # r_N capturable
    repeated: str = "merge"  # repeated ids: merged, or "raise" (the collector counts them)
    empty: str = "none"  # ids == []: "none" (nothing captured) or "default"
    source: str = ""  # file and function
    why: str = ""  # why it cannot serve, or what the static check could not read


def entry_classes(index: CodeIndex) -> list[tuple[str, str]]:
    """(module, class key) for every architecture a model file registers in ``EntryClass``."""
    out = []
    for module, tree in sorted(index.trees.items()):
        if not index.module_path[module].startswith(MODELS):
            continue
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "EntryClass" for t in node.targets):
                names = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
                for e in names:
                    key = index.resolve(module, e)
                    if key in index.classes and not DRAFT_HEAD.search(key):
                        out.append((module, key))
    return out


def _run(index: CodeIndex, key: str, ids: list[int] | None) -> tuple[list[int], StandInModel]:
    """The loop indices the released method asks the model to capture, and the object holding them."""
    made: list[StandInModel] = []
    root = StandInModel(index, key, N, made)
    getattr(root, METHOD)(ids)
    for obj in made:  # the object whose forward reads the list
        if "layers_to_capture" in obj.__dict__:
            got = obj.__dict__["layers_to_capture"]
            return [int(i) for i in got], obj
    for obj in made:
        if "layers" in obj.__dict__ and any(getattr(la, "_is_layer_to_capture", False) for la in obj.layers):
            return [i for i, la in enumerate(obj.layers) if getattr(la, "_is_layer_to_capture", False)], obj
    raise EngineCodeError(f"{METHOD} left no capture list on any submodule")


def _try(index: CodeIndex, key: str, ids: list[int]) -> list[int] | None:
    try:
        return _run(index, key, ids)[0]
    except IndexError:  # a flag set on layers[id]: an id past the last layer raises at startup
        return None


def _classify(results: dict[str, list[int] | None]) -> str | None:
    """The id rule every battery result agrees with; a list that raised (None) agrees with a rule
    that would ask for a loop index past the last layer (SGLang indexes its layers with it)."""

    def plus(ids):
        return [i + 1 for i in ids]

    candidates = {
        "plus_one": plus,
        "as_is": list,
        "first_is_one": lambda ids: plus(ids) if ids and ids[0] == 1 else list(ids),
        "max_is_n": lambda ids: list(ids) if ids and max(ids) == N else plus(ids),
    }
    for name, f in candidates.items():
        if all(results[k] == f(BATTERY[k]) if results[k] is not None else max(f(BATTERY[k])) >= N for k in BATTERY):
            return name
    return None


def derive_architecture(index: CodeIndex, module: str, key: str) -> Derived:
    arch = key.split(":")[1]
    short = module.rsplit(".", 1)[-1]
    found = index.method(key, METHOD)
    if found is None:
        return Derived(
            arch,
            short,
            False,
            source=f"{index.classes[key].path} {arch}",
            why=f"{arch} has no {METHOD} (SGLang raises at startup with EAGLE-3)",
        )
    info, _ = found
    source = f"{info.path} {info.name}.{METHOD}"
    try:
        results = {k: _try(index, key, ids) for k, ids in BATTERY.items()}
        default, owner = _run(index, key, None)
        empty, _ = _run(index, key, [])
        repeated, _ = _run(index, key, [2, 2, 6])
    except Exception as e:
        if "stand-in has no" in str(e):  # the stand-in lacks what this class builds: not derived
            return Derived(arch, short, False, source=source, why=f"{NOT_DERIVED}: {e}")
        # the released code itself refuses (an explicit raise, an index past the layers): cannot serve
        return Derived(arch, short, False, source=source, why=f"{METHOD} raises: {type(e).__name__}: {e}")
    id_rule = _classify(results)
    if id_rule is None:
        return Derived(
            arch,
            short,
            False,
            source=source,
            why=f"{METHOD} maps ids in no known way: {results}; extend derive_sglang._classify",
        )
    loop = eagle3_default(N)
    shift = next((s for s in (0, 1) if default == [k + s for k in loop]), None)
    if shift is None:
        return Derived(arch, short, False, source=source, why=f"unknown default capture list {default} for N={N}")
    reach = capture_range(index, owner._key, "layers_to_capture")
    return Derived(
        arch,
        short,
        True,
        id_rule,
        shift,
        reach.embedding,
        reach.final,
        "raise" if reach.counts_ids and len(set(repeated)) < len(repeated) else "merge",
        "none" if not empty else "default",
        source,
        reach.why,
    )


def derive(code: ReleasedCode) -> list[Derived]:
    """Every registered architecture of one SGLang release, in model-file order."""
    index = CodeIndex(code, MODELS)
    return [derive_architecture(index, module, key) for module, key in entry_classes(index)]
