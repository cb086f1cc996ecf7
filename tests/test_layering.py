"""The architecture's rules, executable: each test reads the source tree and fails on the
first violation, naming the file and line.

- ``schemas/`` holds contracts: it imports neither torch nor ``pipeline``.
- ``jobs/`` holds thin entrypoints that hand their arguments to the CLI.
- The packages of ``pipeline`` import each other without cycles, counting imports inside
  functions; a function-level import is kept only where it defers an optional engine
  (vLLM, SGLang), a module that loads torch (so a job's driver process stays light), keeps
  the CLI's startup light (``cli.py``, ``demo/story.py``), or keeps ``pipeline.engines`` free of
  pydantic for the GPU benchmark's torch-only machine (``engines/__init__.py``).
- The extraction job's driver loads neither torch nor transformers: its capture actors do.
- Integer layer-id arithmetic lives only in ``pipeline/conventions``, in ``schemas/`` too; ``n``
  and ``N`` name a layer count there, so nothing else outside it is called that.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAZY_ENTRYPOINTS = {"pipeline/cli.py", "pipeline/demo/story.py", "pipeline/engines/__init__.py"}
OPTIONAL_ENGINE_MODULES = {"pipeline.engines.vllm.engine", "pipeline.engines.sglang.engine"}
LAYER_NAMES = re.compile(r"num_layers|num_hidden_layers|layer_ids?$|^layer$|boundary|^[nN]$")


def py_files(folder: str) -> list[Path]:
    return sorted((REPO / folder).rglob("*.py"))


def rel(p: Path) -> str:
    return str(p.relative_to(REPO))


def imports(path: Path) -> list[tuple[str, int, bool]]:
    """(module, line, inside a function) for every import statement of a file."""
    tree = ast.parse(path.read_text())
    in_function: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            in_function.update(id(n) for n in ast.walk(fn) if n is not fn)
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out += [(a.name, n.lineno, id(n) in in_function) for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            mods = [f"{n.module}.{a.name}" for a in n.names] if n.module == "pipeline" else [n.module]
            out += [(m, n.lineno, id(n) in in_function) for m in mods]
    return out


def package(module: str) -> str:
    """``pipeline.engines.hf`` -> ``pipeline.engines``; top-level modules stand for themselves."""
    return ".".join(module.split(".")[:2])


def module_of(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        stack.append(u)
        for v in sorted(edges.get(u, ())):
            if state.get(v) == 1:
                return stack[stack.index(v) :] + [v]
            if v not in state and (c := visit(v)):
                return c
        stack.pop()
        state[u] = 2
        return None

    for u in sorted(edges):
        if u not in state and (c := visit(u)):
            return c
    return None


def test_schemas_import_neither_torch_nor_pipeline():
    bad = [
        f"{rel(p)}:{line} imports {m}"
        for p in py_files("schemas")
        for m, line, _ in imports(p)
        if m.split(".")[0] in ("torch", "pipeline", "numpy", "transformers")
    ]
    assert not bad, "schemas/ holds contracts only:\n" + "\n".join(bad)


def test_jobs_are_thin_entrypoints():
    for p in py_files("jobs"):
        mods = {m for m, _, _ in imports(p)}
        assert mods <= {"_bootstrap", "pipeline.cli", "sys", "pathlib"}, f"{rel(p)} imports {sorted(mods)}"
        assert len(p.read_text().splitlines()) <= 20, f"{rel(p)}: a job entrypoint hands over to the CLI"


def test_pipeline_packages_import_without_cycles():
    edges: dict[str, set[str]] = defaultdict(set)
    for p in py_files("pipeline"):
        src = package(module_of(p))
        for m, _, _ in imports(p):
            if m.startswith("pipeline.") and package(m) != src:
                edges[src].add(package(m))
    assert find_cycle(edges) is None, f"import cycle between packages: {' -> '.join(find_cycle(edges))}"


def type_checking_lines(path: Path) -> set[int]:
    """Lines of imports under ``if TYPE_CHECKING:``, which never run."""
    return {
        n.lineno
        for block in ast.walk(ast.parse(path.read_text()))
        if isinstance(block, ast.If) and _name(block.test) == "TYPE_CHECKING"
        for n in ast.walk(block)
        if isinstance(n, ast.Import | ast.ImportFrom)
    }


def loads_at_import(module: str, heavy: tuple[str, ...], seen: set[str] | None = None) -> list[str]:
    """The chain of module-level imports through which importing ``module`` loads one of
    ``heavy`` (e.g. torch); empty when it does not."""
    seen = set() if seen is None else seen
    path = REPO / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = REPO / module.replace(".", "/") / "__init__.py"
    if module in seen or not path.exists():
        return []
    seen.add(module)
    skip = type_checking_lines(path)
    for m, line, inner in imports(path):
        if inner or line in skip:
            continue
        if m.split(".")[0] in heavy:
            return [module, m]
        if m.startswith(("pipeline.", "schemas.")) and (chain := loads_at_import(m, heavy, seen)):
            return [module, *chain]
    return []


def test_function_level_imports_only_defer_optional_engines_or_torch():
    bad = []
    for p in py_files("pipeline"):
        if rel(p) in LAZY_ENTRYPOINTS:
            continue
        bad += [
            f"{rel(p)}:{line} imports {m} inside a function"
            for m, line, inner in imports(p)
            if inner
            and m.startswith(("pipeline", "schemas"))
            and m not in OPTIONAL_ENGINE_MODULES
            and not loads_at_import(m, ("torch",))
        ]
    assert not bad, "import at module level (or move the shared piece down a layer):\n" + "\n".join(bad)


def test_the_extraction_driver_loads_neither_torch_nor_transformers():
    chain = loads_at_import("pipeline.extract.job", ("torch", "transformers"))
    assert not chain, "the extraction job's process would import " + " -> ".join(chain)


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call):
        return _name(node.func)
    return None


def layer_arithmetic(source: str) -> list[str]:
    """Expressions that compute a layer id: arithmetic on a layer count or boundary index, or
    indexing a model's layers / HF's hidden_states."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub | ast.FloorDiv | ast.Mult):
            if any(LAYER_NAMES.search(_name(side) or "") for side in (node.left, node.right)):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Subscript) and _name(node.value) in ("layers", "hidden_states"):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_layer_id_arithmetic_only_in_conventions():
    bad = [
        f"{rel(p)}:{hit}"
        for p in py_files("pipeline") + py_files("schemas")
        if "conventions" not in p.parts
        for hit in layer_arithmetic(p.read_text())
    ]
    assert not bad, "layer ids are computed only in pipeline/conventions:\n" + "\n".join(bad)


def test_the_rules_catch_what_they_forbid():
    """Each detector flags a planted violation (else the tests above pass vacuously)."""
    assert layer_arithmetic("ids = [2, num_layers // 2, num_layers - 3]")
    assert layer_arithmetic("k = n + 1") and layer_arithmetic("return self.layer + 1")
    assert layer_arithmetic("h = out.hidden_states[k]") and layer_arithmetic("m = model.layers[i - 1]")
    assert not layer_arithmetic("x = tokens[i - 1] + step * 2")
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}}) is None
    assert loads_at_import("pipeline.extract.worker", ("torch",))[-1] == "torch"


def test_the_tree_is_ruff_formatted():
    """``ruff format`` (line length 120, pyproject.toml) holds across the tree: style is the
    formatter's, never a review topic."""
    import shutil
    import subprocess
    import sys

    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    r = subprocess.run([ruff, "format", "--check", "."], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, f"run `ruff format .`:\n{r.stdout[-2000:]}"
