"""An engine release's own Python code, read from its wheel (or installed package) and run on stand-ins.

Deriving a reading rule means asking the released code, not a person's reading of it. Engines
cannot be imported here (CUDA kernels, torch builds), so their files are parsed as text, the
few functions that decide which layers are captured are compiled from the released source and
called on stand-in objects (a model whose ``config.num_hidden_layers`` is N, a draft config
whose keys we choose). ``CodeIndex`` resolves classes across model files (imports, bases,
``__init__`` attributes) so a delegating wrapper runs the method its inner model really has.
"""

from __future__ import annotations

import ast
import builtins
import hashlib
import re
import textwrap
import typing
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from types import MethodType, SimpleNamespace

from pipeline.errors import UnusableInput


class EngineCodeError(UnusableInput):
    """A wheel that cannot be read, or released code that does not run on the stand-ins."""


@dataclass
class ReleasedCode:
    """The Python files of one released package: a wheel (zip) or an installed package directory."""

    engine: str
    version: str
    origin: str  # wheel file name or installed directory, for citations
    sha256: str | None  # of the wheel; None for an installed package
    _files: dict[str, str] = field(default_factory=dict, repr=False)
    _zip: zipfile.ZipFile | None = field(default=None, repr=False)
    _root: Path | None = field(default=None, repr=False)

    @classmethod
    def from_wheel(cls, path: Path) -> ReleasedCode:
        m = re.match(r"^([A-Za-z0-9_]+)-([^-]+)-", path.name)
        if not path.is_file() or not m:
            raise EngineCodeError(f"{path}: not a wheel file (expected NAME-VERSION-...whl)")
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        return cls(m[1].replace("_", "-"), m[2], path.name, digest, _zip=zipfile.ZipFile(path))

    @classmethod
    def from_installed(cls, engine: str, version: str, package_dir: Path) -> ReleasedCode:
        return cls(engine, version, str(package_dir), None, _root=package_dir.parent)

    @classmethod
    def from_files(cls, engine: str, version: str, files: dict[str, str]) -> ReleasedCode:
        """Code given as text (tests: a model file written to exercise one pattern)."""
        return cls(engine, version, "<files>", None, _files=dict(files))

    def names(self, prefix: str) -> list[str]:
        if self._zip is None and self._root is None:
            return sorted(n for n in self._files if n.startswith(prefix) and n.endswith(".py"))
        if self._zip is not None:
            return sorted(n for n in self._zip.namelist() if n.startswith(prefix) and n.endswith(".py"))
        assert self._root is not None
        return sorted(str(p.relative_to(self._root)) for p in (self._root / prefix).rglob("*.py"))

    def text(self, name: str) -> str | None:
        if name not in self._files:
            if self._zip is None and self._root is None:
                return None
            try:
                raw = self._zip.read(name) if self._zip is not None else (self._root / name).read_bytes()  # type: ignore[operator]
            except (KeyError, FileNotFoundError):
                return None
            self._files[name] = raw.decode("utf-8", errors="replace")
        return self._files[name]


@dataclass
class ClassInfo:
    key: str  # "pkg.module:Class"
    path: str  # file inside the package
    node: ast.ClassDef
    base_keys: list[str]

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def module(self) -> str:
        return self.key.split(":")[0]

    def own_method(self, name: str) -> ast.FunctionDef | None:
        for f in self.node.body:
            if isinstance(f, ast.FunctionDef) and f.name == name:
                return f
        return None


