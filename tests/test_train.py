"""Draft training: DeepSpeed ZeRO-2 on Ray Train (2 CPU workers, gloo), resume after a
crash, refusals, export, and speculative decoding with the trained draft."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from pipeline.draft.export import load_draft
from pipeline.draft.speculate import TargetRunner, greedy_generate, speculative_generate
from pipeline.extract.job import run_extract
from pipeline.store.reader import ProvenanceMismatch, ShardCorrupt
from pipeline.train.data import split_eval
from pipeline.train.job import prepare, run_train
from schemas.artifact import ARTIFACT_FINGERPRINTS
from schemas.capture import CapturePoint as C
from schemas.extract import ExtractConfig
from schemas.train import TrainConfig

REPO = Path(__file__).resolve().parents[1]
AUX = ["layer_output:1", "layer_output:2", "layer_output:3"]


def extract(tiny_target, src, out, points=(*AUX, "final:post_norm"), n_rows=None):
    cfg = ExtractConfig.model_validate(
        {
            "target": {"path": str(tiny_target)},
            "source": {"uri": str(src)},
            "output": {"uri": str(out), "rows_per_shard": 32},
            "capture": list(points),
            "max_length": 256,
            "engine": {"dtype": "float32", "device": "cpu"},
            "fingerprint": {"probe_samples": 16},
        }
    )
    return run_extract(cfg, progress=False, use_ray=False)


@pytest.fixture(scope="module")
def dataset(tiny_target, tmp_path_factory):
    from pipeline.data.stdlib import write_conversations

    root = tmp_path_factory.mktemp("train-data")
    write_conversations(root / "conv.jsonl", n=160)
    extract(tiny_target, root / "conv.jsonl", root / "ds")
    return root / "ds"


def train_cfg(tiny_target, dataset, out, **kw) -> dict:
    cfg = {
        "dataset": str(dataset),
        "target": {"path": str(tiny_target)},
        "output": str(out),
        # A random-weight target's greedy tokens are not the data's frequent tokens: keep them all.
        "draft_vocab_size": 4096,
        "ttt_steps": 3,
        "batch_tokens": 1024,
        "epochs": 8,
        "metrics_every": 4,
        "checkpoint_every": 6,
        "eval_fraction": 0.1,
        "num_workers": 2,
        "cpus_per_worker": 0.5,
        "optim": {"lr": 3e-3, "warmup_steps": 3},
        "deepspeed": {"zero_stage": 2, "dtype": "float32"},
        "heldout_acceptance": {"prompts": 8},  # not what these tests check: kept cheap
    }
    for k, v in kw.items():
        cfg[k] = {**cfg[k], **v} if isinstance(v, dict) and isinstance(cfg.get(k), dict) else v
    return cfg


@pytest.fixture(scope="module")
def trained(ray_connected, tiny_target, dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "run"
    cfg = TrainConfig.model_validate(train_cfg(tiny_target, dataset, out))
    result = run_train(cfg)
    return out, result


@pytest.mark.ray
def test_zero2_on_two_workers_trains_and_loss_falls(trained):
    out, result = trained
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    held = [x for x in lines if x.get("kind") == "heldout_acceptance"]
    lines = [x for x in lines if "kind" not in x]
    assert len(held) == 1 and held[0] == result["metrics"]["heldout_acceptance"]  # measured at the end
    assert len(lines) >= 3 and lines[-1]["step"] == result["metrics"]["steps"]
    assert lines[-1]["loss"] < 0.8 * lines[0]["loss"], [x["loss"] for x in lines]
    for rec in lines:
        assert len(rec["acc_per_pos"]) == 3 and 0 <= rec["data_wait_fraction"] < 1 and rec["tokens_per_s"] > 0
    ev = result["metrics"]["eval"]
    # Chance is ~1/2048 (full-vocab draft); a few dozen steps on the tiny target reach 0.09-0.4. The
    # held-out split hashes sample ids, which name the source file, so it changes with pytest's temp dir.
    assert ev["acc_per_pos"][0] > 0.05 and ev["sim_accept_len"] > 0.05
    assert (out / "checkpoints" / "latest.json").exists()
    steps = result["metrics"]["steps"]
    saved = sorted({*range(6, steps + 1, 6), steps})  # checkpoint.every: 6, and one at the end
    assert len(saved) > 3  # so the default checkpoint.keep (3) has pruned the oldest
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir()) == [
        f"step-{s:06d}" for s in saved[-3:]
    ]
    # Where the job's time went: disjoint stages inside the total, the same record on disk.
    sec = result["seconds"]
    assert json.loads((out / "timing.json").read_text()) == sec
    parts = sec.pop("fit_parts")  # rank 0's own split of fit
    assert list(sec) == ["ray_start", "prepare", "fit", "heldout_acceptance", "export", "total"]
    assert all(v >= 0 for v in sec.values()) and sum(sec.values()) - sec["total"] <= sec["total"] and sec["fit"] > 0
    assert list(parts) == ["setup", "checkpoints", "steps", "eval"] and all(v >= 0 for v in parts.values())
    assert sum(parts.values()) <= sec["fit"] and parts["steps"] > 0


@pytest.mark.ray
def test_exports_carry_ids_from_provenance_and_decode_losslessly(trained, tiny_target):
    out, result = trained
    sg = json.loads((out / "export" / "sglang" / "config.json").read_text())
    vl = json.loads((out / "export" / "vllm" / "config.json").read_text())
    # Dataset capture points o_1, o_2, o_3 = r_2, r_3, r_4 on a 6-layer target.
    assert sg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert vl["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]
    manifest = json.loads((out / "export" / "vllm" / "strata_artifact.json").read_text())
    assert manifest["aux_capture_points"] == [C.parse(p).model_dump() for p in AUX]
    assert manifest["dataset_id"] and manifest["dataset_manifest_sha256"] and manifest["metrics"]["steps"] > 0
    # Exported weights == the final checkpoint's weights, bit for bit (float32 export of a float32 run).
    ck = load_file(
        str(
            out
            / "checkpoints"
            / json.loads((out / "checkpoints/latest.json").read_text())["checkpoint"]
            / "model.safetensors"
        )
    )
    draft = load_draft(out / "export" / "vllm", tiny_target)
    for k, v in draft.state_dict().items():
        if k in ck and v.is_floating_point():
            assert torch.equal(v, ck[k].float().to(torch.bfloat16).float()), k  # export dtype is bf16

    # Speculative decoding with the trained draft: lossless, and it accepts drafts.
    draft = load_draft(out / "export" / "vllm", tiny_target, dtype=torch.float32)
    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    runner = TargetRunner(target, [C.parse(p) for p in AUX])
    from pipeline.data.chat import ChatEncoder
    from pipeline.data.stdlib import make_conversations

    enc = ChatEncoder(tiny_target, 512)
    accepted, steps = 0, 0
    for conv in make_conversations(10):
        text = enc.render(conv["messages"][:1], add_generation_prompt=True)
        prompt = enc.tokenizer(text, add_special_tokens=False)["input_ids"]
        res = speculative_generate(runner, draft, prompt, 24, k=3)
        assert res.tokens == greedy_generate(target, prompt, 24)
        accepted += res.accepted_tokens
        steps += res.verify_steps
    mean_len = 1 + accepted / steps
    print(f"reference speculative decoding with the trained draft: mean acceptance length {mean_len:.2f} (k=3)")
    assert mean_len > 1.15  # a random draft: ~1.0


def job_command(cfg: dict, tmp_path: Path, cluster: dict) -> tuple[list[str], dict]:
    p = tmp_path / f"train-{len(list(tmp_path.iterdir()))}.yaml"
    p.write_text(json.dumps(cfg))
    env = {**os.environ, **cluster["env"], "RAY_ADDRESS": cluster["address"]}
    return [sys.executable, "jobs/train.py", "--config", str(p)], env


def run_job(cfg: dict, tmp_path: Path, cluster: dict) -> subprocess.CompletedProcess:
    cmd, env = job_command(cfg, tmp_path, cluster)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def kill_after_first_checkpoint(cfg: dict, tmp_path: Path, cluster: dict) -> int:
    """Start the job and SIGKILL its driver (Ray then kills its Ray Train workers) as soon as a
    checkpoint is committed; returns that checkpoint's step."""
    cmd, env = job_command(cfg, tmp_path, cluster)
    latest = Path(cfg["output"]) / "checkpoints" / "latest.json"
    with open(tmp_path / "killed-job.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 900
            while not latest.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            assert proc.poll() is None, f"the job ended before its first checkpoint: {proc.returncode}"
            os.killpg(proc.pid, signal.SIGKILL)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return json.loads(latest.read_text())["step"]


@pytest.mark.ray
def test_kill_and_resume_matches_uninterrupted_run(ray_cluster, tiny_target, dataset, tmp_path):
    # 5 steps per epoch; held-out acceptance is not what this checks
    kw = dict(epochs=2, max_steps=8, checkpoint_every=4, metrics_every=2, eval_fraction=0.0)
    kw["heldout_acceptance"] = {"prompts": 0}
    # The uninterrupted run goes beside the killed one (each takes half the cluster's two CPUs):
    # most of a tiny job is process start and worker-group set-up, which overlap.
    cmd, env = job_command(train_cfg(tiny_target, dataset, tmp_path / "a", **kw), tmp_path, ray_cluster)
    straight_log = tmp_path / "straight-job.log"
    with open(straight_log, "w") as log:
        straight = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            killed_at = kill_after_first_checkpoint(
                train_cfg(tiny_target, dataset, tmp_path / "b", **kw), tmp_path, ray_cluster
            )
            assert killed_at == 4
            resumed = run_job(train_cfg(tiny_target, dataset, tmp_path / "b", **kw), tmp_path, ray_cluster)
            assert resumed.returncode == 0, resumed.stderr[-3000:]
            assert straight.wait(timeout=900) == 0, straight_log.read_text()[-3000:]
        finally:
            if straight.poll() is None:
                straight.kill()
                straight.wait()
    assert "resumed from step-000004 at step 4" in resumed.stderr + resumed.stdout
    a = json.loads((tmp_path / "a/final_metrics.json").read_text())
    b = json.loads((tmp_path / "b/final_metrics.json").read_text())
    assert a["steps"] == b["steps"] == 8
    wa = load_file(str(tmp_path / "a/checkpoints/step-000008/model.safetensors"))
    wb = load_file(str(tmp_path / "b/checkpoints/step-000008/model.safetensors"))
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-5, msg=k)
    ma = [json.loads(x)["loss"] for x in (tmp_path / "a/metrics.jsonl").read_text().splitlines() if '"kind"' not in x]
    mb = [json.loads(x)["loss"] for x in (tmp_path / "b/metrics.jsonl").read_text().splitlines() if '"kind"' not in x]
    assert len(ma) == len(mb) == 4
    assert mb == pytest.approx(ma, rel=1e-4)


