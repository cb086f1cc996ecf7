"""Conversations built from the Python standard library's docstrings: the embedded default's
data (nothing is downloaded) and the probe's default prompts. Deterministic: the same
interpreter version gives the same conversations, in the same order."""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path

DOC_MODULES = (
    "json",
    "os",
    "re",
    "collections",
    "itertools",
    "functools",
    "pathlib",
    "string",
    "textwrap",
    "math",
    "statistics",
    "datetime",
    "random",
    "heapq",
    "bisect",
    "shutil",
    "tempfile",
    "csv",
    "argparse",
    "logging",
    "difflib",
    "fractions",
    "decimal",
    "calendar",
    "base64",
    "hashlib",
    "zlib",
    "gzip",
    "struct",
    "copy",
    "pprint",
    "enum",
    "typing",
    "dataclasses",
    "contextlib",
)


def _first_paragraph(doc: str, limit: int = 600) -> str:
    para = inspect.cleandoc(doc).split("\n\n")[0].strip()
    return para[:limit]


def stdlib_docstrings() -> list[tuple[str, str]]:
    """(qualified name, docstring) for public callables of a fixed list of stdlib modules."""
    out: list[tuple[str, str]] = []
    for mod_name in DOC_MODULES:
        mod = importlib.import_module(mod_name)
        for name in sorted(dir(mod)):
            if name.startswith("_"):
                continue
            obj = getattr(mod, name, None)
            doc = inspect.getdoc(obj) if callable(obj) else None
            if doc and len(doc) > 20:
                out.append((f"{mod_name}.{name}", doc))
    return out


def make_conversations(n: int | None = None, shape: str = "messages") -> list[dict]:
    """Deterministic Q&A conversations about stdlib functions (1-2 turns each)."""
    docs = stdlib_docstrings()
    convs = []
    for i, (qual, doc) in enumerate(docs):
        turns = [("user", f"What does `{qual}` do?"), ("assistant", _first_paragraph(doc))]
        rest = inspect.cleandoc(doc).split("\n\n")[1:]
        if i % 3 == 0 and rest and rest[0].strip():
            turns += [("user", "Tell me more."), ("assistant", rest[0].strip()[:600])]
        if shape == "sharegpt":
            convs.append({"conversations": [{"from": "human" if r == "user" else "gpt", "value": c} for r, c in turns]})
        else:
            convs.append({"messages": [{"role": r, "content": c} for r, c in turns]})
        if n is not None and len(convs) >= n:
            break
    return convs


def write_conversations(path: str | Path, n: int | None = None, shape: str = "messages") -> int:
    convs = make_conversations(n, shape)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in convs))
    return len(convs)
