"""Streaming mode on a real Ray cluster: capture actors feed the training worker through the
object store. The same draft as extract-then-train, bit for bit, through a killed capture
actor and a killed trainer; no stored shard of a trained sample; flat object-store memory;
the artifact through the gate like an offline one."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from pipeline.extract.job import run_extract
from pipeline.fingerprint import Fingerprints
from pipeline.store.reader import DatasetReader, ProvenanceMismatch, index_samples
from pipeline.train import stream
from pipeline.train.checkpoint import latest
from pipeline.train.data import split_eval
from pipeline.train.job import prepare, run_train
from pipeline.validate.job import run_validate
from schemas.artifact import ARTIFACT_MANIFEST
from schemas.config import ConfigError, validate_config
from schemas.extract import ExtractConfig
from schemas.train import TrainConfig
from schemas.validation import ValidateConfig

POINTS = ["layer_output:1", "layer_output:2", "layer_output:3", "final:post_norm"]
IN_FLIGHT = 2
BATCH_TOKENS = 512
BATCH_METADATA_BYTES = 4096


def extract_raw(tiny_target, src: Path, out: Path) -> dict:
    return {
        "target": {"path": str(tiny_target)},
        "source": {"uri": str(src)},
        "output": {"uri": str(out), "rows_per_shard": 32},
        "capture": POINTS,
        "max_length": 256,
        # one capture actor with one core: fp32 values then do not depend on which samples share
        # a forward (tests/test_hf_engine.py), offline or streamed
        "engine": {"dtype": "float32", "device": "cpu"},
        "ray": {"num_actors": 1, "cpus_per_actor": 1},
        "fingerprint": {"probe_samples": 8},
    }


def train_raw(tiny_target, out: Path, **kw) -> dict:
    return {
        "target": {"path": str(tiny_target)},
        "output": str(out),
        "draft_vocab_size": 4096,
        "ttt_steps": 2,
        "batch_tokens": BATCH_TOKENS,
        "epochs": 3,  # over ten times IN_FLIGHT steps stream through the bound (packed batches are few)
        "metrics_every": 4,
        "checkpoint": {"every": 4, "keep": 10},
        "eval_fraction": 0.1,
        "num_workers": 1,
        "cpus_per_worker": 1,
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "deepspeed": {"zero_stage": 2, "dtype": "float32"},
        "heldout_acceptance": {"prompts": 4, "max_new_tokens": 8},
        "export": {"dtype": "float32"},
        **kw,
    }


@pytest.fixture(scope="module")
def source(tmp_path_factory, tiny_target):
    from pipeline.data.stdlib import write_conversations

    root = tmp_path_factory.mktemp("stream")
    write_conversations(root / "conv.jsonl", n=96)
    (root / "extract.yaml").write_text(yaml.safe_dump(extract_raw(tiny_target, root / "conv.jsonl", root / "unused")))
    return root


@pytest.fixture(scope="module")
def offline_run(ray_connected, tiny_target, source):
    """Extract-then-train on the same conversations, with the same capture actor and worker shape."""
    run_extract(
        ExtractConfig.model_validate(extract_raw(tiny_target, source / "conv.jsonl", source / "ds")), progress=False
    )
    run_train(TrainConfig.model_validate(train_raw(tiny_target, source / "offline", dataset=str(source / "ds"))))
    return source / "offline"


def _actor_pid(class_name: str) -> int | None:
    from ray.util.state import list_actors

    alive = list_actors(filters=[("class_name", "=", class_name), ("state", "=", "ALIVE")])
    return alive[0].pid if alive else None


def _store_bytes(address: str) -> int:
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    return get_memory_info_reply(get_state_from_address(address)).store_stats.object_store_bytes_used


class Killer(threading.Thread):
    """SIGKILLs the process of the first live actor of ``class_name`` once ``ready()`` holds."""

    def __init__(self, class_name: str, ready):
        super().__init__(daemon=True)
        self.class_name, self.ready, self.killed, self.stop = class_name, ready, None, False

    def run(self):
        while not self.stop and self.killed is None:
            if self.ready() and (pid := _actor_pid(self.class_name)):
                os.kill(pid, signal.SIGKILL)
                self.killed = pid
            time.sleep(0.2)


class StoreSampler(threading.Thread):
    """Bytes in Ray's object store, every 20 ms."""

    def __init__(self, address: str):
        super().__init__(daemon=True)
        self.address, self.samples, self.stop = address, [], False

    def run(self):
        while not self.stop:
            self.samples.append(_store_bytes(self.address))
            time.sleep(0.02)


