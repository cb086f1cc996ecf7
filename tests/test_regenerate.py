"""``strata regenerate``: the conversations' assistant turns replaced by the target's own
responses -- deterministic for greedy, seeded when sampled, resumable after a kill, counts that
reconcile, and provenance that reaches the dataset and the draft artifact."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipeline.regenerate.job import output_uri, run_regenerate
from schemas.regenerate import RECORD_FILE, RegenerateConfig

REPO = Path(__file__).resolve().parents[1]


def regen_cfg(target: Path, source: Path, out: Path, **kw) -> RegenerateConfig:
    return RegenerateConfig.model_validate(
        {
            "target": {"path": str(target)},
            "source": {"uri": str(source)},
            "output": {"uri": str(out), "rows_per_unit": kw.pop("rows_per_unit", 8)},
            "engine": {"name": "hf", "dtype": "float32", "device": "cpu"},
            "max_new_tokens": kw.pop("max_new_tokens", 12),
            **kw,
        }
    )


@pytest.fixture(scope="module")
def source(tmp_path_factory, conversations) -> Path:
    """The demo conversations plus two rows that cannot become conversations."""
    p = tmp_path_factory.mktemp("regen-src") / "conv.jsonl"
    lines = conversations.read_text().splitlines()[:22]
    lines[3] = "{not json"
    lines[10] = json.dumps({"messages": [{"role": "user", "content": "no answer here"}]})
    p.write_text("\n".join(lines) + "\n")
    return p


@pytest.fixture(scope="module")
def greedy(tiny_target, source, tmp_path_factory):
    out = tmp_path_factory.mktemp("regen-greedy")
    return run_regenerate(regen_cfg(tiny_target, source, out), progress=False, use_ray=False), out


def test_greedy_regeneration_replaces_every_assistant_turn_and_reconciles(greedy, source, tiny_target):
    from pipeline.data.conversations import parse_row

    rec, out = greedy
    t = rec.totals
    assert t["rows"] == 22 == t["written"] + t["quarantined"] and t["quarantined"] == 2
    reasons = {q["row"]: q["reason"] for q in rec.quarantine}
    assert set(reasons) == {3, 10} and "malformed JSON" in reasons[3] and "no assistant turn" in reasons[10]
    written = [json.loads(x)["messages"] for x in (out / "conversations.jsonl").read_text().splitlines()]
    originals = [
        parse_row(x.encode()).messages for i, x in enumerate(source.read_text().splitlines()) if i not in (3, 10)
    ]
    assert len(written) == t["written"] == len(originals)
    for new, old in zip(written, originals, strict=True):
        # the users' turns are kept; the assistant's are the target's (a random-init target: not the originals)
        assert [m for m in new if m["role"] == "user"] == [m for m in old if m["role"] == "user"][
            : len([m for m in new if m["role"] == "user"])
        ]
        assert [m["role"] for m in new] == [m["role"] for m in old][: len(new)]
    assert sum(m["role"] == "assistant" for c in written for m in c) == t["turns"] > 0
    assert any(
        m["content"] != o["content"]
        for c, oc in zip(written, originals, strict=True)
        for m, o in zip(c, oc, strict=False)
        if m["role"] == "assistant"
    )
    assert rec.engine["name"] == "hf" and rec.sampling.temperature == 0 and rec.target.key
    # Each response is what the target itself decodes greedily for that prompt.
    from pipeline.data.chat import ChatEncoder
    from pipeline.engines.generation import HFGenerator
    from pipeline.identity import stop_token_ids

    enc, gen = ChatEncoder(tiny_target, 4096), HFGenerator(tiny_target, "float32", "cpu")
    first = written[0]
    i = next(j for j, m in enumerate(first) if m["role"] == "assistant")
    toks = gen.generate([enc.encode_prompt(first[:i])], 12, rec.sampling, [0])[0]
    assert enc.decode_response(toks, stop_token_ids(tiny_target)) == first[i]["content"]


def test_greedy_is_deterministic_and_a_finished_job_is_a_no_op(greedy, tiny_target, source, tmp_path):
    rec, out = greedy
    again = run_regenerate(
        regen_cfg(tiny_target, source, tmp_path / "again", rows_per_unit=5), progress=False, use_ray=False
    )
    # another unit size, the same bytes: a response depends on its conversation only
    assert (tmp_path / "again" / "conversations.jsonl").read_bytes() == (out / "conversations.jsonl").read_bytes()
    assert again.output_sha256 == rec.output_sha256
    mtime = (out / RECORD_FILE).stat().st_mtime_ns
    assert run_regenerate(regen_cfg(tiny_target, source, out), progress=False, use_ray=False) == rec
    assert (out / RECORD_FILE).stat().st_mtime_ns == mtime
    from pipeline.regenerate.job import RegenerationError

    with pytest.raises(RegenerationError, match="already holds another regeneration"):
        run_regenerate(regen_cfg(tiny_target, source, out, max_new_tokens=5), progress=False, use_ray=False)


def test_sampled_regeneration_is_seeded(tiny_target, source, tmp_path):
    def run(name, seed):
        cfg = regen_cfg(tiny_target, source, tmp_path / name, sampling={"temperature": 1.0, "seed": seed})
        run_regenerate(cfg, progress=False, use_ray=False)
        return (tmp_path / name / "conversations.jsonl").read_text()

    a, b, c = run("a", 1), run("b", 1), run("c", 2)
    assert a == b and a != c


def test_resume_after_a_kill_finishes_with_the_uninterrupted_bytes(greedy, tiny_target, source, tmp_path):
    """``jobs/regenerate.py`` SIGKILLed once a unit is committed; the re-run skips it and the result
    is byte for byte the uninterrupted run's."""
    _, ref = greedy
    out = tmp_path / "out"
    cfg_path = tmp_path / "regen.yaml"
    cfg_path.write_text(
        yaml.safe_dump(json.loads(regen_cfg(tiny_target, source, out, rows_per_unit=4).model_dump_json()))
    )
    cmd = [sys.executable, "jobs/regenerate.py", "--config", str(cfg_path), "--no-ray", "--no-progress"]
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ}
    )
    deadline = time.monotonic() + 300
    while not list((out / "_units").glob("unit-*.json")) and proc.poll() is None:
        assert time.monotonic() < deadline, "no unit was committed in time"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL, proc.stderr.read()[-3000:]
    assert not (out / RECORD_FILE).exists() and not (out / "conversations.jsonl").exists()
    committed = {p.name: p.stat().st_mtime_ns for p in (out / "_units").glob("unit-*.json")}
    assert 1 <= len(committed) < 6
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    # a killed worker may still have committed the unit in hand: never fewer skipped than counted
    found = re.search(r"(\d+) rows in (\d+) units; (\d+) already committed, (\d+) to generate", done.stderr)
    assert found, done.stderr[-3000:]
    rows, units, skipped, generated = map(int, found.groups())
    assert (rows, units) == (22, 6) and skipped >= len(committed) and skipped + generated == units
    for name, mtime in committed.items():  # committed units were not redone
        assert (out / "_units" / name).stat().st_mtime_ns == mtime
    assert (out / "conversations.jsonl").read_bytes() == (ref / "conversations.jsonl").read_bytes()