def test_probe_samples_are_never_trained_on(tiny_target, dataset, tmp_path):
    """160 samples (under the ~320 where eval_fraction alone would cover them) with eval_fraction 0:
    the 16 probe samples, whose prefixes are the acceptance prompts, still stay out of training."""
    from pipeline.fingerprint import Fingerprints
    from pipeline.store.reader import DatasetReader

    reader = DatasetReader(str(dataset))
    probes = set(Fingerprints.load(str(dataset), name=reader.manifest.fingerprints["path"]).sample_ids)
    assert len(probes) == 16
    plan = prepare(TrainConfig.model_validate(train_cfg(tiny_target, dataset, tmp_path / "run", eval_fraction=0.0)))
    trained = {r["sample_id"] for r in plan.train_refs}
    held = {r["sample_id"] for r in plan.eval_refs}
    assert not trained & probes and held == probes
    assert len(trained) + len(held) == 160


def test_a_post_norm_aux_slot_is_refused_before_training(tiny_target, dataset, tmp_path):
    """No engine feeds the post-norm final state to a draft: refused when the config is read,
    long before a run that could never be served."""
    from schemas.config import ConfigError, validate_config

    raw = train_cfg(tiny_target, dataset, tmp_path / "run", aux=["layer_output:1", "layer_output:2", "final:post_norm"])
    with pytest.raises(ConfigError, match=r"aux: .*final:post_norm is the post-norm final state .* cannot be served"):
        validate_config(raw, TrainConfig)
    assert not (tmp_path / "run").exists()


