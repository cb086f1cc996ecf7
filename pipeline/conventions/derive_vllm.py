"""vLLM's reading rules, derived from a release's code.

Three released pieces decide what a vLLM deployment feeds an EAGLE-3 draft, and each is run
here on stand-ins:

- the *id reader* of each model runner -- V1's ``GPUModelRunner._get_eagle3_aux_layers_from_config``,
  Model Runner V2's ``get_eagle3_aux_layers_from_config`` -- called on draft configs holding one
  key each (top-level, nested ``eagle_config``, the dflash / dspark / target_layer_ids /
  layer_ids fallbacks) and pairs of keys, which gives the keys it reads in precedence order;
- the *runner choice* ``VllmConfig._is_default_v2_model_runner_model``, called per architecture
  for a dense and an MoE target: where it says yes, a GPU deployment runs V2 unless told not to;
- each architecture's model class (the registry's ``_TEXT_GENERATION_MODELS`` /
  ``_MULTIMODAL_MODELS``): ``SupportsEagle3`` or not, its default ids
  (``get_eagle3_default_aux_hidden_state_layers``), and what its forward captures
  (``capture_loop``).
"""

from __future__ import annotations

import ast
import builtins
from dataclasses import dataclass, field
from types import MethodType, SimpleNamespace

from pipeline.conventions.capture_loop import capture_range
from pipeline.conventions.engine_code import (
    CodeIndex,
    ReleasedCode,
    StandInGlobals,
    StandInModel,
    compile_released,
)

AUX = "eagle_aux_hidden_state_layer_ids"
N = 12
IDS = [1, 5, 9]
# Each key a draft config can carry ids under, as a config holding only it.
KEY_CONFIGS = {
    "top": {AUX: IDS},
    "nested": {"eagle_config": {AUX: IDS}},
    "dflash": {"dflash_config": {"target_layer_ids": IDS}},
    "target_layer_ids": {"target_layer_ids": IDS},
    "layer_ids": {"eagle_config": {"layer_ids": IDS}},
    # DSpark's key, read as a fallback from 0.33. Its shift is derived for an EAGLE-3 draft's own
    # model type; V2 reads it unshifted for a ``deepseek_v41`` draft config, which is a DSpark
    # drafter, not an EAGLE-3 one, so no EAGLE-3 config Strata validates takes that branch.
    "dspark": {"dspark_target_layer_ids": IDS},
}
REGISTRY = "vllm/model_executor/models/registry.py"
V1_RUNNER = "vllm/v1/worker/gpu_model_runner.py"
RUNNER_CHOICE = "vllm/config/vllm.py"
# What the runner asks a model for when the draft names no ids (renamed in 0.18).
DEFAULT_IDS = ("get_eagle3_default_aux_hidden_state_layers", "get_eagle3_aux_hidden_state_layers")


@dataclass(frozen=True)
class Reader:
    """One runner's id reader: keys in precedence order, each with the shift it applies."""

    runner: str
    keys: tuple[str, ...]
    shifts: dict[str, int] = field(default_factory=dict, hash=False)
    empty_is_absent: bool = True  # ids == [] read as no ids (the model default)
    honours_use_aux: bool = False  # eagle_config.use_aux_hidden_state: false turns aux states off
    source: str = ""


@dataclass(frozen=True)
class Derived:
    architecture: str
    module: str
    serves: bool
    embedding: bool | None = None
    final: bool = False
    default: tuple[int, ...] = ()  # for N = 12
    v2_default_dense: bool = False  # a GPU runs V2 by default for a dense target of this arch
    v2_default_moe: bool = False
    source: str = ""
    why: str = ""
    text_model: bool = False  # a wrapper handing the ids to the text_config's architecture


TEXT_MODEL_WHY = "hands the ids unchanged to the language model the checkpoint's text_config names"


@dataclass
class Release:
    readers: dict[str, Reader]
    architectures: list[Derived]


class _HFConfig(SimpleNamespace):
    """A draft's hf_config as vLLM sees it: JSON keys as attributes, nested dicts stay dicts."""


def _spec(cfg: dict) -> SimpleNamespace:
    return SimpleNamespace(method="eagle3", draft_model_config=SimpleNamespace(hf_config=_HFConfig(**cfg)))


def _find_function(code: ReleasedCode, prefix: str, name: str) -> tuple[str, ast.FunctionDef] | None:
    for path in code.names(prefix):
        text = code.text(path) or ""
        if f"def {name}(" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return path, node
    return None