@pytest.mark.ray
def test_on_ray_the_regenerated_data_carries_its_provenance_into_the_dataset_and_the_artifact(
    ray_cluster, greedy, tiny_target, source, tmp_path
):
    """The job on the test cluster's actors writes the same bytes; extraction of its output records
    the regeneration, and training carries it into every exported artifact."""
    from pipeline.extract.job import run_extract
    from pipeline.train.job import run_train
    from schemas.artifact import ARTIFACT_MANIFEST
    from schemas.extract import ExtractConfig
    from schemas.train import TrainConfig

    rec, ref = greedy
    cfg = regen_cfg(tiny_target, source, tmp_path / "regen", ray={"address": ray_cluster["address"], "num_actors": 2})
    on_ray = run_regenerate(cfg, progress=False, use_ray=True)
    assert on_ray.output_sha256 == rec.output_sha256
    m = run_extract(
        ExtractConfig.model_validate(
            {
                "target": {"path": str(tiny_target)},
                "source": {"uri": output_uri(cfg)},
                "output": {"uri": str(tmp_path / "ds")},
                "capture": ["layer_output:1", "layer_output:2", "layer_output:3", "final:post_norm"],
                "max_length": 256,
                "engine": {"dtype": "float32", "device": "cpu"},
                "fingerprint": {"probe_samples": 2},
            }
        ),
        progress=False,
        use_ray=False,
    )
    regen = m.source.regeneration
    assert regen is not None and regen["output_sha256"] == m.source.sha256 == rec.output_sha256
    from schemas.identity import TargetIdentity

    assert TargetIdentity.model_validate(regen["target"]).key == rec.target.key and regen["engine"]["name"] == "hf"
    assert regen["sampling"] == {"temperature": 0.0, "top_p": 1.0, "seed": 0}
    run_train(
        TrainConfig.model_validate(
            {
                "dataset": str(tmp_path / "ds"),
                "target": {"path": str(tiny_target)},
                "output": str(tmp_path / "run"),
                "draft_vocab_size": 512,
                "ttt_steps": 1,
                "batch_tokens": 512,
                "epochs": 1,
                "num_workers": 1,
                "heldout_acceptance": {"prompts": 0},
                "deepspeed": {"zero_stage": 2, "dtype": "float32"},
                "export": {"dtype": "float32", "engines": ["vllm"]},
            }
        ),
        use_ray=False,
    )
    art = json.loads((tmp_path / "run" / "export" / "vllm" / ARTIFACT_MANIFEST).read_text())
    assert art["training"]["data_source"]["regeneration"]["output_sha256"] == rec.output_sha256
    # An edited file is no longer the target's output: extraction does not call it regenerated.
    edited = tmp_path / "regen-edited"
    edited.mkdir()
    (edited / "conversations.jsonl").write_bytes((ref / "conversations.jsonl").read_bytes()[:-1] + b" \n")
    (edited / RECORD_FILE).write_bytes((ref / RECORD_FILE).read_bytes())
    from pipeline.data.source import regeneration_of, scan_source

    scan = scan_source(str(edited / "conversations.jsonl"))
    assert regeneration_of(str(edited / "conversations.jsonl"), scan.sha256) is None


