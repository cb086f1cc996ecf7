"""What a released model's forward captures for an id, read statically from its layer loop.

Both engines capture with the same shape of code: inside ``for i in range(start, end)`` a test
``i in self.<ids>`` (or ``i + 1`` after the layer ran, or a per-layer flag), plus sites before
or after the loop (``self.start_layer``: the embedding; ``self.end_layer``: r_N). Where a site
stands relative to the layer call says which stream it sees: before layer i runs it is r_i,
after it r_{i+1}. The embedding is capturable only where that site copes with ``residual is
None`` (``hidden_states + residual`` raises at layer 0). A forward that only returns
``super().forward(...)`` is read in the base class that defines the loop. A capture handed
*into* the layer is followed one step, into a layer forward of the model's own module or of a
base class's module (where a subclass borrows its layers); beyond that its layer-0 behaviour is
reported as unknown, never guessed.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from pipeline.conventions.engine_code import ClassInfo, CodeIndex

LAST = ("end_layer", "num_hidden_layers", "num_layers", "len")  # names an after-loop site tests for r_N
HELPER = "_maybe_add_hidden_state"  # vLLM's shared capture helper


@dataclass(frozen=True)
class CaptureRange:
    embedding: bool | None  # r_0 capturable (None: handed into the layer, not read)
    final: bool  # r_N capturable
    counts_ids: bool  # the collector is sized by len(ids): repeated ids raise
    ids_are_boundaries: bool  # id k feeds r_k (False: the loop shifts them; see why)
    why: str = ""


def _tests(node: ast.AST, attr: str) -> list[ast.expr]:
    """The expressions tested for membership in ``self.<attr>`` (or passed to the helper) under node."""
    out = []
    for n in ast.walk(node):
        if (
            isinstance(n, ast.Compare)
            and any(isinstance(o, ast.In) for o in n.ops)
            and any(isinstance(c, ast.Attribute) and c.attr == attr for c in n.comparators)
        ):
            out.append(n.left)
        elif isinstance(n, ast.Call) and getattr(n.func, "attr", "") == HELPER and len(n.args) >= 2:
            out.append(n.args[1])
        elif (
            isinstance(n, ast.Call)
            and getattr(n.func, "id", "") == "getattr"
            and len(n.args) >= 2
            and getattr(n.args[1], "value", None) == "_is_layer_to_capture"
        ):
            flag = ast.copy_location(ast.Name("__flag__"), n)
            flag.flag_of = n  # type: ignore[attr-defined]
            out.append(flag)
    return out


def _offset(expr: ast.expr, var: str) -> int | None:
    """0 for ``i`` (or a per-layer flag), 1 for ``i + 1``, -1 for ``i - 1``; None otherwise."""
    if isinstance(expr, ast.Name) and expr.id in (var, "__flag__"):
        return 0
    if isinstance(expr, ast.BinOp) and getattr(expr.left, "id", "") == var and isinstance(expr.right, ast.Constant):
        return (
            expr.right.value
            if isinstance(expr.op, ast.Add)
            else -expr.right.value
            if isinstance(expr.op, ast.Sub)
            else None
        )
    return None


def _loop_var(loop: ast.For) -> str:
    t = loop.target
    return (
        t.id
        if isinstance(t, ast.Name)
        else t.elts[0].id
        if isinstance(t, ast.Tuple) and isinstance(t.elts[0], ast.Name)
        else "?"
    )


def _layer_call(stmt: ast.stmt) -> ast.Call | None:
    for n in ast.walk(stmt):
        if isinstance(n, ast.Call) and (
            getattr(n.func, "id", "") == "layer"
            or (isinstance(n.func, ast.Subscript) and getattr(n.func.value, "attr", "") == "layers")
        ):
            return n
    return None


def _residual_safe(stmt: ast.AST) -> bool | None:
    """Does this capture site cope with ``residual is None``? True when it guards the sum or never
    adds a residual; False for an unguarded ``hidden_states + residual``; None when it only hands
    the collector on (a call with no captured value of its own)."""
    src = ast.unparse(stmt)
    if "residual is not None" in src or "residual is None" in src:
        return True
    if "hidden_states + residual" in src or "residual + hidden_states" in src:
        return False
    appends = [
        n
        for n in ast.walk(stmt)
        if isinstance(n, ast.Call) and getattr(n.func, "attr", "") in ("append", "capture") and n.args
    ]
    return True if appends else None


def _loop_forward(index: CodeIndex, key: str) -> tuple[ClassInfo, ast.FunctionDef] | None:
    """The forward that runs the layer loop: the class's own, or -- while a forward only hands
    on to ``super().forward`` -- the next one up the MRO."""
    found = None
    for info in index.mro(key):
        fn = info.own_method("forward")
        if fn is None:
            continue
        found = found or (info, fn)
        if not any(
            isinstance(n, ast.Call)
            and getattr(n.func, "attr", "") == "forward"
            and isinstance(n.func.value, ast.Call)
            and getattr(n.func.value.func, "id", "") == "super"
            for n in ast.walk(fn)
        ) or any(isinstance(n, ast.For) for n in ast.walk(fn)):
            return info, fn
    return found


def capture_range(index: CodeIndex, key: str, attr: str) -> CaptureRange:
    found = _loop_forward(index, key)
    if found is None:
        return CaptureRange(None, False, False, False, f"{key} has no forward to read")
    info, fn = found
    where = f"{info.path} {info.name}.forward"
    loops = [n for n in ast.walk(fn) if isinstance(n, ast.For) and _tests(n, attr)]
    if not loops:
        return CaptureRange(None, False, False, False, f"{where} has no layer loop that tests self.{attr}")
    loop, var = loops[0], _loop_var(loops[0])
    call = next((c for st in loop.body if (c := _layer_call(st)) is not None), None)
    embedding: bool | None = False
    final = False
    shifted = []
    for stmt in _capture_statements(loop, attr):
        for expr in _tests(stmt, attr):
            off = _offset(expr, var)
            via = _handed_name(stmt, call)  # ``capture = aux.capture if i in ids else None; layer(..., kw=capture)``
            handed = via is not None or (call is not None and any(_within(expr, a) for a in _call_args(call)))
            seen = (
                1 if call is not None and not handed and expr.lineno > call.end_lineno else 0
            )  # r_i before layer i, r_{i+1} after
            if off is None or seen != off:
                shifted.append(ast.unparse(expr))
            elif seen == 0:  # this site also sees the embedding, at i = 0
                embedding = (
                    _handed_layer0(index, info, via or _keyword_of(call, expr)) if handed else _residual_safe(stmt)
                )
            else:  # i + 1 after the last layer: r_N
                final = True
    inside = {id(n) for n in ast.walk(loop)}
    outside = [
        s
        for s in ast.walk(fn)
        if isinstance(s, ast.stmt)
        and id(s) not in inside
        and _tests(s, attr)
        and not any(isinstance(c, ast.For) for c in ast.walk(s))
    ]
    final = final or any(
        any(w in ast.unparse(e) for w in LAST) and "- 1" not in ast.unparse(e) for s in outside for e in _tests(s, attr)
    )
    for s in outside:
        if any(
            "start_layer" in ast.unparse(e) or (isinstance(e, ast.Constant) and e.value == 0) for e in _tests(s, attr)
        ):
            embedding = True if _residual_safe(s) or _helper_safe(index, key) else embedding
    counts = any(
        isinstance(n, ast.Call)
        and getattr(n.func, "id", getattr(n.func, "attr", "")) == "AuxHiddenStatePacker"
        and any(isinstance(a, ast.Attribute) and a.attr == attr for x in n.args for a in ast.walk(x))
        for n in ast.walk(fn)
    )
    why = (
        f"{where} hands the capture into the layer; whether layer 0 (residual None) works is not read"
        if embedding is None
        else ""
    )
    if shifted:
        why = f"{where} tests {', '.join(shifted)} where the stream is another boundary: ids are not boundaries"
    return CaptureRange(embedding, final, counts, not shifted, why)


def _capture_statements(loop: ast.For, attr: str) -> list[ast.stmt]:
    """The innermost statements of the loop that hold a capture test (an ``if`` and its body, an
    assignment or call whose arguments test membership)."""
    out = []
    for n in ast.walk(loop):
        if isinstance(n, (ast.If, ast.Expr, ast.Assign, ast.AnnAssign)) and n is not loop and _tests(n, attr):
            if isinstance(n, ast.If) or not any(
                isinstance(p, ast.If) and _contains(p, n) and _tests(p.test, attr) for p in ast.walk(loop)
            ):
                out.append(n)
    # an If's test and the assignment inside it are one site: keep the outermost holder of each test
    tests = {}
    for st in out:
        for e in _tests(st, attr):
            if id(e) not in tests:
                tests[id(e)] = st
    return list({id(st): st for st in tests.values()}.values())


def _contains(parent: ast.AST, child: ast.AST) -> bool:
    return any(n is child for n in ast.walk(parent))


def _within(node: ast.AST, parent: ast.AST) -> bool:
    return _contains(parent, getattr(node, "flag_of", node))


# Shared SGLang capture sites a layer hands the collector to, and why layer 0 is safe there.
SAFE_SHARED_CAPTURES = {
    "prepare_attn_and_capture_last_layer_outputs": "layers/communicator.py captures the residual prepare_attn returns (the layer input at layer 0 too)",
    "prepare": "layers/layer_boundary/stage.py _prepare_attention captures the embedding when the stream has no residual",
}


def _handed_name(stmt: ast.stmt, call: ast.Call | None) -> str | None:
    """The layer call's keyword that receives the collector a capture statement assigned to a name."""
    if (
        call is None
        or not isinstance(stmt, ast.Assign)
        or len(stmt.targets) != 1
        or not isinstance(stmt.targets[0], ast.Name)
        or _contains(stmt, call)
    ):  # the layer call's own result
        return None
    name = stmt.targets[0].id
    return next((k.arg for k in call.keywords if isinstance(k.value, ast.Name) and k.value.id == name), None)