def _compile(code: ReleasedCode, path: str, fn: ast.FunctionDef, extra: dict | None = None):
    """``extra`` names the function's globals; a StandInGlobals given here is shared, so functions
    compiled into it see each other."""
    ns = extra if isinstance(extra, StandInGlobals) else StandInGlobals(N)
    if ns is not extra:
        ns.update(extra or {})
    return compile_released(code, path, fn, ns)


def derive_reader(code: ReleasedCode, runner: str) -> Reader | None:
    """Keys the runner reads, by calling its released reader on one-key and two-key configs."""
    if runner == "v1":
        found = _find_function(code, V1_RUNNER, "_get_eagle3_aux_layers_from_config")
        if found is None:
            return None
        path, fn = found
        f = _compile(code, path, fn)

        def call(cfg):
            return f(SimpleNamespace(speculative_config=_spec(cfg)))
    else:
        found = _find_function(code, "vllm/v1/worker/gpu/", "get_eagle3_aux_layers_from_config")
        if found is None:
            return None
        path, fn = found
        f = _compile(code, path, fn)

        def call(cfg):
            return f(_spec(cfg))

    shifts = {}
    for key, cfg in KEY_CONFIGS.items():
        got = call(cfg)
        if got:
            shifts[key] = int(list(got)[0]) - IDS[0]
    read = list(shifts)

    def wins(a: str, b: str) -> bool:  # with both keys present (different ids), whose are read?
        # a's first id 3 cannot be b's 1 after any shift of 0 or +1: no tie reads as a win
        cfg_a = _with_ids(KEY_CONFIGS[a], [3, 7, 11])
        merged = _merge(cfg_a, KEY_CONFIGS[b])
        got = call(merged)
        return bool(got) and int(list(got)[0]) - shifts[a] == 3

    order = sorted(read, key=lambda k: -sum(wins(k, o) for o in read if o != k))
    empty = not call({AUX: []})
    folder = V1_RUNNER if runner == "v1" else path.rsplit("/", 1)[0] + "/"
    honours = any("use_aux_hidden_state" in (code.text(p) or "") for p in code.names(folder))
    return Reader(runner, tuple(order), shifts, empty, honours, f"{path} {fn.name}")


def _with_ids(cfg: dict, ids: list[int]) -> dict:
    return {k: (_with_ids(v, ids) if isinstance(v, dict) else ids) for k, v in cfg.items()}