@pytest.fixture(scope="module")
def streamed_run(ray_connected, tiny_target, source, tmp_path_factory):
    """A streaming run whose capture actor is SIGKILLed after the first checkpoint and whose
    trainer is SIGKILLed after the second, then rerun (resume: latest) to the end; the object
    store sampled throughout."""
    out = tmp_path_factory.mktemp("streamed") / "run"
    cfg = TrainConfig.model_validate(
        train_raw(tiny_target, out, data={"stream": str(source / "extract.yaml"), "in_flight": IN_FLIGHT})
    )

    def committed(step: int) -> bool:  # a checkpoint counts once committed, not when its folder appears
        name = latest(str(out), None)
        return name is not None and int(name[-6:]) >= step

    capture_killer = Killer("StreamCaptureActor", lambda: committed(4))
    trainer_killer = Killer("_WorkerProcess", lambda: bool(capture_killer.killed) and committed(8))
    sampler = StoreSampler(ray_connected["address"])
    baseline = _store_bytes(ray_connected["address"])
    for t in (capture_killer, trainer_killer, sampler):
        t.start()
    try:
        with pytest.raises(RuntimeError, match="the training worker died while training"):
            run_train(cfg, progress=False)
    finally:
        capture_killer.stop = trainer_killer.stop = True
    assert capture_killer.killed and trainer_killer.killed
    result = run_train(cfg, progress=False)  # resume: latest
    sampler.stop = True
    sampler.join()
    return {"out": out, "result": result, "store_peak": max(sampler.samples) - baseline}


@pytest.mark.ray
def test_streaming_trains_the_offline_draft_bit_for_bit_through_kills(streamed_run, source, offline_run):
    out, result = streamed_run["out"], streamed_run["result"]
    run = json.loads((out / "run.json").read_text())
    assert run["resume_from"] and int(run["resume_from"][-6:]) >= 8  # resumed after the trainer was killed
    # the same draft as extract-then-train: every step the same samples, the same values
    offline = json.loads((offline_run / "final_metrics.json").read_text())
    steps = result["metrics"]["steps"]
    assert steps == offline["steps"]
    name = f"step-{steps:06d}"
    a = load_file(offline_run / "checkpoints" / name / "model.safetensors")
    b = load_file(out / "checkpoints" / name / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert result["metrics"]["eval"] == offline["eval"]

    # memory: Ray's object store never held more than the bound, in_flight batches, while over
    # ten times the bound's worth of batches streamed through it
    # float32 hidden states, ids and mask, plus what rides along with each batch's arrays: its
    # seq_lens, sample ids and serialization headers (a few hundred bytes; CI measured a full
    # batch 164 bytes over the arrays alone). A third batch in the store would add ~528 KB.
    batch_bytes = BATCH_TOKENS * (len(POINTS) * 64 * 4 + 9) + BATCH_METADATA_BYTES
    assert 0 < streamed_run["store_peak"] <= IN_FLIGHT * batch_bytes
    assert steps >= 10 * IN_FLIGHT


@pytest.mark.ray
def test_a_streaming_run_stores_only_its_held_out_samples_with_the_offline_provenance(
    streamed_run, tiny_target, source, offline_run, tmp_path
):
    out = streamed_run["out"]
    run = json.loads((out / "run.json").read_text())
    offline_ds = DatasetReader(str(source / "ds"))
    probes = frozenset(Fingerprints.load(str(source / "ds"), name=offline_ds.manifest.fingerprints["path"]).sample_ids)
    _, held = split_eval(index_samples(offline_ds), 0.1, probes)
    data = DatasetReader(str(out / "data"))
    t = data.manifest.totals
    assert {s.sample_id for s in data.iter_samples()} == {r.sample_id for r in held}
    assert t.streamed == offline_ds.manifest.totals.rows - len(held) and t.rows == len(held)
    assert t.input_rows == t.rows + t.quarantined + t.streamed
    assert run["extra"]["stream"]["rows"]["streamed"] == t.streamed
    assert [p.relative_to(out).parts[0] for p in out.rglob("*.parquet")] == ["data"] * len(data.shards)
    assert data.manifest.columns == offline_ds.manifest.columns  # the same per-tensor provenance
    fa = Fingerprints.load(str(out / "data"), name=data.manifest.fingerprints["path"])
    fb = Fingerprints.load(str(source / "ds"), name=offline_ds.manifest.fingerprints["path"])
    assert fa.sample_ids == fb.sample_ids and fa.digests == fb.digests  # the probes' raw tensors, hashed
    with pytest.raises(ProvenanceMismatch, match="is a streaming run's held-out data: the .* rows it was trained on"):
        prepare(TrainConfig.model_validate(train_raw(tiny_target, tmp_path / "r", dataset=str(out / "data"))))

    # the artifact's provenance is the offline one's in kind: ids, capture points, fingerprints, weights
    for engine in ("sglang", "vllm"):
        ma = json.loads((offline_run / "export" / engine / ARTIFACT_MANIFEST).read_text())
        mb = json.loads((out / "export" / engine / ARTIFACT_MANIFEST).read_text())
        for k in ("aux_layer_ids", "aux_capture_points", "target", "content_digest"):
            assert mb[k] == ma[k], k
        assert mb["dataset_id"] == data.manifest.dataset_id != ma["dataset_id"]


@pytest.mark.ray
@pytest.mark.parametrize("ids, verdict", [([2, 3, 4], "pass"), ([3, 4, 5], "block")])
def test_the_gate_judges_a_streamed_draft_as_the_offline_one(
    streamed_run, offline_run, tiny_target, tmp_path, ids, verdict
):
    reports = {}
    for name, run in (("offline", offline_run), ("streamed", streamed_run["out"])):
        art = run / "export" / "vllm"
        draft_cfg = {**json.loads((art / "config.json").read_text()), "eagle_aux_hidden_state_layer_ids": ids}
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(draft_cfg))
        reports[name] = run_validate(
            ValidateConfig.model_validate(
                {
                    "artifact": str(art),
                    "serving": {
                        "engine": "vllm",
                        "dtype": "float32",
                        "target": {"path": str(tiny_target)},
                        "draft_config": str(tmp_path / name / "config.json"),
                        "replay": "hf",
                    },
                    "acceptance_prompts": 2,
                }
            )
        )
    a, b = reports["offline"], reports["streamed"]
    assert a.decision == b.decision == verdict, (a.reasons, b.reasons)
    assert [s.ok for s in a.slots] == [s.ok for s in b.slots]
    assert a.reasons == b.reasons


