"""Compute a target's identity from its directory: streamed SHA-256, cached per file."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

from schemas.identity import FileDigest, TargetIdentity, combine_digests

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
_CHUNK = 8 << 20
_lock = threading.Lock()


def _cache_path() -> Path:
    root = os.environ.get("STRATA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "strata")
    return Path(root) / "digests.json"


def _load_cache() -> dict:
    try:
        return json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _save_cache(cache: dict) -> None:
    # entries for files that are gone (temporary targets, test runs) would only grow the file
    cache = {k: v for k, v in cache.items() if os.path.exists(k.rsplit("|", 2)[0])}
    p = _cache_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(cache, sort_keys=True))
    os.replace(tmp, p)


def file_sha256(path: Path, use_cache: bool = True) -> str:
    """SHA-256 of a file; large weight files are hashed once per (path, size, mtime)."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    if use_cache:
        with _lock:
            hit = _load_cache().get(key)
        if hit:
            return hit
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    if use_cache:
        with _lock:
            cache = _load_cache()
            cache[key] = digest
            _save_cache(cache)
    return digest


def _digests(root: Path, names: list[str]) -> list[FileDigest]:
    return [FileDigest(name=n, size=(root / n).stat().st_size, sha256=file_sha256(root / n)) for n in names]


def chat_template_text(root: Path) -> str | None:
    """The chat template as the tokenizer will apply it (separate file or tokenizer_config)."""
    jinja = root / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    cfg = root / "tokenizer_config.json"
    if cfg.exists():
        tpl = json.loads(cfg.read_text()).get("chat_template")
        if isinstance(tpl, str):
            return tpl
    return None


def target_config(model_dir: str | Path) -> dict:
    """A target's ``config.json`` (the one reader: a missing or broken file names the target)."""
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"target {model_dir}: no config.json; expected a HuggingFace-format model directory"
        ) from None
    except json.JSONDecodeError as e:
        raise ValueError(f"target {model_dir}: config.json is not valid JSON ({e})") from None


def text_config(target_cfg: dict) -> dict:
    """The text model's config: a multimodal wrapper's ``text_config``, else the config itself."""
    return target_cfg.get("text_config") or target_cfg


def stop_token_ids(model_dir: str | Path) -> frozenset[int]:
    """The target's end-of-turn tokens, where generation stops (as vLLM and SGLang read them):
    ``generation_config.json``'s ``eos_token_id``, else ``config.json``'s."""
    gen = Path(model_dir) / "generation_config.json"
    for cfg in ([json.loads(gen.read_text())] if gen.exists() else []) + [text_config(target_config(model_dir))]:
        eos = cfg.get("eos_token_id")
        if eos is not None:
            return frozenset([eos] if isinstance(eos, int) else eos)
    return frozenset()


def target_identity(model_dir: str | Path, name: str | None = None, revision: str | None = None) -> TargetIdentity:
    root = Path(model_dir)
    cfg_path = root / "config.json"
    cfg = target_config(root)
    weights = sorted(p.name for p in root.iterdir() if p.name.endswith(WEIGHT_SUFFIXES))
    if not weights:
        raise FileNotFoundError(f"target {root}: no weight files ({', '.join(WEIGHT_SUFFIXES)})")
    tok = sorted(n for n in TOKENIZER_FILES if (root / n).exists())
    if not tok:
        raise FileNotFoundError(f"target {root}: no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    w, t = _digests(root, weights), _digests(root, tok)
    tpl = chat_template_text(root)
    text_cfg = text_config(cfg)
    return TargetIdentity(
        model_name=name or root.resolve().name,
        model_path=str(root.resolve()),
        revision=revision,
        architecture=(cfg.get("architectures") or ["unknown"])[0],
        num_layers=int(text_cfg["num_hidden_layers"]),
        hidden_size=int(text_cfg["hidden_size"]),
        vocab_size=int(text_cfg["vocab_size"]),
        weights=w,
        weights_sha256=combine_digests(w),
        config_sha256=file_sha256(cfg_path, use_cache=False),
        tokenizer=t,
        tokenizer_sha256=combine_digests(t),
        chat_template_sha256=hashlib.sha256(tpl.encode()).hexdigest() if tpl is not None else None,
    )