def test_refuses_other_target(tiny_target, dataset, tmp_path):
    from pipeline.demo.tiny import make_tiny_target

    other = make_tiny_target(tmp_path / "other", num_layers=6, hidden_size=64, seed=7)
    cfg = TrainConfig.model_validate(
        {**train_cfg(tiny_target, dataset, tmp_path / "run"), "target": {"path": str(other)}}
    )
    with pytest.raises(ProvenanceMismatch, match="weights"):
        prepare(cfg)


def test_refuses_corrupted_shard_naming_it(tiny_target, dataset, tmp_path):
    ds = tmp_path / "ds"
    shutil.copytree(dataset, ds)
    shard = sorted((ds / "shards").glob("*.parquet"))[1]
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardCorrupt, match=shard.name):
        prepare(TrainConfig.model_validate(train_cfg(tiny_target, ds, tmp_path / "run")))


def test_refuses_mixed_capture_points_naming_the_shard(tiny_target, dataset, tmp_path):
    """A shard from an extraction with other capture points, swapped in with a fixed-up checksum."""
    ds = tmp_path / "ds"
    shutil.copytree(dataset, ds)
    src = tmp_path / "conv.jsonl"
    from pipeline.data.stdlib import write_conversations

    write_conversations(src, n=160)
    other = extract(
        tiny_target,
        src,
        tmp_path / "other",
        points=("layer_output:0", "layer_output:2", "layer_output:4", "final:post_norm"),
    )
    victim = sorted((ds / "shards").glob("*.parquet"))[0]
    shutil.copy(tmp_path / "other" / other.shards[0].path, victim)
    m = json.loads((ds / "manifest.json").read_text())
    import hashlib

    blob = victim.read_bytes()
    m["shards"][0].update(bytes=len(blob), sha256=hashlib.sha256(blob).hexdigest())
    m["totals"]["bytes"] = sum(s["bytes"] for s in m["shards"])  # a consistent forgery: the totals agree
    (ds / "manifest.json").write_text(json.dumps(m))
    assert pq.read_schema(victim).names != pq.read_schema(sorted((ds / "shards").glob("*.parquet"))[1]).names
    with pytest.raises(ProvenanceMismatch, match=f"shard shards/{victim.name} .*mixes capture points"):
        prepare(TrainConfig.model_validate(train_cfg(tiny_target, ds, tmp_path / "run")))