class CodeIndex:
    """Every class in a package subtree, with bases resolved through ``from X import Y``."""

    def __init__(self, code: ReleasedCode, *prefixes: str):
        self.code, self.prefix = code, prefixes[0]
        self.trees: dict[str, ast.Module] = {}
        self.imports: dict[str, dict[str, str]] = {}  # module -> local name -> "module:Name"
        self.classes: dict[str, ClassInfo] = {}
        self.module_path: dict[str, str] = {}
        self._compiled: dict[tuple[int, int], typing.Callable] = {}
        # Engine factories that build a submodule by name (vLLM's init_vllm_registered_model):
        # function name -> (call -> class key or None).
        self.factories: dict[str, typing.Callable[[ast.Call], str | None]] = {}
        for path in (p for prefix in prefixes for p in code.names(prefix)):
            try:
                tree = ast.parse(code.text(path) or "")
            except SyntaxError:
                continue
            module = path[:-3].replace("/", ".").removesuffix(".__init__")
            self.trees[module], self.module_path[module] = tree, path
            self.imports[module] = _imports(tree, module, path.endswith("__init__.py"))
        for module, tree in self.trees.items():
            for node in tree.body:
                if isinstance(node, ast.ClassDef):
                    bases = [k for b in node.bases if (k := self.resolve(module, b))]
                    self.classes[f"{module}:{node.name}"] = ClassInfo(
                        f"{module}:{node.name}", self.module_path[module], node, bases
                    )

    def source(self, module: str) -> str:
        return self.code.text(self.module_path[module]) or ""

    def resolve(self, module: str, expr: ast.expr) -> str | None:
        """The class key an expression names inside ``module`` (a local class or an import)."""
        if isinstance(expr, ast.Subscript):  # Generic[...] and the like
            return None
        if isinstance(expr, ast.Attribute):
            name = expr.attr
            mod = self.imports.get(module, {}).get(getattr(expr.value, "id", ""), "")
            return f"{mod.replace(':', '.')}:{name}" if mod else None
        if not isinstance(expr, ast.Name):
            return None
        tree = self.trees.get(module)
        if tree is not None and any(isinstance(n, ast.ClassDef) and n.name == expr.id for n in tree.body):
            return f"{module}:{expr.id}"
        return self.imports.get(module, {}).get(expr.id)

    def mro(self, key: str) -> list[ClassInfo]:
        out: list[ClassInfo] = []

        def walk(k: str) -> None:
            info = self.classes.get(k)
            if info is None or info in out:
                return
            out.append(info)
            for b in info.base_keys:
                walk(b)

        walk(key)
        return out

    def method(self, key: str, name: str) -> tuple[ClassInfo, ast.FunctionDef] | None:
        for info in self.mro(key):
            if (f := info.own_method(name)) is not None:
                return info, f
        return None

    def has_base(self, key: str, base_name: str) -> bool:
        """Does the class derive from ``base_name`` (e.g. ``SupportsEagle3``), resolved or not?"""
        for info in self.mro(key):
            if any(_base_name(b) == base_name for b in info.node.bases):
                return True
        return False

    def attribute_class(self, key: str, attr: str) -> str | None:
        """The class ``__init__`` assigns to ``self.<attr>`` (``self.model = LlamaModel(...)``)."""
        for info in self.mro(key):
            init = info.own_method("__init__")
            if init is None:
                continue
            defaults = _parameter_defaults(init)
            for node in ast.walk(init):
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                    for t in node.targets:
                        if isinstance(t, ast.Attribute) and t.attr == attr and getattr(t.value, "id", "") == "self":
                            found = self._built_by(key, info, node.value, defaults)
                            if found in self.classes:
                                return found
                # ``self.language_model: Gemma4ForCausalLM = init_vllm_registered_model(...)``
                if (
                    isinstance(node, ast.AnnAssign)
                    and isinstance(node.target, ast.Attribute)
                    and node.target.attr == attr
                    and getattr(node.target.value, "id", "") == "self"
                ):
                    ann = node.annotation
                    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
                        ann = ast.Name(ann.value)
                    found = self.resolve(info.module, ann)
                    if found in self.classes:
                        return found
        return None

    def class_attribute(self, key: str, attr: str) -> str | None:
        """A class-level ``attr = SomeClass`` (``model_cls = DeepseekV2Model``), resolved."""
        for info in self.mro(key):
            for node in info.node.body:
                if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == attr for t in node.targets):
                    got = self.resolve(info.module, node.value)
                    if got in self.classes:
                        return got
        return None

    def _built_by(self, key: str, info: ClassInfo, call: ast.Call, defaults: dict[str, ast.expr]) -> str | None:
        """The class a constructor call builds: ``X(...)``, ``cls_param(...)`` (its default), or
        ``self._init_model(...)`` (what that method returns)."""
        func = call.func
        if isinstance(func, ast.Name) and func.id in self.factories:
            return self.factories[func.id](call)
        if isinstance(func, ast.Name) and func.id in defaults:
            return self.resolve(info.module, defaults[func.id])
        if isinstance(func, ast.Attribute) and getattr(func.value, "id", "") == "self":
            if (cls_attr := self.class_attribute(key, func.attr)) is not None:
                return cls_attr
            found = self.method(key, func.attr)
            if found is None:
                return None
            m_info, fn = found
            for node in ast.walk(fn):
                if isinstance(node, ast.Return) and isinstance(node.value, ast.Call):
                    got = self.resolve(m_info.module, node.value.func)
                    if got in self.classes:
                        return got
            return None
        return self.resolve(info.module, func)

    def compile(self, info: ClassInfo, fn: ast.FunctionDef, n: int) -> typing.Callable:
        """The released function, compiled from its source text in a namespace of stand-ins."""
        cached = self._compiled.get((id(fn), n))
        if cached is None:
            cached = self._compiled[(id(fn), n)] = self._compile(info, fn, n)
        return cached

    def _compile(self, info: ClassInfo, fn: ast.FunctionDef, n: int) -> typing.Callable:
        return compile_released(self.code, info.path, fn, StandInGlobals(n, self, info.module))