def _merge(a: dict, b: dict) -> dict:
    out = {**b}
    for k, v in a.items():
        out[k] = {**out[k], **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def registry(code: ReleasedCode) -> dict[str, tuple[str, str]]:
    """Architecture -> (module, class) from the registry's text-generation and multimodal tables."""
    tree = ast.parse(code.text(REGISTRY) or "")
    out = {}
    for node in tree.body:
        target = (
            node.targets[0]
            if isinstance(node, ast.Assign)
            else node.target
            if isinstance(node, ast.AnnAssign)
            else None
        )
        if getattr(target, "id", "") in ("_TEXT_GENERATION_MODELS", "_MULTIMODAL_MODELS") and isinstance(
            node.value, ast.Dict
        ):
            for k, v in zip(node.value.keys, node.value.values, strict=True):
                try:
                    arch, (module, cls) = ast.literal_eval(k), ast.literal_eval(v)[:2]
                except (ValueError, TypeError):
                    continue
                out[arch] = (module, cls)
    return out


class _Off:
    """What a plain EAGLE-3 deployment answers to a feature check the runner choice asks about
    (``self._dflash_needs_multi_kv_group()``, ``self.kv_transfer_config``): no, none, off."""

    def __bool__(self) -> bool:
        return False

    def __call__(self, *a, **k) -> _Off:
        return self

    def __getattr__(self, name: str) -> _Off:
        if name.startswith("__"):
            raise AttributeError(name)
        return self

    def __iter__(self):
        return iter(())

    def __int__(self) -> int:  # a count or size nobody set: 0
        return 0

    def __lt__(self, other) -> bool:
        return 0 < other

    def __gt__(self, other) -> bool:
        return 0 > other

    def __le__(self, other) -> bool:
        return 0 <= other

    def __ge__(self, other) -> bool:
        return 0 >= other


class _Deployment(SimpleNamespace):
    """A VllmConfig stand-in: the fields given, every other feature off."""

    def __getattr__(self, name: str) -> _Off:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Off()


class _Cuda(_Off):
    """``current_platform`` on a CUDA GPU: ``is_cuda()`` yes, every other platform question no."""

    def __getattr__(self, name: str):
        if name in ("is_cuda", "is_cuda_alike"):
            return lambda: True
        return super().__getattr__(name)


def _import_on_cuda(name, globals=None, locals=None, fromlist=(), level=0):
    """Imports inside the runner-choice code (``from vllm.platforms import current_platform``):
    the released package is not importable here; its platform is a CUDA GPU, the rest is off."""
    if not name.startswith("vllm"):
        return __import__(name, globals, locals, fromlist, level)
    return SimpleNamespace(**{n: (_Cuda() if n == "current_platform" else _Off()) for n in fromlist or ()})


# One GPU: every parallel size a runner choice may test is 1.
PARALLEL_ONE = {
    f"{k}_parallel_size": 1 for k in ("tensor", "pipeline", "data", "prefill_context", "decode_context", "expert")
}


def _v2_choice(code: ReleasedCode):
    """The released runner choice as f(arch, is_moe) -> bool (does a GPU run V2 with no env set?),
    or None for a release without Model Runner V2's switch."""
    found = _find_function(code, RUNNER_CHOICE, "use_v2_model_runner")
    if found is None:
        return None
    path, fn = found
    consts = StandInGlobals(N)
    consts.update(envs=SimpleNamespace(VLLM_USE_V2_MODEL_RUNNER=None), HAS_TRITON=True)
    for node in ast.parse(code.text(path) or "").body:
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "id", "") in ("frozenset", "set")
            and node.value.args
        ):
            consts[node.targets[0].id] = frozenset(ast.literal_eval(node.value.args[0]))
    tree = ast.parse(code.text(path) or "")
    helpers = [n for n in tree.body if isinstance(n, ast.FunctionDef)]  # default_v2_model_runner_architectures()
    consts["__builtins__"] = {**vars(builtins), "__import__": _import_on_cuda}
    for h in helpers:
        consts[h.name] = _compile(code, path, h, consts)
    use_v2 = _compile(code, path, fn, consts)
    per_model = _find_function(code, RUNNER_CHOICE, "_is_default_v2_model_runner_model")
    is_default = _compile(code, per_model[0], per_model[1], consts) if per_model else None

    def choice(arch: str, is_moe: bool) -> bool:
        mc = SimpleNamespace(
            runner_type="generate",
            architectures=[arch],
            is_moe=is_moe,
            is_quantized=False,
            is_hybrid=False,
            is_attention_free=False,
            is_diffusion=False,
        )
        # A plain EAGLE-3 deployment: no feature V2 lacks, no HiSparse or watermarking.
        cfg = _Deployment(
            model_config=mc,
            attention_config=SimpleNamespace(hisparse_config=None),
            watermark_config=None,
            _get_v2_model_runner_unsupported_features=lambda: [],
            speculative_config=_spec({}),
            parallel_config=_Deployment(**PARALLEL_ONE),
        )
        if is_default is not None:
            cfg._is_default_v2_model_runner_model = lambda: is_default(cfg)
        return bool(use_v2(cfg))

    return choice


def _class_key(index: CodeIndex, module: str, cls: str) -> str | None:
    key = f"{module if '.' in module else 'vllm.model_executor.models.' + module}:{cls}"
    if key not in index.classes:  # re-exported by a package: follow the import
        key = index.resolve(key.split(":")[0], ast.Name(cls)) or key
    return key if key in index.classes else None


def _registered(index: CodeIndex, table: dict[str, tuple[str, str]], call: ast.Call) -> str | None:
    """``init_vllm_registered_model(..., architectures=["DeepseekV2ForCausalLM"])``: the registered
    class. Without ``architectures`` the checkpoint's text config decides: not derivable."""
    for k in call.keywords:
        if k.arg == "architectures":
            try:
                names = ast.literal_eval(k.value)
            except ValueError:
                return None
            found = [table[a] for a in names if a in table]
            return _class_key(index, *found[0]) if found else None
    return None


def _text_config_built(index: CodeIndex, key: str, attr: str) -> bool:
    """Does ``__init__`` build ``self.<attr>`` with ``init_vllm_registered_model(hf_config=
    config.text_config)`` and no ``architectures`` -- the checkpoint's text config names the class?"""
    for info in index.mro(key):
        init = info.own_method("__init__")
        for node in ast.walk(init) if init else ():
            if (
                isinstance(node, (ast.Assign, ast.AnnAssign))
                and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "id", "") == "init_vllm_registered_model"
                and any(
                    isinstance(t, ast.Attribute) and t.attr == attr and getattr(t.value, "id", "") == "self"
                    for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                )
            ):
                kw = {k.arg: k.value for k in node.value.keywords}
                return "architectures" not in kw and "text_config" in ast.unparse(
                    kw.get("hf_config", ast.Constant(None))
                )
    return None