@pytest.mark.parametrize("stage, dtype", [(1, "bfloat16"), (3, "float32"), (3, "bfloat16")])
def test_zero_stages_and_dtypes_train_checkpoint_and_resume(tiny_target, dataset, tmp_path, stage, dtype, monkeypatch):
    """One in-process worker: every ZeRO stage and dtype trains, checkpoints and resumes --
    and leaves nothing behind in the temp directory (checkpoints are (de)serialized in memory)."""
    import tempfile

    from pipeline.train import checkpoint

    scratch = tmp_path / "scratch-tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    base = train_cfg(
        tiny_target,
        dataset,
        tmp_path / "run",
        num_workers=1,
        epochs=1,
        max_steps=2,
        checkpoint_every=1,
        metrics_every=1,
        eval_fraction=0.0,
        deepspeed={"zero_stage": stage, "dtype": dtype},
    )
    first = run_train(TrainConfig.model_validate(base), use_ray=False)
    assert first["metrics"]["steps"] == 2 and checkpoint.latest(str(tmp_path / "run"), None) == "step-000002"
    w2 = load_file(str(tmp_path / "run/checkpoints/step-000002/model.safetensors"))
    again = run_train(TrainConfig.model_validate({**base, "max_steps": 3}), use_ray=False)
    assert again["metrics"]["steps"] == 3
    w3 = load_file(str(tmp_path / "run/checkpoints/step-000003/model.safetensors"))
    assert set(w2) == set(w3) and any(not torch.equal(w2[k], w3[k]) for k in w2 if w2[k].is_floating_point())
    cfg = json.loads((tmp_path / "run/export/vllm/config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]
    assert not [p.name for p in scratch.iterdir() if p.name.startswith("strata-")]


@pytest.mark.s3
def test_checkpoints_and_exports_go_to_s3(tiny_target, dataset, s3_server, tmp_path):
    uri = f"s3://{s3_server['bucket']}/runs/tiny"
    cfg = train_cfg(
        tiny_target,
        dataset,
        uri,
        num_workers=1,
        epochs=1,
        max_steps=2,
        checkpoint_every=1,
        eval_fraction=0.0,
        s3={"endpoint_url": s3_server["endpoint"]},
    )
    run_train(TrainConfig.model_validate(cfg), use_ray=False)
    keys = {
        o["Key"]
        for o in s3_server["client"].list_objects_v2(Bucket=s3_server["bucket"], Prefix="runs/tiny/")["Contents"]
    }
    for k in (
        "checkpoints/latest.json",
        "checkpoints/step-000002/model.safetensors",
        "checkpoints/step-000002/rank-0.safetensors",
        "metrics.jsonl",
        "run.json",
        "export/sglang/config.json",
        "export/vllm/strata_artifact.json",
    ):
        assert f"runs/tiny/{k}" in keys, k
    for k in keys:  # no credentials anywhere
        body = s3_server["client"].get_object(Bucket=s3_server["bucket"], Key=k)["Body"].read()
        assert b"strata-test-secret" not in body, k


def test_strata_export_cli(tiny_target, dataset, tmp_path, capsys):
    from pipeline.cli import main as strata

    run = tmp_path / "run"
    run_train(
        TrainConfig.model_validate(
            train_cfg(
                tiny_target,
                dataset,
                run,
                num_workers=1,
                epochs=1,
                max_steps=1,
                eval_fraction=0.0,
                export={"engines": ["vllm"]},
            )
        ),
        use_ray=False,
    )
    assert strata(["export", str(run), "--engine", "sglang", "--out", str(tmp_path / "out"), "--dtype", "float32"]) == 0
    assert "sglang: aux ids [1, 2, 3] (sglang_llama_aux_layer_id)" in capsys.readouterr().out
    cfg = json.loads((tmp_path / "out/sglang/config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and cfg["torch_dtype"] == "float32"
    # Other SGLang capture rules get their own ids for the same tensors.
    assert (
        strata(["export", str(run), "--engine", "sglang", "--sglang-family", "gpt_oss", "--out", str(tmp_path / "g")])
        == 0
    )
    assert "sglang: aux ids [1, 2, 3] (sglang_gpt_oss_aux_layer_id)" in capsys.readouterr().out
    assert strata(["export", str(tmp_path / "nowhere")]) == 2
    assert "no run.json" in capsys.readouterr().err


def test_exported_artifact_carries_the_dataset_fingerprints(tiny_target, dataset, tmp_path):
    from pipeline import fingerprint as fpm
    from pipeline.store.reader import load_manifest

    run = tmp_path / "run"
    run_train(
        TrainConfig.model_validate(
            train_cfg(tiny_target, dataset, run, num_workers=1, epochs=1, max_steps=1, eval_fraction=0.0)
        ),
        use_ray=False,
    )
    ds_fp = load_manifest(str(dataset)).fingerprints
    art = json.loads((run / "export/sglang/strata_artifact.json").read_text())
    assert art["fingerprints"]["sha256"] == ds_fp["sha256"] and art["fingerprints"]["probe_samples"] == 16
    fp = fpm.Fingerprints.load(str(run / "export/sglang"), name=ARTIFACT_FINGERPRINTS)
    assert fp.points == [*AUX, "final:post_norm"] and len(fp.sample_ids) == 16


def test_epochs_of_different_lengths_run_each_batch_once(tiny_target, tmp_path):
    """Each epoch packs its own shuffle (length-sorted in windows of 256), so epochs can differ
    in step count; the loop must run every epoch's batches (it once looped forever when a later
    epoch was shorter)."""
    from pipeline.data.stdlib import write_conversations
    from pipeline.fingerprint import Fingerprints
    from pipeline.store.reader import DatasetReader, index_samples
    from pipeline.train.plan import plan_epoch

    write_conversations(tmp_path / "conv.jsonl", n=400)
    extract(tiny_target, tmp_path / "conv.jsonl", dataset := tmp_path / "ds")
    reader = DatasetReader(str(dataset))
    probes = frozenset(Fingerprints.load(str(dataset), name=reader.manifest.fingerprints["path"]).sample_ids)
    train, _ = split_eval(index_samples(reader), 0.0, probes)  # what training will train on

    def steps(b: int, epoch: int) -> int:
        return len(plan_epoch(train, b, 1, 0, epoch, packed=True))  # training packs by default

    bt = next(b for b in range(600, 4000, 20) if steps(b, 0) != steps(b, 1))
    lens = [steps(bt, e) for e in (0, 1)]
    cfg = TrainConfig.model_validate(
        train_cfg(
            tiny_target,
            dataset,
            tmp_path / "run",
            num_workers=1,
            epochs=2,
            batch_tokens=bt,
            eval_fraction=0.0,
            checkpoint_every=1000,
            heldout_acceptance={"prompts": 0},
        )
    )
    result = run_train(cfg, use_ray=False)
    assert result["metrics"]["steps"] == sum(lens), (lens, result["metrics"]["steps"])
    assert result["metrics"]["train"]["epoch"] == 1


def test_packed_training_equals_padded_training_on_the_same_batches(tiny_target, dataset, tmp_path, monkeypatch):
    """The whole loop (DeepSpeed ZeRO-2 in fp32, two epochs, evaluation) with each batch's sequences
    packed end to end, against the same batches padded to rows: the same draft up to fp32 rounding
    (the sums over positions add the same terms in another layout), the same counts exactly. A
    packed batch holds no padding; its real tokens stay within batch_tokens."""
    from pipeline.train import loop, plan, trainer

    def same_groups(*a, packed, **kw):  # both runs take the packed plan's batches
        return plan.plan_epoch(*a, packed=True, **kw)

    monkeypatch.setattr(loop, "plan_epoch", same_groups)
    monkeypatch.setattr(trainer, "plan_epoch", same_groups)
    seen: dict[bool, list] = {True: [], False: []}
    step = trainer.Trainer.step

    def spy(self, batch):
        seen[self.cfg.packing].append((batch.input_ids.shape, batch.tokens, batch.seq_lens.tolist()))
        return step(self, batch)

    monkeypatch.setattr(trainer.Trainer, "step", spy)
    runs = {}
    for packing in (True, False):
        cfg = train_cfg(
            tiny_target,
            dataset,
            tmp_path / f"packing-{packing}",
            num_workers=1,
            epochs=2,
            checkpoint_every=1000,
            heldout_acceptance={"prompts": 0},
            packing=packing,
        )
        runs[packing] = run_train(TrainConfig.model_validate(cfg), use_ray=False, progress=False)["metrics"]
    packed, padded = seen[True], seen[False]
    assert [x[1:] for x in packed] == [x[1:] for x in padded] and len(packed) > 8
    assert all(shape == (1, tokens) for shape, tokens, _ in packed)  # one row, no padding
    assert all(tokens <= 1024 or len(lens) == 1 for _, tokens, lens in packed)
    assert any(shape[0] * shape[1] > tokens for shape, tokens, _ in padded)  # padding the packed batches drop
    assert sum(len(lens) > 1 for *_, lens in packed) > len(packed) // 2
    for split in ("train", "eval"):
        a, b = runs[True][split], runs[False][split]
        assert a["tokens"] == b["tokens"], split
        assert a["acc_per_pos"] == pytest.approx(b["acc_per_pos"], abs=0.02), split
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), split

    def final_weights(packing: bool) -> dict:  # fp32, as trained (the export is bf16)
        ckpt = tmp_path / f"packing-{packing}" / "checkpoints"
        latest = json.loads((ckpt / "latest.json").read_text())["checkpoint"]
        return load_file(str(ckpt / latest / "model.safetensors"))

    wa, wb = final_weights(True), final_weights(False)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-5), k


@pytest.mark.ray
def test_a_plan_the_cluster_cannot_run_is_refused_not_left_hanging(ray_connected, tiny_target, dataset, tmp_path):
    """Workers that take every CPU leave none for Ray Data's decode tasks, and workers that want
    more CPUs than the cluster has never start: Ray would wait forever on either."""
    import ray

    cpus = ray.cluster_resources()["CPU"]
    for kw, needle in [
        ({"cpus_per_worker": cpus, "data_loading": "ray_data"}, r"CPU for the data decode tasks .* but "),
        ({"cpus_per_worker": cpus + 1}, rf"1 workers x cpus_per_worker {cpus + 1:g} .* but "),
    ]:
        cfg = TrainConfig.model_validate(
            train_cfg(tiny_target, dataset, tmp_path / "run", num_workers=1, resource_wait_s=0, **kw)
        )
        with pytest.raises(ValueError, match=needle + "the Ray cluster has"):
            run_train(cfg)
        assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.ray
@pytest.mark.parametrize("workers", [1, 2], ids=["one-worker-actor", "ray-train-group"])
def test_workers_that_cannot_be_placed_fail_the_job_instead_of_waiting_forever(
    ray_connected, tiny_target, dataset, tmp_path, workers
):
    """The up-front check counts the cluster's CPUs, not who holds them: another job's actor that
    takes them all leaves Ray Train waiting for its worker group, retrying forever by default (and a
    one-worker run's actor pending). The job gives up after stall_timeout_s and says what to do."""
    import ray

    from pipeline.cluster import Stalled

    @ray.remote(num_cpus=ray.cluster_resources()["CPU"])
    class OtherJob:
        def ready(self) -> bool:
            return True

    other = OtherJob.remote()
    ray.get(other.ready.remote(), timeout=120)
    cfg = TrainConfig.model_validate(
        train_cfg(tiny_target, dataset, tmp_path / "run", num_workers=workers, cpus_per_worker=1, stall_timeout_s=2)
    )
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = run_train(cfg)
        except Exception as e:
            outcome["error"] = e

    job = threading.Thread(target=run, daemon=True)  # a regression waits forever: fail, do not hang the suite
    job.start()
    job.join(300)
    ray.kill(other)
    assert not job.is_alive(), "the job still waits for its worker group after 300 s"
    assert isinstance(outcome.get("error"), Stalled), outcome
    assert re.search(
        rf"train: the worker group \({workers} x 1 CPU\) was not placed: nothing finished in 2 s\. .*another "
        r"job may hold the CPUs.*stall_timeout_s",
        str(outcome["error"]),
    ), outcome["error"]
    assert not (tmp_path / "run" / "final_metrics.json").exists()


def test_training_refuses_up_front_a_draft_no_export_engine_can_serve():
    """Before any step: SGLang 0.5.11 has a fixed three-slot fc, so a two-slot draft exported
    for it could never load; a newer release reads the slot count from the config."""
    from pipeline.train.job import check_servable

    cfg = TrainConfig.model_validate(
        {
            "dataset": "unused",
            "target": {"path": "unused"},
            "output": "unused",
            "export": {"engines": ["sglang"], "engine_versions": {"sglang": "0.5.11"}},
        }
    )
    aux = [C.layer_output(1), C.layer_output(2)]
    with pytest.raises(ProvenanceMismatch, match="refusing to train.*sglang 0.5.11 has a fixed three-slot fc"):
        check_servable(cfg, aux, 6, {"model_type": "llama"})
    check_servable(
        cfg.model_copy(update={"export": cfg.export.model_copy(update={"engine_versions": {}})}),
        aux,
        6,
        {"model_type": "llama"},
    )  # newest SGLang: fine
    with pytest.raises(ProvenanceMismatch, match=r"the embedding \(r_0\)"):
        check_servable(
            cfg.model_copy(update={"export": cfg.export.model_copy(update={"engine_versions": {"sglang": "0.5.21"}})}),
            [C.embedding(), *aux, C.layer_output(3)][:3],
            6,
            {"model_type": "llama"},
        )


def test_checkpoints_are_built_from_parts_and_only_the_last_k_are_kept(tmp_path):
    """The manager saves every part where it says it lives, restores each from there, keeps the
    last ``keep`` checkpoints, and refuses a checkpoint of another world size or parts that clash."""
    from pipeline.train.checkpoint import CheckpointManager, RNGState, TrainState, latest

    class Counter:  # a rank-local tensor part
        where = "rank"

        def __init__(self):
            self.t = torch.zeros(3)

        def state_dict(self):
            return {"counter": self.t.clone()}

        def load_state_dict(self, state):
            self.t.copy_(state["counter"])

    def manager(root, parts, world=1, keep=2):
        return CheckpointManager(
            str(root), None, parts, every=1, keep=keep, rank=0, world=world, barrier=lambda: None, zero_stage=2
        )

    train, counter = TrainState(), Counter()
    m = manager(tmp_path, {"train": train, "counter": counter, "rng": RNGState()})
    for step in range(1, 6):
        train.step, train.epoch = step, step // 3
        counter.t += step
        m.save(step)
        if step == 4:
            after_4 = torch.rand(2)  # the first draw after step 4's checkpoint
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir()) == ["step-000004", "step-000005"]
    assert latest(str(tmp_path), None) == "step-000005"
    state = json.loads((tmp_path / "checkpoints/step-000005/state.json").read_text())
    assert state == {"world_size": 1, "zero_stage": 2, "step": 5, "epoch": 1}

    train2, counter2 = TrainState(), Counter()
    torch.manual_seed(123)
    manager(tmp_path, {"train": train2, "counter": counter2, "rng": RNGState()}).load("step-000004")
    assert (train2.step, train2.epoch) == (4, 1) and counter2.t.tolist() == [10.0] * 3
    assert torch.equal(torch.rand(2), after_4)  # the RNG is where it was at step 4's checkpoint
    with pytest.raises(ValueError, match="written by 1 workers with ZeRO-2; this run has 2"):
        manager(tmp_path, {"train": TrainState()}, world=2).load("step-000005")
    with pytest.raises(ValueError, match="part 'again' reuses the keys \\['counter'\\]"):
        manager(tmp_path / "x", {"counter": Counter(), "again": Counter()}).save(1)


def test_a_kill_during_checkpoint_writes_resumes_from_the_last_complete_one(tiny_target, dataset, tmp_path):
    """The state a kill leaves while step 6's checkpoint is being written -- a torn rank file, no
    state.json, latest.json still at step 4 -- resumes from step 4 and ends exactly where an
    uninterrupted run does."""
    from pipeline.train import checkpoint

    kw = dict(num_workers=1, epochs=2, checkpoint_every=2, metrics_every=2, eval_fraction=0.0)
    straight = run_train(
        TrainConfig.model_validate(train_cfg(tiny_target, dataset, tmp_path / "a", max_steps=6, **kw)), use_ray=False
    )
    run_train(
        TrainConfig.model_validate(train_cfg(tiny_target, dataset, tmp_path / "b", max_steps=4, **kw)), use_ray=False
    )
    torn = tmp_path / "b" / "checkpoints" / "step-000006"
    torn.mkdir()
    (torn / "rank-0.safetensors").write_bytes(b'\x10\x00\x00\x00\x00\x00\x00\x00{"partial')
    assert checkpoint.latest(str(tmp_path / "b"), None) == "step-000004"
    resumed = run_train(
        TrainConfig.model_validate(train_cfg(tiny_target, dataset, tmp_path / "b", max_steps=6, **kw)), use_ray=False
    )
    assert (
        resumed["metrics"]["steps"] == straight["metrics"]["steps"] == 6
        and checkpoint.latest(str(tmp_path / "b"), None) == "step-000006"
    )
    a = load_file(str(tmp_path / "a/checkpoints/step-000006/model.safetensors"))
    b = load_file(str(tmp_path / "b/checkpoints/step-000006/model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_training_does_not_compile_deepspeeds_cpu_shared_memory_op(tmp_path):
    """DeepSpeed on CPU compiles a C++ shared-memory all-reduce (25 s on a fresh machine) when its
    communication starts; training never uses it. In a fresh process, as a worker starts one."""
    script = (
        "from pipeline.train.job import init_single_process\n"
        "from pipeline.train.trainer import import_deepspeed\n"
        "ds = import_deepspeed()\ninit_single_process()\nds.init_distributed(dist_backend='gloo')\n"
        "from deepspeed.comm import comm\nprint('shm op:', comm.cdb.shm_comm_op)\n"
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}  # a build would land here
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "shm op: None" in run.stdout and not (tmp_path / "ext").exists(), run.stdout + run.stderr[-2000:]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_partitions_match_deepspeed(stage):
    """The one place Strata reads DeepSpeed internals: fails when a DeepSpeed release renames
    or reshapes the ZeRO optimizer's partitions, before a checkpoint silently misses them."""
    import deepspeed

    from pipeline.train.checkpoint import zero_partitions
    from pipeline.train.job import init_single_process

    init_single_process()
    deepspeed.init_distributed(dist_backend="gloo")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    n_params = sum(p.numel() for p in model.parameters())
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}, "bf16": {"enabled": True}},
    )
    loss = engine(torch.randn(2, 8, dtype=torch.bfloat16)).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    parts = zero_partitions(engine)
    assert all(p.dtype == torch.float32 for p in parts.fp32)
    assert n_params <= sum(p.numel() for p in parts.fp32) < n_params + 1024  # one rank holds all, maybe padded
    for flat in parts.fp32:
        assert set(parts.inner.state[flat]) >= {"exp_avg", "exp_avg_sq"}
        assert parts.inner.state[flat]["exp_avg"].shape == flat.shape
    if stage == 3:
        assert [p.shape for p in parts.low_precision] == [p.shape for p in parts.fp32]
        assert all(p.dtype == torch.bfloat16 for p in parts.low_precision)
    else:
        assert parts.low_precision is None


