"""A tiny, deterministic, locally built target: random-init Llama + a tokenizer trained on
the Python standard library's docstrings + a chat template. Nothing is downloaded."""

from __future__ import annotations

import importlib
import inspect
import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|start|>", "<|end|>"]

DOC_MODULES = (
    "json", "os", "re", "collections", "itertools", "functools", "pathlib", "string", "textwrap",
    "math", "statistics", "datetime", "random", "heapq", "bisect", "shutil", "tempfile", "csv",
    "argparse", "logging", "difflib", "fractions", "decimal", "calendar", "base64", "hashlib",
    "zlib", "gzip", "struct", "copy", "pprint", "enum", "typing", "dataclasses", "contextlib",
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


def train_tokenizer(vocab_size: int = 2048):
    """Byte-level BPE trained on local text, wrapped as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [doc for _, doc in stdlib_docstrings()] + [f"What does `{q}` do? Tell me more." for q, _ in stdlib_docstrings()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_target(
    out_dir: str | Path,
    num_layers: int = 6,
    hidden_size: int = 256,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    vocab_size: int = 2048,
    seed: int = 0,
    peaked_head: bool = True,
) -> Path:
    """Build a deterministic random-init Llama target in ``out_dir`` (safetensors).

    Heads default to a head size of 32 or more (at most 4 heads): vLLM's CPU attention
    supports head sizes from 32 up, so the same tiny target runs in every engine.
    """
    num_heads = num_heads or max(1, min(4, hidden_size // 32))
    num_kv_heads = num_kv_heads or max(1, num_heads // 2)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(vocab_size)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 8 // 3 // 16 * 16 or 16,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.convert_tokens_to_ids("<|end|>"),
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)  # HF's own init (normal, std initializer_range), seeded
    # With std-0.02 weights every next-token distribution is nearly uniform; a trained LM's
    # is peaked. Logits of std ~4 give the target confident, learnable predictions.
    # ``peaked_head=False`` keeps HF's init for pretraining (``pipeline.pretrain``).
    if peaked_head:
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, 4.0 / hidden_size**0.5)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    log.info("tiny target: %d layers, hidden %d, vocab %d -> %s", num_layers, hidden_size, len(tok), out)
    return out