def compile_released(code: ReleasedCode, path: str, fn: ast.FunctionDef, ns: dict) -> typing.Callable:
    """One released function, compiled from its source text into the globals ``ns``."""
    src = textwrap.dedent(ast.get_source_segment(code.text(path) or "", fn) or "")
    exec(compile(src, f"<{code.engine} {code.version} {path}>", "exec"), ns)  # the released source
    return ns[fn.name]


def _base_name(b: ast.expr) -> str:
    return b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""


def _imports(tree: ast.Module, module: str, package: bool = False) -> dict[str, str]:
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:  # relative import: from a package's __init__, "." is the package itself
                parts = module.split(".")
                parts = parts[: len(parts) - node.level + (1 if package else 0)]
                base = ".".join([*parts, node.module])
            for a in node.names:
                out[a.asname or a.name] = f"{base}:{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = f"{a.name}:"
    return out


class Anything:
    """A permissive stand-in for what the captured functions touch but do not decide on
    (loggers, parallel groups): every attribute, call and truth test succeeds."""

    def __getattr__(self, name: str) -> Anything:
        if name.startswith("__"):
            raise AttributeError(name)
        return Anything()

    def __call__(self, *a, **k) -> Anything:
        return Anything()

    def __bool__(self) -> bool:
        return True


class StandInGlobals(dict):
    """Globals for a compiled released function: builtins and typing names as themselves; a class
    of the package a type whose ``isinstance`` asks the stand-in's released bases; any other
    capitalised name a type nothing is an instance of; the rest (helpers, loggers) ``Anything``."""

    def __init__(self, n: int, index: CodeIndex | None = None, module: str = ""):
        super().__init__(__builtins__=builtins)
        self.n, self.index, self.module = n, index, module

    def __missing__(self, name: str):
        if hasattr(builtins, name):
            return getattr(builtins, name)
        if hasattr(typing, name):
            return getattr(typing, name)
        if name[:1].isupper():
            key = self.index.resolve(self.module, ast.Name(name)) if self.index else None
            return _released_class(name, key)
        return Anything()


def _released_class(name: str, key: str | None) -> type:
    class Check(type):
        def __instancecheck__(cls, obj) -> bool:
            return (
                isinstance(obj, StandInModel)
                and obj._key is not None
                and any(i.name == name for i in obj._index.mro(obj._key))
            )

    return Check(name, (), {})


def stand_in_config(n: int, **extra) -> SimpleNamespace:
    """A target config with N layers; ``text_config`` too, for multimodal wrappers."""
    text = SimpleNamespace(num_hidden_layers=n, **extra)
    return SimpleNamespace(num_hidden_layers=n, text_config=text, get_text_config=lambda: text, **extra)


class StandInModel:
    """An instance of a released model class: its methods are the released ones, its submodules
    (``self.model``, ``self.language_model``) are stand-ins of the classes ``__init__`` builds,
    ``layers`` is N plain objects, ``config`` has N layers, ``pp_group`` is the last rank."""

    def __init__(self, index: CodeIndex, key: str | None, n: int, made: list[StandInModel]):
        self.__dict__.update(_index=index, _key=key, _n=n, _made=made)
        made.append(self)

    @property
    def class_name(self) -> str:
        return self._key.split(":")[1] if self._key else "?"

    def __getattr__(self, name: str):
        index, key, n = self._index, self._key, self._n
        if name.startswith("__"):
            raise AttributeError(name)
        if key and (found := index.method(key, name)):
            return MethodType(index.compile(found[0], found[1], n), self)
        if name == "config":
            value = stand_in_config(n)
        elif name == "layers":
            value = [SimpleNamespace() for _ in range(n)]
        elif name == "pp_group":
            value = SimpleNamespace(is_last_rank=True, is_first_rank=True, world_size=1)
        elif name in ("start_layer",):
            value = 0
        elif name in ("end_layer",):
            value = n
        elif key and (child := index.attribute_class(key, name)):
            value = type(self)(index, child, n, self._made)
        else:
            raise AttributeError(f"{self.class_name} stand-in has no {name!r}")
        self.__dict__[name] = value
        return value


def _parameter_defaults(fn: ast.FunctionDef) -> dict[str, ast.expr]:
    args = fn.args
    positional = args.posonlyargs + args.args
    out = {a.arg: d for a, d in zip(positional[len(positional) - len(args.defaults) :], args.defaults, strict=True)}
    out.update({a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None})
    return out