@pytest.mark.vllm
def test_regeneration_through_vllm_matches_the_hf_answers(vllm_engine, greedy, tiny_target, source, tmp_path):
    """vLLM (batched, fp32) writes the same greedy answers as HF one prompt at a time, and says so
    in the record."""
    rec, ref = greedy
    cfg = regen_cfg(
        tiny_target,
        source,
        tmp_path / "vllm",
        engine={"name": "vllm", "dtype": "float32", "max_model_len": 1024},
        max_length=512,
    )
    got = run_regenerate(cfg, progress=False, use_ray=False)
    assert got.engine["name"] == "vllm" and got.engine["version"] == vllm_engine.vllm_version()
    assert got.totals["rows"] == got.totals["written"] + got.totals["quarantined"] == 22
    a = (tmp_path / "vllm" / "conversations.jsonl").read_text().splitlines()
    b = (ref / "conversations.jsonl").read_text().splitlines()
    same = sum(x == y for x, y in zip(a, b, strict=True))
    assert same >= len(b) - 1, f"{same} of {len(b)} conversations identical"  # fp32 kernels may flip one near-tie


@pytest.mark.vllm
def test_vllm_sampling_is_seeded_per_prompt_whatever_shares_its_batch(vllm_engine, tiny_target):
    """Sampled regeneration through vLLM: a prompt's response depends on its seed alone -- not on
    the other prompts in its batch or their order -- and another seed samples another response."""
    from pipeline.engines.generation import VLLMGenerator
    from schemas.regenerate import GenerateEngineConfig, SamplingConfig

    gen = VLLMGenerator(tiny_target, GenerateEngineConfig(name="vllm", dtype="float32", max_model_len=512))
    hot = SamplingConfig(temperature=1.0, seed=0)
    prompts = [list(range(5, 25)), list(range(30, 41)), list(range(50, 58))]
    try:
        a = gen.generate(prompts, 16, hot, [11, 12, 13])
        b = gen.generate(prompts[::-1], 16, hot, [13, 12, 11])[::-1]
        alone = gen.generate(prompts[1:2], 16, hot, [12])
        c = gen.generate(prompts, 16, hot, [21, 22, 23])
        greedy = gen.generate(prompts, 16, SamplingConfig(), [11, 12, 13])
    finally:
        gen.close()
    assert a == b and alone == a[1:2]
    assert all(len(x) > 0 for x in a) and a != c
    assert greedy != a  # temperature 1 on a random-init target is not its argmax


def test_a_regeneration_actor_does_not_span_nodes(tiny_target, source, tmp_path):
    """Only extraction places an actor over several nodes; a regeneration config that asks is refused."""
    with pytest.raises(ValueError, match=r"ray.nodes_per_actor 2: regeneration runs each actor inside one node"):
        regen_cfg(tiny_target, source, tmp_path / "out", ray={"nodes_per_actor": 2, "gpus_per_actor": 2})
