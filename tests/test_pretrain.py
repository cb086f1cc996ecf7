"""The trained tiny target: deterministic, cached by content, and worth speculating on."""

from __future__ import annotations

import json
import logging

from pipeline.demo.pretrain import (
    RECORD,
    PretrainRecipe,
    cache_key,
    corpus_documents,
    is_heldout,
    trained_tiny_target,
)
from pipeline.demo.tiny import train_tokenizer

# Small enough to train twice in seconds; same code path as the demo's recipe.
QUICK = PretrainRecipe(num_layers=2, hidden_size=64, steps=6, batch_size=4, seq_len=64, warmup_steps=2)


def test_training_is_deterministic_and_cached(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path / "cache"))
    a = trained_tiny_target(tmp_path / "a", QUICK, use_cache=False)
    b = trained_tiny_target(tmp_path / "b", QUICK, use_cache=False)
    ra, rb = (json.loads((d / RECORD).read_text()) for d in (a, b))
    assert ra["weights_sha256"] == rb["weights_sha256"]
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert ra["train_loss"] == rb["train_loss"] and ra["heldout_loss"] == rb["heldout_loss"]
    assert ra["train_loss"][-1][1] < ra["train_loss"][0][1]  # it learns

    # Cached by content: the first call trains into the cache, the second copies it.
    c = trained_tiny_target(tmp_path / "c", QUICK)
    with caplog.at_level(logging.INFO, logger="pipeline.demo.pretrain"):
        d = trained_tiny_target(tmp_path / "d", QUICK)
    assert "cache hit" in caplog.text
    assert json.loads((d / RECORD).read_text())["weights_sha256"] == ra["weights_sha256"]
    assert (c / "model.safetensors").read_bytes() == (d / "model.safetensors").read_bytes()
    # Another recipe is another key: never served from this cache entry.
    docs = corpus_documents(train_tokenizer(QUICK.vocab_size))
    assert cache_key(QUICK, docs) != cache_key(PretrainRecipe(**{**QUICK.__dict__, "seed": 1}), docs)
    assert cache_key(QUICK, docs) != cache_key(QUICK, docs[:-1])  # the corpus text is part of the key


def test_corpus_is_code_and_prose_with_a_heldout_split():
    docs = corpus_documents(train_tokenizer(2048))
    ids = [d for d, _ in docs]
    assert len(set(ids)) == len(ids)
    assert any(d.startswith("src:") for d in ids) and any(d.startswith("conv:") for d in ids)
    assert any("def " in text for d, text in docs if d.startswith("src:"))
    held = [d for d in ids if is_heldout(d, 0.05)]
    assert 0 < len(held) < 0.15 * len(ids)
    assert held == [d for d in ids if is_heldout(d, 0.05)]  # stable


def test_the_trained_target_is_worth_speculating_on(pretrained_target):
    """Its next token is learnable (far better than unigram statistics) and its layers differ."""
    rec = json.loads((pretrained_target / RECORD).read_text())
    assert rec["heldout_perplexity"] < 0.5 * rec["unigram_perplexity"]
    assert rec["heldout_next_token_accuracy"] > 0.1
    assert min(rec["adjacent_boundary_rel_l2"]) > 0.1
    assert rec["corpus"]["heldout_blocks"] > 0