def test_a_stream_config_is_checked_before_anything_starts(tiny_target, source, tmp_path):
    with pytest.raises(ConfigError, match="give exactly one of dataset"):
        validate_config(train_raw(tiny_target, tmp_path / "r"), TrainConfig)
    bad = tmp_path / "x.yaml"
    bad.write_text(yaml.safe_dump({**extract_raw(tiny_target, source / "conv.jsonl", tmp_path), "capture": ["nope"]}))
    cfg = TrainConfig.model_validate(train_raw(tiny_target, tmp_path / "r", data={"stream": str(bad)}))
    with pytest.raises(
        ConfigError,
        match=r"(?s)data.stream \(.*x.yaml\): invalid configuration.*capture: .*unknown capture point 'nope'",
    ):
        run_train(cfg, progress=False)
    assert not (tmp_path / "r").exists()
    # no final state to learn from: refused before any actor starts, with what to capture instead
    x = extract_raw(tiny_target, source / "conv.jsonl", tmp_path)
    for name, over, fix in (
        ("nofinal", {"capture": POINTS[:-1]}, "add final:post_norm"),
        (
            "sglang",
            {"capture": [*POINTS[:-1], "final:pre_norm"], "engine": {"name": "sglang", "dtype": "bfloat16"}},
            "cannot capture final:pre_norm; SGLang's capture ends at the last layer's input, so stream with engine hf",
        ),
    ):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({**x, **over}))
        cfg = TrainConfig.model_validate(
            train_raw(tiny_target, tmp_path / "r", data={"stream": str(tmp_path / f"{name}.yaml")})
        )
        with pytest.raises(ConfigError, match=f"a streaming run needs the target's final state.*{fix}"):
            stream.start(cfg, stream.extract_config(cfg), progress=False)
    assert not (tmp_path / "r").exists()


@pytest.mark.ray
def test_capture_actors_and_training_workers_are_one_plan_checked_up_front(
    ray_connected, tiny_target, source, tmp_path
):
    """The 2-CPU cluster fits one 1-CPU worker and one 1-CPU capture actor, not two of the actors."""
    x = extract_raw(tiny_target, source / "conv.jsonl", tmp_path)
    (tmp_path / "two.yaml").write_text(
        yaml.safe_dump({**x, "ray": {"num_actors": 2, "cpus_per_actor": 1, "resource_wait_s": 0}})
    )
    cfg = TrainConfig.model_validate(
        train_raw(tiny_target, tmp_path / "r", data={"stream": str(tmp_path / "two.yaml")}, resource_wait_s=0)
    )
    with pytest.raises(Exception, match=r"1 workers x cpus_per_worker 1 \+ 2 capture actors x cpus_per_actor 1.*3"):
        run_train(cfg, progress=False)
    assert not (tmp_path / "r").exists()