def test_the_stall_guard_passes_items_and_errors_through_and_names_a_stall():
    """The helper around training's Ray Data iterator (``data_loading: ray_data``): items and the
    source's own error pass through; silence is an error."""
    from pipeline.cluster import Stalled, stall_guard

    assert list(stall_guard(iter(range(5)), 5.0, "x", "fix")) == [0, 1, 2, 3, 4]

    def failing():
        yield 1
        raise KeyError("boom")

    got = []
    with pytest.raises(KeyError, match="boom"):
        for item in stall_guard(failing(), 5.0, "x", "fix"):
            got.append(item)
    assert got == [1]

    def silent():
        yield 1
        time.sleep(30)
        yield 2

    got = []
    with pytest.raises(Stalled, match=r"decoding: nothing finished in 0.3 s\. .* raise the limit"):
        for item in stall_guard(silent(), 0.3, "decoding", "raise the limit"):
            got.append(item)
    assert got == [1]

    # A consumer that stops early closes the source (a Ray Data iterator then shuts its executor
    # down), rather than leaving it parked on the helper thread.
    closed = threading.Event()

    def endless():
        try:
            while True:
                yield 0
        finally:
            closed.set()

    guarded = stall_guard(endless(), 5.0, "x", "fix")
    assert next(guarded) == 0
    guarded.close()
    assert closed.wait(5)
