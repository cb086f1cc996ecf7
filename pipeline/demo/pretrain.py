"""Pretrain the tiny target on text that ships with Python, so it is worth speculating on.

A random-init target's next token is noise and its layers barely differ, so a draft learns
little from it and a shifted layer costs almost nothing. A few minutes of next-token
training on the standard library's sources (code) and the demo's docstring conversations
(prose, in the chat template) give it confident, learnable predictions and distinct layers.

Deterministic (seeded init, data order and thread count), and cached by content: the cache
key covers the recipe, the corpus text and the torch/transformers releases, so a second call
copies the cached directory instead of training again. ``strata_target.json`` beside the
weights records the training loss, held-out perplexity against a unigram baseline, held-out
next-token accuracy, and how far adjacent residual boundaries lie apart.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline import conventions
from pipeline.data.stdlib import DOC_MODULES, make_conversations
from pipeline.demo.tiny import make_tiny_target, train_tokenizer

log = logging.getLogger(__name__)

RECORD = "strata_target.json"
_RECIPE_VERSION = 1  # bump when the training code changes what a recipe produces


@dataclass(frozen=True)
class PretrainRecipe:
    """Everything that determines the trained target (part of the cache key)."""

    # 12 layers so that the EAGLE-3 aux layers (r_2, r_6, r_9) lie apart as in a real target;
    # hidden 128 = 4 heads of 32, the smallest head vLLM's CPU attention takes. ~100 s on 2 cores.
    num_layers: int = 12
    hidden_size: int = 128
    vocab_size: int = 2048
    seed: int = 0
    steps: int = 300
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    warmup_steps: int = 20
    heldout_fraction: float = 0.05
    conversation_repeats: int = 6  # the draft is trained on the conversations: weight them up
    threads: int = 2  # fixed: CPU matmul reductions depend on the thread count
    arch: str = "llama"  # or deepseek_v3 (pipeline.demo.tiny.ARCHS)


def cache_root() -> Path:
    root = os.environ.get("STRATA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "strata")
    return Path(root) / "targets"


# -- corpus ---------------------------------------------------------------------------------
def _source_pieces(max_chars: int = 3000) -> list[tuple[str, str]]:
    """The stdlib modules' own source files, cut at line boundaries into pieces (documents)."""
    import importlib

    out = []
    for name in DOC_MODULES:
        try:
            path = inspect.getsourcefile(importlib.import_module(name))
        except TypeError:  # a builtin module: no source
            path = None
        if not path or not os.path.exists(path):
            continue
        text, piece, size, k = Path(path).read_text(encoding="utf-8"), [], 0, 0
        for line in text.splitlines(keepends=True):
            piece.append(line)
            size += len(line)
            if size >= max_chars:
                out.append((f"src:{name}:{k}", "".join(piece)))
                piece, size, k = [], 0, k + 1
        if piece:
            out.append((f"src:{name}:{k}", "".join(piece)))
    return out


def corpus_documents(tok) -> list[tuple[str, str]]:
    """(document id, text): stdlib source pieces, then the demo conversations in the chat template."""
    convs = [
        (f"conv:{i}", tok.apply_chat_template(c["messages"], tokenize=False))
        for i, c in enumerate(make_conversations())
    ]
    return _source_pieces() + convs