def _keyword_of(call: ast.Call | None, expr: ast.expr) -> str | None:
    for k in call.keywords if call is not None else ():
        if _within(expr, k.value):
            return k.arg
    return None


def _handed_layer0(index: CodeIndex, info: ClassInfo, kwarg: str | None) -> bool | None:
    """Follow a collector handed to the layer as ``kwarg`` one step: into a layer forward of the
    model's module (then its bases' modules), then either its own capture expression or a shared
    capture site."""
    if kwarg is None:
        return None
    modules = list(dict.fromkeys(c.module for c in index.mro(info.key)))  # a subclass may borrow its base's layers
    fns = [n for m in modules if (tree := index.trees.get(m)) for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    for fn in fns:
        if kwarg not in {a.arg for a in fn.args.args + fn.args.kwonlyargs}:
            continue
        for n in ast.walk(fn):
            if isinstance(n, ast.Call) and any(
                isinstance(k.value, ast.Name) and k.value.id == kwarg for k in n.keywords
            ):
                name = getattr(n.func, "attr", "")
                if name in SAFE_SHARED_CAPTURES and index.code.text(
                    f"{index.prefix.split('/models')[0]}/{SAFE_SHARED_CAPTURES[name].split()[0]}"
                ):
                    return True
            if (
                isinstance(n, ast.Call)
                and getattr(n.func, "attr", "") in ("append", "capture")
                and getattr(n.func.value, "id", "") == kwarg
            ):
                return _residual_safe(fn)
    return None


def _call_args(call: ast.Call | None) -> list[ast.expr]:
    return [] if call is None else [*call.args, *(k.value for k in call.keywords)]


def _helper_safe(index: CodeIndex, key: str) -> bool:
    found = index.method(key, HELPER)
    return found is not None and bool(_residual_safe(found[1]))
