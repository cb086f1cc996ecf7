"""Derive the reading-rule table from the engines' released code.

    python -m pipeline.conventions.derive --engine sglang --release 0.5.23         # one release, printed
    python -m pipeline.conventions.derive --engine vllm --wheel DIR/vllm-0.33.0-...whl
    python -m pipeline.conventions.derive --all --wheels DIR --write               # the committed table

A release is read from its wheel (``--wheel``, or downloaded with ``pip download --no-deps``
into ``--wheels``). ``--write`` rebuilds ``rules.json`` from every release named in
``RELEASES``: consecutive releases that read ids the same way merge into one range, and each
row cites the wheel, file and function it came from. The table is generated, never edited.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

from pipeline.conventions import derive_sglang, derive_vllm
from pipeline.conventions.boundaries import eagle3_default
from pipeline.conventions.engine_code import EngineCodeError, ReleasedCode

TABLE = Path(__file__).with_name("rules.json")
# Every release with EAGLE-3, first to newest (``.postN`` builds carry their release's code).
RELEASES = {
    "sglang": ["0.4.9", "0.4.10", *(f"0.5.{i}" for i in range(1, 24))],
    "vllm": [
        "0.11.0",
        "0.11.1",
        "0.11.2",
        "0.12.0",
        "0.13.0",
        "0.14.0",
        "0.14.1",
        "0.15.0",
        "0.15.1",
        "0.16.0",
        "0.17.0",
        "0.17.1",
        "0.18.0",
        "0.18.1",
        "0.19.0",
        "0.19.1",
        "0.20.0",
        "0.20.1",
        "0.20.2",
        "0.21.0",
        "0.22.0",
        "0.22.1",
        "0.23.0",
        "0.24.0",
        "0.25.0",
        "0.25.1",
        "0.26.0",
        "0.27.0",
        "0.27.1",
        "0.28.0",
        "0.29.0",
        "0.30.0",
        "0.31.0",
        "0.32.0",
        "0.33.0",
    ],
}
SGLANG_KEYS = ("nested",)  # SGLang reads eagle_config.eagle_aux_hidden_state_layer_ids only (see rows' source)


def wheel_for(engine: str, release: str, wheels: Path) -> Path:
    """The release's wheel in ``wheels``, downloaded (no dependencies) when missing."""
    found = sorted(wheels.glob(f"{engine}-{release}-*.whl"))
    if not found:
        wheels.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels), f"{engine}=={release}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(wheels.glob(f"{engine}-{release}-*.whl"))
        if done.returncode or not found:
            raise EngineCodeError(f"could not download {engine}=={release}: {done.stderr.strip()[-300:]}")
    return found[0]


def release_rows(code: ReleasedCode) -> list[dict]:
    """The rule rows one release yields (before merging ranges)."""
    if code.engine == "sglang":  # rows the derivation could not settle are left out: measured or refused
        return [
            _sglang_row(code, d) for d in derive_sglang.derive(code) if not d.why.startswith(derive_sglang.NOT_DERIVED)
        ]
    rel = derive_vllm.derive(code)
    rows = []
    for d in rel.architectures:
        if not d.serves:  # not SupportsEagle3, or not settled on the stand-ins: no row either way
            continue
        for runner in ("v1", "v2"):
            reader = rel.readers.get(runner)
            if reader is None and runner == "v2":
                continue
            rows.append(
                {
                    "engine": "vllm",
                    "architecture": d.architecture,
                    "module": d.module,
                    "runner": runner,
                    "serves": True,
                    "id_rule": "as_is" if reader else "ignored",
                    "keys": list(reader.keys) if reader else [],
                    "key_shifts": dict(reader.shifts) if reader else {},
                    "default_shift": _shift(d.default),
                    "embedding": d.embedding,
                    "final": d.final,
                    "repeated": "merge",
                    "empty": "default" if reader is None or reader.empty_is_absent else "none",
                    "use_aux_flag": bool(reader and reader.honours_use_aux),
                    "gpu_default": {"dense": d.v2_default_dense, "moe": d.v2_default_moe} if runner == "v2" else None,
                    "source": f"{d.source}; {reader.source if reader else 'no id reader: the model default only'}",
                    "why": d.why,
                    "text_model": d.text_model,
                }
            )
    return rows


def _shift(default: tuple[int, ...]) -> int:
    return next((s for s in (0, 1) if list(default) == [k + s for k in eagle3_default(derive_vllm.N)]), 0)


def _sglang_row(code: ReleasedCode, d: derive_sglang.Derived) -> dict:
    return {
        "engine": "sglang",
        "architecture": d.architecture,
        "module": d.module,
        "runner": None,
        "serves": d.serves,
        "id_rule": d.id_rule,
        "keys": list(SGLANG_KEYS),
        "key_shifts": {"nested": 0},
        "default_shift": d.default_shift,
        "embedding": d.embedding,
        "final": d.final,
        "repeated": d.repeated,
        "empty": d.empty,
        "gpu_default": None,
        "use_aux_flag": _sglang_use_aux(code),
        "source": d.source,
        "why": d.why,
        "text_model": False,
    }