def is_heldout(doc_id: str, fraction: float) -> bool:
    return int(hashlib.sha256(doc_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < fraction


def _blocks(docs: list[list[int]], seq_len: int, eos: int) -> list[list[int]]:
    """Pack documents (eos-separated) into windows of seq_len + 1 tokens (inputs + shifted labels)."""
    stream = [t for d in docs for t in (*d, eos)]
    window = seq_len + 1
    return [stream[i : i + window] for i in range(0, len(stream) - window + 1, seq_len)]


# -- train ----------------------------------------------------------------------------------
def cache_key(recipe: PretrainRecipe, docs: list[tuple[str, str]]) -> str:
    import torch
    import transformers

    h = hashlib.sha256(
        json.dumps(
            {
                "recipe": asdict(recipe),
                "v": _RECIPE_VERSION,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
            },
            sort_keys=True,
        ).encode()
    )
    for doc_id, text in docs:
        h.update(doc_id.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()


def trained_tiny_target(out_dir: str | Path, recipe: PretrainRecipe = PretrainRecipe(), use_cache: bool = True) -> Path:
    """The trained tiny target in ``out_dir``: from the cache when this recipe + corpus was
    trained before, else trained now (and cached)."""
    out = Path(out_dir)
    docs = corpus_documents(train_tokenizer(recipe.vocab_size))
    key = cache_key(recipe, docs)
    if (out / RECORD).exists() and json.loads((out / RECORD).read_text()).get("cache_key") == key:
        return out
    cached = cache_root() / key[:24]
    if not (use_cache and (cached / RECORD).exists()):
        tmp = Path(tempfile.mkdtemp(prefix="strata-target-", dir=_mkdir(cache_root() if use_cache else out.parent)))
        try:
            _pretrain(tmp, recipe, docs, key)
            if not use_cache:
                _replace_dir(tmp, out)
                return out
            _replace_dir(tmp, cached)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    else:
        log.info("trained tiny target: cache hit %s", cached)
    if out.resolve() != cached.resolve():
        tmp = Path(tempfile.mkdtemp(prefix=".strata-target-", dir=_mkdir(out.parent)))
        shutil.rmtree(tmp)
        shutil.copytree(cached, tmp)
        _replace_dir(tmp, out)
    return out


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def _replace_dir(src: Path, dst: Path) -> None:
    """Move a finished directory into place; a reader never sees a half-written target."""
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)


def _pretrain(out: Path, recipe: PretrainRecipe, docs: list[tuple[str, str]], key: str) -> None:
    import torch

    make_tiny_target(
        out,
        recipe.num_layers,
        recipe.hidden_size,
        vocab_size=recipe.vocab_size,
        seed=recipe.seed,
        peaked_head=False,
        arch=recipe.arch,
    )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    eos = tok.convert_tokens_to_ids("<|end|>")
    train_docs, held_docs, n_conv = [], [], 0
    for doc_id, text in docs:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if is_heldout(doc_id, recipe.heldout_fraction):
            held_docs.append(ids)
        else:
            reps = recipe.conversation_repeats if doc_id.startswith("conv:") else 1
            train_docs += [ids] * reps
            n_conv += doc_id.startswith("conv:")
    rng = random.Random(recipe.seed)
    rng.shuffle(train_docs)
    train, held = _blocks(train_docs, recipe.seq_len, eos), _blocks(held_docs, recipe.seq_len, eos)
    if not held or len(train) < recipe.batch_size:
        raise ValueError(
            f"pretrain corpus too small: {len(train)} train / {len(held)} held-out blocks of "
            f"{recipe.seq_len + 1} tokens"
        )

    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    torch.manual_seed(recipe.seed)
    try:
        model = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
        stats = _train(model, train, recipe, rng)
        stats |= _evaluate(model, train, held, recipe)
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out, safe_serialization=True)
    weights = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    record = {
        "cache_key": key,
        "recipe": asdict(recipe),
        "weights_sha256": weights,
        "corpus": {
            "documents": len(docs),
            "train_blocks": len(train),
            "heldout_blocks": len(held),
            "train_tokens_per_epoch": len(train) * recipe.seq_len,
            "conversations_in_train": n_conv,
        },
        **stats,
    }
    (out / RECORD).write_text(json.dumps(record, indent=1))
    log.info(
        "trained tiny target: loss %.3f -> %.3f, held-out perplexity %.1f (unigram %.1f), next-token acc %.2f",
        stats["train_loss"][0][1],
        stats["train_loss"][-1][1],
        stats["heldout_perplexity"],
        stats["unigram_perplexity"],
        stats["heldout_next_token_accuracy"],
    )


def _train(model, blocks: list[list[int]], r: PretrainRecipe, rng: random.Random) -> dict:
    import torch
    from tqdm import tqdm

    opt = torch.optim.AdamW(model.parameters(), lr=r.lr, betas=(0.9, 0.95), weight_decay=0.1)

    def lr_at(step: int) -> float:
        if step < r.warmup_steps:
            return r.lr * (step + 1) / r.warmup_steps
        return r.lr * 0.5 * (1 + math.cos(math.pi * (step - r.warmup_steps) / max(1, r.steps - r.warmup_steps)))

    order: list[int] = []
    curve, t0 = [], time.perf_counter()
    model.train()
    with tqdm(total=r.steps, desc="pretrain tiny target", unit="step", mininterval=2.0) as bar:
        for step in range(r.steps):
            if len(order) < r.batch_size:
                more = list(range(len(blocks)))
                rng.shuffle(more)
                order += more
            batch = torch.tensor([blocks[i] for i in order[: r.batch_size]])
            del order[: r.batch_size]
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            loss = _lm_loss(model, batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step % 10 == 0 or step == r.steps - 1:
                curve.append([step, round(loss.item(), 4)])
                bar.set_postfix(loss=f"{loss.item():.3f}")
            bar.update(1)
    return {
        "train_loss": curve,
        "train_seconds": round(time.perf_counter() - t0, 1),
        "train_tokens": r.steps * r.batch_size * r.seq_len,
    }


def _lm_loss(model, batch):
    import torch.nn.functional as F

    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))


def _evaluate(model, train: list[list[int]], held: list[list[int]], r: PretrainRecipe) -> dict:
    """Held-out perplexity and accuracy vs a unigram model of the training blocks, and the
    smallest relative L2 between adjacent residual boundaries (layers that differ)."""
    import torch
    import torch.nn.functional as F

    counts = torch.bincount(torch.tensor([t for b in train for t in b[1:]]), minlength=model.config.vocab_size)
    unigram = (counts.float() + 1) / (counts.sum() + counts.numel())
    model.eval()
    nll, hits, n, uni_nll, adjacent = 0.0, 0, 0, 0.0, []
    with torch.no_grad():
        for s in range(0, len(held), r.batch_size):
            batch = torch.tensor(held[s : s + r.batch_size])
            out = model(input_ids=batch[:, :-1], output_hidden_states=True)
            labels = batch[:, 1:].reshape(-1)
            logits = out.logits.reshape(-1, out.logits.shape[-1]).float()
            nll += F.cross_entropy(logits, labels, reduction="sum").item()
            hits += int((logits.argmax(-1) == labels).sum())
            uni_nll += -unigram.log()[labels].sum().item()
            n += labels.numel()
            hs = conventions.hf_residual_states(out.hidden_states)
            adjacent.append([((b - a).norm() / a.norm()).item() for a, b in zip(hs[:-1], hs[1:], strict=True)])
    per_boundary = [round(sum(col) / len(col), 4) for col in zip(*adjacent, strict=True)]
    return {
        "heldout_loss": round(nll / n, 4),
        "heldout_perplexity": round(math.exp(nll / n), 2),
        "unigram_perplexity": round(math.exp(uni_nll / n), 2),
        "heldout_next_token_accuracy": round(hits / n, 4),
        "heldout_tokens": n,
        "adjacent_boundary_rel_l2": per_boundary,
    }
