"""The embedded default: a tiny target, demo conversations and a config, built locally.

``python jobs/extract.py`` with no ``--config`` uses this, so the main job runs on a
fresh machine with nothing downloaded.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from schemas.config import ExtractConfig, load_config

log = logging.getLogger(__name__)

DEMO_ROOT = Path("strata-demo")


def ensure_demo(root: Path = DEMO_ROOT) -> Path:
    """Build (once) the tiny target, the conversations and ``extract.yaml``; return its path."""
    from pipeline.tiny import make_tiny_target, write_conversations

    root = root.resolve()
    target, conv, cfg_path = root / "target", root / "conversations.jsonl", root / "extract.yaml"
    if not (target / "config.json").exists():
        log.info("building the tiny target (6 layers, hidden 256, BPE tokenizer on stdlib docstrings) in %s", target)
        make_tiny_target(target, num_layers=6, hidden_size=256)
    if not conv.exists():
        n = write_conversations(conv)
        log.info("wrote %d demo conversations to %s", n, conv)
    train_path = root / "train.yaml"
    if not train_path.exists():
        train = {
            "dataset": str(root / "dataset"),
            "target": {"path": str(target), "name": "tiny-llama"},
            "output": str(root / "run"),
            # A random-weight target's greedy tokens are not the data's frequent tokens: keep the whole vocab.
            "draft_vocab_size": 2048,
            # CPU-sized: 4 TTT steps (the default is 7), small batches.
            "ttt_steps": 4,
            "batch_tokens": 2048,
            "epochs": 2,
            "metrics_every": 5,
            "checkpoint_every": 20,
            "optim": {"lr": 3.0e-3, "warmup_steps": 5},
            "deepspeed": {"zero_stage": 2, "dtype": "float32"},
            "num_workers": 2,
            "cpus_per_worker": 0.5,
        }
        train_path.write_text("# Strata training config (embedded default; edit freely)\n" + _yaml(train))
    if not cfg_path.exists():
        cfg = {
            "target": {"path": str(target), "name": "tiny-llama"},
            "source": {"uri": str(conv)},
            "output": {"uri": str(root / "dataset"), "rows_per_shard": 128},
            # The EAGLE-3 aux layers of a 6-layer target (o_1, o_2, o_3 = r_2, r_3, r_4) + what the LM head reads.
            "capture": ["layer_output:1", "layer_output:2", "layer_output:3", "final:post_norm"],
            "max_length": 512,
            # float32: CPUs without AVX512-BF16 run bf16 matmuls several times slower.
            "engine": {"name": "hf", "dtype": "float32", "device": "auto", "batch_tokens": 8192},
            "ray": {"num_actors": 1, "cpus_per_actor": 1, "cpus_per_tokenize_task": 0.5},
        }
        cfg_path.write_text("# Strata extraction config (embedded default; edit freely)\n" + _yaml(cfg))
    return cfg_path


def _yaml(obj: dict) -> str:
    import yaml

    return yaml.safe_dump(json.loads(json.dumps(obj)), sort_keys=False)


def demo_config(root: Path = DEMO_ROOT) -> ExtractConfig:
    return load_config(ensure_demo(root), ExtractConfig)