def _sglang_use_aux(code: ReleasedCode) -> bool:
    """Does this release honour ``eagle_config.use_aux_hidden_state`` (read where it reads the ids)?"""
    return any(
        "use_aux_hidden_state" in (code.text(p) or "")
        for p in code.names("sglang/srt/speculative/") + code.names("sglang/srt/model_executor/")
    )


def merge(per_release: dict[str, list[dict]], order: list[str]) -> list[dict]:
    """Consecutive releases with the same row for an (architecture, runner) become one range."""
    out: list[dict] = []
    open_rows: dict[tuple, dict] = {}
    for release in order:
        seen = set()
        for row in per_release.get(release, []):
            key = (row["architecture"], row["runner"])
            seen.add(key)
            body = {k: v for k, v in row.items() if k != "source"}
            cur = open_rows.get(key)
            if cur is not None and cur["_body"] == body and cur["last"] == _previous(order, release):
                cur["last"], cur["source"] = release, row["source"]
                continue
            cur = {**row, "first": release, "last": release, "_body": body}
            open_rows[key] = cur
            out.append(cur)
        for key in [k for k in open_rows if k not in seen]:
            del open_rows[key]  # the architecture left the release: a later return opens a new range
    for row in out:
        row.pop("_body")
        row["source"] = f"{row['engine']} {row['last']} {row['source']}"
    # Architectures that never serve EAGLE-3 in any release are left out (the table says nothing).
    serving = {(r["engine"], r["architecture"]) for r in out if r["serves"]}
    return [r for r in out if (r["engine"], r["architecture"]) in serving]


def _previous(order: list[str], release: str) -> str | None:
    i = order.index(release)
    return order[i - 1] if i else None


def _derivation_digest(engine: str) -> str:
    """Of the derivation's own code: cached rows are reused only while it is unchanged."""
    here = Path(__file__).parent
    files = ("derive.py", f"derive_{engine}.py", "capture_loop.py", "engine_code.py")
    return hashlib.sha256(b"".join((here / f).read_bytes() for f in files)).hexdigest()[:16]


def cached_rows(code: ReleasedCode, cache: Path) -> list[dict]:
    """``release_rows``, kept beside the wheels by wheel hash and derivation digest (a rerun after
    a failure, or of an unchanged derivation, skips the releases already done)."""
    path = (
        cache
        / f"derived-{code.engine}-{code.version}-{(code.sha256 or 'installed')[:16]}-{_derivation_digest(code.engine)}.json"
    )
    if path.exists():
        return json.loads(path.read_text())
    rows = release_rows(code)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rows))
    tmp.replace(path)
    return rows


def build_table(wheels: Path, engines: list[str], log=print) -> dict:
    """Derive every release of every engine named; the table ``rules.json`` holds."""
    table: dict = {"generated_by": "python -m pipeline.conventions.derive --all --write", "releases": {}, "rules": []}
    for engine in engines:
        per_release, info = {}, {}
        for release in tqdm(RELEASES[engine], desc=f"derive {engine}", unit="release", disable=None):
            path = wheel_for(engine, release, wheels)
            code = ReleasedCode.from_wheel(path)
            per_release[release] = cached_rows(code, wheels)
            info[release] = {"wheel": path.name, "sha256": code.sha256}
            log(f"derive: {engine} {release}: {sum(r['serves'] for r in per_release[release])} serving rows")
        table["releases"][engine] = info
        table["rules"] += merge(per_release, RELEASES[engine])
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.conventions.derive", description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=["sglang", "vllm"])
    ap.add_argument("--release", help="a release to download and derive (with --engine)")
    ap.add_argument("--wheel", type=Path, help="a wheel file to derive")
    ap.add_argument("--wheels", type=Path, default=Path(".venv/share/strata-wheels"), help="where wheels are kept")
    ap.add_argument("--all", action="store_true", help="every release in RELEASES")
    ap.add_argument("--write", action="store_true", help=f"write the table to {TABLE.name} (with --all)")
    args = ap.parse_args(argv)
    try:
        if args.all:
            table = build_table(
                args.wheels,
                [args.engine] if args.engine else ["sglang", "vllm"],
                log=lambda m: print(m, file=sys.stderr),
            )
            text = json.dumps(table, indent=1, sort_keys=True) + "\n"
            if args.write:
                tmp = TABLE.with_suffix(".tmp")
                tmp.write_text(text)
                tmp.replace(TABLE)
                print(f"wrote {TABLE} ({len(table['rules'])} rules)")
            else:
                print(text)
            return 0
        if not (args.wheel or (args.engine and args.release)):
            ap.error("give --wheel, or --engine with --release, or --all")
        path = args.wheel or wheel_for(args.engine, args.release, args.wheels)
        rows = release_rows(ReleasedCode.from_wheel(path))
        print(json.dumps(rows, indent=1))
        return 0
    except EngineCodeError as e:
        print(f"derive: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