@pytest.mark.ray
def test_two_ray_train_workers_stream_their_shares_as_offline(
    ray_connected, tiny_target, source, offline_run, tmp_path
):
    """DeepSpeed ZeRO-2 on two Ray Train workers, each streaming its rank's batches from the one
    capture actor: the same steps and weights as the same two workers reading the offline dataset."""
    del offline_run  # its dataset
    kw = dict(
        num_workers=2,
        cpus_per_worker=0.5,
        max_steps=6,
        heldout_acceptance={"prompts": 0},
        export={"engines": ["vllm"], "dtype": "float32"},
    )
    runs = {}
    for name, data in (
        ("offline", {"dataset": str(source / "ds")}),
        # cached: the second epoch reads the first epoch's shards (or captures a batch none of them holds)
        ("streamed", {"data": {"stream": str(source / "extract.yaml"), "cache": str(tmp_path / "cache")}}),
    ):
        runs[name] = run_train(
            TrainConfig.model_validate(train_raw(tiny_target, tmp_path / name, **data, **kw)), progress=False
        )
    assert runs["offline"]["metrics"]["steps"] == runs["streamed"]["metrics"]["steps"] == 6
    fed = json.loads((tmp_path / "streamed" / "final_metrics.json").read_text())["stream_batches"]
    assert fed["captured"] + fed["from_cache"] == 6 and fed["captured"] > 0
    a = load_file(tmp_path / "offline/checkpoints/step-000006/model.safetensors")
    b = load_file(tmp_path / "streamed/checkpoints/step-000006/model.safetensors")
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.ray
def test_a_cached_stream_captures_its_first_epoch_once_and_trains_the_offline_draft(
    ray_connected, tiny_target, source, offline_run, tmp_path
):
    """``data.cache``: the first epoch's batches are captured and kept, one shard per step; later
    epochs read them -- the offline draft, bit for bit. A rerun of the same stream captures nothing;
    a run with another plan is refused the cache before it trains."""
    import pyarrow.parquet as pq

    cache = tmp_path / "cache"
    data = {"stream": str(source / "extract.yaml"), "in_flight": IN_FLIGHT, "cache": str(cache)}
    first = run_train(TrainConfig.model_validate(train_raw(tiny_target, tmp_path / "a", data=data)), progress=False)
    offline = json.loads((offline_run / "final_metrics.json").read_text())
    steps = first["metrics"]["steps"]
    assert steps == offline["steps"]
    name = f"step-{steps:06d}"
    a = load_file(offline_run / "checkpoints" / name / "model.safetensors")
    b = load_file(tmp_path / "a" / "checkpoints" / name / "model.safetensors")
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert first["metrics"]["eval"] == offline["eval"]

    fed = first["metrics"]["stream_batches"]
    epoch0 = fed["captured"]
    assert 0 < epoch0 < steps and fed["from_cache"] == steps - epoch0  # later epochs captured nothing
    shards = sorted(cache.rglob("*.parquet"))
    assert [p.relative_to(cache).as_posix() for p in shards] == [
        f"epoch-0/step-{s:07d}-rank-000.parquet" for s in range(epoch0)
    ]
    kept = [sid for p in shards for sid in pq.read_table(p, columns=["sample_id"])["sample_id"].to_pylist()]
    run = json.loads((tmp_path / "a" / "run.json").read_text())["extra"]["stream"]
    assert len(kept) == len(set(kept)) == run["rows"]["streamed"]  # every training sample once
    assert run["cache"] == str(cache)
    held = DatasetReader(str(tmp_path / "a" / "data"))
    assert [p.relative_to(tmp_path / "a").parts[0] for p in (tmp_path / "a").rglob("*.parquet")] == ["data"] * len(
        held.shards
    )  # the run itself still stores only its held-out samples
    as_dataset = DatasetReader(str(cache), manifest=held.manifest)  # the held-out data's columns decode them
    for p in shards[:2]:
        as_dataset.check_file_provenance(p.relative_to(cache).as_posix())  # ... and their provenance is its

    quick = dict(max_steps=epoch0 + 2, heldout_acceptance={"prompts": 0}, export={"engines": ["vllm"]})
    torn = cache / "epoch-0" / ".step-0000000-rank-000.parquet.tmp-dead"  # a capture actor killed mid-write
    torn.write_bytes(b"PAR1 half a shard")
    second = run_train(
        TrainConfig.model_validate(train_raw(tiny_target, tmp_path / "b", data=data, **quick)), progress=False
    )
    assert second["metrics"]["stream_batches"] == {"captured": 0, "from_cache": epoch0 + 2}
    assert not torn.exists() and len(list(cache.rglob("*.parquet"))) == epoch0  # removed; the shards untouched
    with pytest.raises(ConfigError, match=r"data.cache .*cache holds the batches of another stream"):
        run_train(TrainConfig.model_validate(train_raw(tiny_target, tmp_path / "c", data=data, seed=7, **quick)))
    assert not list((tmp_path / "c").glob("checkpoints/*"))