class _VllmModel(StandInModel):
    """A vLLM model stand-in. ``get_language_model()`` walks torch submodules in the released code;
    here it is what it returns for a wrapper: the ``language_model`` its ``__init__`` builds."""

    def __getattr__(self, name: str):
        if name == "get_language_model" and self._key and self._index.method(self._key, name):
            return lambda: self.language_model
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name != "language_model" or not self._key or not _text_config_built(self._index, self._key, name):
                raise
        self.__dict__[name] = _CheckpointTextModel(self._index, _mixin(self._index), self._n, self._made)
        return self.__dict__[name]


class _CheckpointTextModel(_VllmModel):
    """The language model a wrapper builds from the checkpoint's ``text_config``: its class is not
    in the code, only in the checkpoint. It stands in as an instance of the release's EAGLE-3 model
    mixin (the released ``_set_aux_hidden_state_layers`` runs), with itself as its ``.model``, so
    the derivation sees what the wrapper hands its language model; what that model then captures
    is its own architecture's row, looked up with the target's ``text_config`` (``releases``)."""

    def __getattr__(self, name: str):
        if name == "model":
            return self
        if name == "set_aux_hidden_state_layers":  # the released SupportsEagle3 method, on this model
            iface = next((k for k, c in self._index.classes.items() if c.name == "SupportsEagle3"), None)
            found = self._index.method(iface, name) if iface else None
            if found is not None:
                return MethodType(self._index.compile(found[0], found[1], self._n), self)
        return super().__getattr__(name)


def _mixin(index: CodeIndex) -> str | None:
    return next((k for k, c in index.classes.items() if c.name == "EagleModelMixin"), None)


def derive_architecture(index: CodeIndex, arch: str, module: str, cls: str, choice) -> Derived:
    key = _class_key(index, module, cls)
    v2 = (choice(arch, False), choice(arch, True)) if choice else (False, False)
    if key is None:
        return Derived(arch, module, False, why=f"{module}.py has no class {cls}")
    if not index.has_base(key, "SupportsEagle3"):
        return Derived(
            arch,
            module,
            False,
            why=f"{cls} does not implement SupportsEagle3",
            v2_default_dense=v2[0],
            v2_default_moe=v2[1],
        )
    made: list[StandInModel] = []
    try:
        root = _VllmModel(index, key, N, made)
        root.set_aux_hidden_state_layers(tuple(IDS))
        default_ids = getattr(root, DEFAULT_IDS[0], None) or getattr(root, DEFAULT_IDS[1])
        default = tuple(int(i) for i in default_ids())
    except Exception as e:
        return Derived(
            arch, module, False, why=f"{cls}'s EAGLE-3 interface raises on the stand-in: {type(e).__name__}: {e}"
        )
    owner = next((o for o in made if "aux_hidden_state_layers" in o.__dict__), None)
    if owner is None:
        return Derived(arch, module, False, why=f"{cls}.set_aux_hidden_state_layers stored no aux_hidden_state_layers")
    if tuple(owner.__dict__["aux_hidden_state_layers"]) != tuple(IDS):
        return Derived(
            arch, module, False, why=f"{cls} stores ids {IDS} as {owner.__dict__['aux_hidden_state_layers']}"
        )
    if isinstance(owner, _CheckpointTextModel):  # the ids reach the text model unchanged; it captures by its own row
        return Derived(
            arch,
            module,
            True,
            None,
            False,
            default,
            v2[0],
            v2[1],
            f"vllm/model_executor/models/{module}.py {cls}",
            TEXT_MODEL_WHY,
            text_model=True,
        )
    reach = capture_range(index, owner._key, "aux_hidden_state_layers")
    return Derived(
        arch,
        module,
        True,
        reach.embedding,
        reach.final,
        default,
        v2[0],
        v2[1],
        f"vllm/model_executor/models/{module}.py {cls}",
        reach.why,
    )


def derive(code: ReleasedCode) -> Release:
    index = CodeIndex(code, "vllm/model_executor/models/", "vllm/models/")
    table = registry(code)
    index.factories["init_vllm_registered_model"] = lambda call: _registered(index, table, call)
    readers = {r: got for r in ("v1", "v2") if (got := derive_reader(code, r)) is not None}
    choice = _v2_choice(code)
    archs = [derive_architecture(index, a, m, c, choice) for a, (m, c) in sorted(table.items())]
    return Release(readers, archs)
