"""The four jobs as a user runs them on a cluster: `ray job submit --working-dir .` against
a Ray head started on 127.0.0.1 (only that cluster is stopped afterwards), extract ->
train -> validate (recording into a registry) -> promote, then the registry is checked."""

import json
import os
import subprocess
import sys
from pathlib import Path

from pipeline.registry.registry import Registry
from pipeline.registry.store import LocalStore
from pipeline.store.reader import DatasetReader

REPO = Path(__file__).resolve().parents[1]


def submit(cluster, *argv: str) -> subprocess.CompletedProcess:
    ray_bin = str(Path(sys.executable).parent / "ray")
    return subprocess.run([ray_bin, "job", "submit", "--address", cluster["dashboard"], "--working-dir", ".", "--",
                           "python", *argv], cwd=REPO, env={**os.environ, **cluster["env"]}, capture_output=True,
                          text=True, timeout=900)


def ok(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    assert "succeeded" in res.stdout, res.stdout[-2000:]
    return res.stdout


def test_extract_train_validate_promote_through_ray_job_submit(ray_cluster, tiny_target, conversations, tmp_path):
    ds, run, reg_dir = tmp_path / "ds", tmp_path / "run", tmp_path / "registry"
    (tmp_path / "extract.yaml").write_text(json.dumps({
        "target": {"path": str(tiny_target)}, "source": {"uri": str(conversations)},
        "output": {"uri": str(ds), "rows_per_shard": 16},
        "capture": ["layer_output:1", "layer_output:2", "layer_output:3", "final:post_norm"], "max_length": 128,
        "engine": {"dtype": "float32", "device": "cpu"}, "fingerprint": {"probe_samples": 4},
        "ray": {"num_actors": 1, "cpus_per_actor": 1, "cpus_per_tokenize_task": 0.5}}))
    ok(submit(ray_cluster, "jobs/extract.py", "--config", str(tmp_path / "extract.yaml"), "--no-progress"))
    assert DatasetReader(str(ds)).manifest.totals.rows == 40

    (tmp_path / "train.yaml").write_text(json.dumps({
        "dataset": str(ds), "target": {"path": str(tiny_target)}, "output": str(run), "draft_vocab_size": 4096,
        "ttt_steps": 2, "batch_tokens": 1024, "epochs": 1, "num_workers": 1, "eval_fraction": 0.1,
        "deepspeed": {"zero_stage": 2, "dtype": "float32"},
        "export": {"dtype": "float32", "engines": ["vllm"]}}))
    ok(submit(ray_cluster, "jobs/train.py", "--config", str(tmp_path / "train.yaml")))
    art = run / "export" / "vllm"
    digest = json.loads((art / "strata_artifact.json").read_text())["content_digest"]

    (tmp_path / "validate.yaml").write_text(json.dumps({
        "artifact": str(art), "acceptance_prompts": 1, "max_new_tokens": 8,
        "tolerances": {"acceptance_vs_predicted": 0.0},
        "serving": {"engine": "vllm", "replay": "hf", "dtype": "float32", "target": {"path": str(tiny_target)}}}))
    from pipeline.cli import main as strata

    assert strata(["registry", "create-channel", "production", "--validate-config", str(tmp_path / "validate.yaml"),
                   "--registry", str(reg_dir)]) == 0
    out = ok(submit(ray_cluster, "jobs/validate.py", "--config", str(tmp_path / "validate.yaml"), "--registry",
                    str(reg_dir)))
    assert "PASS" in out
    out = ok(submit(ray_cluster, "jobs/promote.py", digest, "--channel", "production", "--registry", str(reg_dir)))
    assert f"production -> {digest}" in out

    reg = Registry(LocalStore(reg_dir))
    assert reg.pointer("production")[0].artifact_digest == digest
    actions = [(e.action, e.decision) for e in reg.history()]
    assert ("add_record", "accepted") in actions and actions[-1] == ("promote", "accepted")
