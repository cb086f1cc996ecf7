"""A tiny, deterministic, locally built target: random-init Llama + a tokenizer trained on
the Python standard library's docstrings + a chat template. Nothing is downloaded."""

from __future__ import annotations

import logging
from pathlib import Path

from pipeline.data.stdlib import stdlib_docstrings

log = logging.getLogger(__name__)

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|start|>", "<|end|>"]


def train_tokenizer(vocab_size: int = 2048):
    """Byte-level BPE trained on local text, wrapped as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [doc for _, doc in stdlib_docstrings()] + [
        f"What does `{q}` do? Tell me more." for q, _ in stdlib_docstrings()
    ]
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


ARCHS = ("llama", "deepseek_v3")


def _llama_config(tok, num_layers: int, hidden_size: int, num_heads: int | None, num_kv_heads: int | None):
    from transformers import LlamaConfig

    num_heads = num_heads or max(1, min(4, hidden_size // 32))
    return LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 8 // 3 // 16 * 16 or 16,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads or max(1, num_heads // 2),
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.convert_tokens_to_ids("<|end|>"),
        pad_token_id=tok.pad_token_id,
    )


def _deepseek_v3_config(tok, num_layers: int, hidden_size: int, num_heads: int | None):
    """The incident's family in miniature: MLA attention, a dense first layer and MoE after it
    (128 routed experts in 8 groups, top 8 from the best 4 groups, one shared), yarn rope. Head
    sizes are multiples of 32, the rope is yarn and the routing is top 8 of 128 because SGLang's
    CPU kernels accept only those ("Only deepseek_yarn is supported for CPU"; on a CPU with AMX
    its grouped-top-k kernel takes top 8 of 128, 192, 256 or 384 experts, else "Unexpected
    topk"). ``moe_layer_freq``, ``topk_method``, ``scoring_func`` and ``ep_size`` are in every
    DeepSeek-V3 config.json with these values (sigmoid scores with a correction bias, which is
    what transformers' DeepseekV3 computes) and SGLang's ``deepseek_v2.py`` reads them;
    transformers' DeepseekV3Config has no defaults for them."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        moe_intermediate_size=max(64, hidden_size // 2 // 32 * 32),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads or max(1, min(4, hidden_size // 64)),
        num_key_value_heads=None,
        n_shared_experts=1,
        n_routed_experts=128,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        ep_size=1,
        kv_lora_rank=128,
        q_lora_rank=96,
        qk_rope_head_dim=32,
        qk_nope_head_dim=64,
        v_head_dim=64,
        max_position_embeddings=4096,
        num_nextn_predict_layers=0,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 2.0,
            "original_max_position_embeddings": 2048,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.convert_tokens_to_ids("<|end|>"),
        pad_token_id=tok.pad_token_id,
    )


def make_tiny_target(
    out_dir: str | Path,
    num_layers: int = 6,
    hidden_size: int = 256,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    vocab_size: int = 2048,
    seed: int = 0,
    peaked_head: bool = True,
    arch: str = "llama",
) -> Path:
    """Build a deterministic random-init target in ``out_dir`` (safetensors): a Llama, or a
    DeepSeek-V3-style model (``arch="deepseek_v3"``).

    Heads default to a head size of 32 or more (at most 4 heads): vLLM's CPU attention
    supports head sizes from 32 up, so the same tiny target runs in every engine.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch {arch!r}: expected one of {', '.join(ARCHS)}")
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(vocab_size)
    if arch == "deepseek_v3":
        cfg = _deepseek_v3_config(tok, num_layers, hidden_size, num_heads)
    else:
        cfg = _llama_config(tok, num_layers, hidden_size, num_heads, num_kv_heads)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)  # HF's own init (normal, std initializer_range), seeded
    # With std-0.02 weights every next-token distribution is nearly uniform; a trained LM's
    # is peaked. Logits of std ~4 give the target confident, learnable predictions.
    # ``peaked_head=False`` keeps HF's init for pretraining (``pipeline.demo.pretrain``).
    if peaked_head:
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, 4.0 / hidden_size**0.5)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    log.info("tiny target (%s): %d layers, hidden %d, vocab %d -> %s", arch, num_layers, hidden_size, len(tok), out)
    return out
