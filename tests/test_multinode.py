"""Extraction and training on a Ray cluster of several nodes on this machine
(``ray.cluster_utils.Cluster``: one raylet per node, each with its own CPUs), with a node
removed mid-run. The invariants are the single-node ones: after a rerun every source row is
in the dataset exactly once and committed shards are untouched; training resumes from its
last checkpoint and finishes with every step accounted for."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.store.reader import DatasetReader

pytestmark = [pytest.mark.ray, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def cluster():
    """A head and two worker nodes, all on 127.0.0.1 (the conftest keeps Ray on loopback)."""
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    workers = [c.add_node(num_cpus=1) for _ in range(2)]
    c.wait_for_nodes()
    yield c, workers
    c.shutdown()


def launch(script: str, cfg: dict, tmp_path: Path, address: str) -> subprocess.Popen:
    p = tmp_path / f"{script}-{len(list(tmp_path.iterdir()))}.json"
    p.write_text(json.dumps(cfg))
    env = {**os.environ, "RAY_ADDRESS": address}
    extra = ["--no-progress"] if script == "extract" else []
    return subprocess.Popen(
        [sys.executable, f"jobs/{script}.py", "--config", str(p), *extra],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting (exit {proc.returncode}): {proc.stderr.read()[-3000:]}")
        time.sleep(0.1)


def finish(script, cfg, tmp_path, address, first: subprocess.Popen) -> str:
    """Let the interrupted run end (it may recover by itself); rerun it if it failed."""
    first.wait(600)
    err = first.stderr.read()
    if first.returncode == 0:
        return "recovered"
    rerun = launch(script, cfg, tmp_path, address)
    rerun.wait(900)
    assert rerun.returncode == 0, (err[-1500:], rerun.stderr.read()[-3000:])
    return "resumed"


def test_extraction_survives_a_node_removed_mid_run(cluster, tiny_target, conversations, tmp_path):
    c, workers = cluster
    out = tmp_path / "ds"
    cfg = {
        "target": {"path": str(tiny_target)},
        "source": {"uri": str(conversations)},
        "output": {"uri": str(out), "rows_per_shard": 4},
        "max_length": 128,
        "capture": ["layer_output:1", "layer_output:2", "layer_output:3", "final:post_norm"],
        "engine": {"dtype": "float32", "device": "cpu"},
        "ray": {"num_actors": 2, "cpus_per_actor": 0.5},
    }
    job = launch("extract", cfg, tmp_path, c.address)
    wait_for(lambda: len(list((out / "_units").glob("unit-*.json"))) >= 1, job)
    committed = {p.name: p.stat().st_mtime_ns for p in (out / "_units").glob("unit-*.json")}
    c.remove_node(workers[0], allow_graceful=False)
    c.add_node(num_cpus=1)  # capacity comes back as a new node, as an autoscaler would bring it
    how = finish("extract", cfg, tmp_path, c.address, job)
    r = DatasetReader(str(out))
    r.verify_all()
    rows = [s.sample_id for s in r.iter_samples()]
    q = (out / "quarantine.jsonl").read_text().splitlines()
    n_source = len(conversations.read_text().splitlines())
    assert len(rows) == len(set(rows)) and len(rows) + len(q) == n_source, how
    for name, mtime in committed.items():  # units committed before the node died were not redone
        assert (out / "_units" / name).stat().st_mtime_ns == mtime, (name, how)


def test_training_resumes_after_a_node_removed_mid_run(cluster, trained_run, tiny_target, tmp_path):
    c, workers = cluster
    out = tmp_path / "run"
    cfg = {
        "dataset": str(trained_run.parent / "ds"),
        "target": {"path": str(tiny_target)},
        "output": str(out),
        "draft_vocab_size": 4096,
        "ttt_steps": 2,
        "batch_tokens": 512,
        "epochs": 2,
        "max_steps": 12,
        "checkpoint_every": 3,
        "metrics_every": 3,
        "eval_fraction": 0.0,
        "num_workers": 2,
        "cpus_per_worker": 1.0,
        "data_loading": "ray_data",
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "deepspeed": {"zero_stage": 2, "dtype": "float32"},
        "export": {"dtype": "float32"},
    }
    job = launch("train", cfg, tmp_path, c.address)
    wait_for(lambda: (out / "checkpoints" / "latest.json").exists(), job, timeout=600)
    first_ckpt = json.loads((out / "checkpoints" / "latest.json").read_text())["step"]
    for w in workers:  # the nodes the two workers need: at least one of them hosts a worker
        c.remove_node(w, allow_graceful=False)
    for _ in workers:
        c.add_node(num_cpus=1)
    how = finish("train", cfg, tmp_path, c.address, job)
    final = json.loads((out / "final_metrics.json").read_text())
    assert final["steps"] == 12 and first_ckpt >= 3, (final, how)
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines() if '"step"' in x]
    assert steps and max(steps) == 12
    assert (out / "export" / "vllm" / "strata_artifact.json").exists()


# -- a capture actor spanning nodes (a target larger than one node) ---------------------------
SPANNING = """
import json, sys
import ray
from pipeline.placement import check_nodes, place_actor
from schemas.extract import RayConfig

ray.init(address=sys.argv[1], log_to_driver=False)
r = RayConfig(num_actors=1, cpus_per_actor=0.5, gpus_per_actor=4, nodes_per_actor=2, stall_timeout_s=60)
check_nodes(r)
placed = place_actor(r, r.stall_timeout_s)


@ray.remote(num_cpus=0, num_gpus=1)
def rank():  # asks what vLLM's Ray executor asks for each worker (ray_executor.py: num_cpus=0, one GPU)
    return ray.get_runtime_context().get_node_id()


@ray.remote
class Actor:
    def inside(self):
        pg = ray.util.get_current_placement_group()  # what vLLM's Ray executor looks up
        return {
            "group": pg.id.hex(),
            "bundles": pg.bundle_specs,
            "node": ray.get_runtime_context().get_node_id(),
            "ranks": ray.get([rank.remote() for _ in range(4)]),
        }


a = Actor.options(**placed.options).remote()
seen = ray.get(a.inside.remote())
table = ray.util.placement_group_table(placed.group)
print(json.dumps({**seen, "placed": placed.group.id.hex(), "bundle_nodes": table["bundles_to_node_id"]}))
ray.kill(a)
placed.remove()
"""


def test_a_capture_actor_spanning_nodes_owns_a_placement_group_vllm_can_fill(tmp_path):
    """``ray.nodes_per_actor: 2`` with 4 GPUs (two nodes of 2, GPUs declared to Ray: none are needed
    to place work): the actor runs in its own placement group, sees it as the current group (what
    vLLM's Ray executor uses), the group keeps vLLM's rules (at most one GPU per bundle, one GPU
    bundle per rank) and the ranks it starts land two on each GPU node."""
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    gpu_nodes = [c.add_node(num_cpus=1, num_gpus=2) for _ in range(2)]
    c.wait_for_nodes()
    try:
        out = subprocess.run(
            [sys.executable, "-c", SPANNING, c.address], cwd=REPO, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr[-3000:]
        seen = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        c.shutdown()
    assert seen["group"] == seen["placed"]
    assert seen["bundles"][0] == {"CPU": 0.5} and seen["bundles"][1:] == [{"GPU": 1.0}] * 4
    ids = {n.node_id for n in gpu_nodes}
    gpu_bundle_nodes = [seen["bundle_nodes"][str(i)] for i in range(1, 5)]  # JSON keys
    assert sorted(gpu_bundle_nodes) == sorted(seen["ranks"])  # every rank ran in one of the group's GPU bundles
    assert {n: seen["ranks"].count(n) for n in ids} == dict.fromkeys(ids, 2)


def test_a_spanning_actor_is_refused_up_front_without_enough_whole_nodes(tiny_target, conversations, tmp_path):
    """4 GPUs in total but not two nodes of 2 (3 + 1): the extraction job refuses before writing anything,
    saying what the nodes have."""
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    c.add_node(num_cpus=1, num_gpus=3)
    c.add_node(num_cpus=1, num_gpus=1)
    c.wait_for_nodes()
    out = tmp_path / "ds"
    cfg = {
        "target": {"path": str(tiny_target)},
        "source": {"uri": str(conversations)},
        "output": {"uri": str(out)},
        "capture": ["layer_output:1", "final:pre_norm"],
        "engine": {"name": "vllm", "tp_size": 4},
        "ray": {"num_actors": 1, "cpus_per_actor": 1, "gpus_per_actor": 4, "nodes_per_actor": 2, "resource_wait_s": 0},
    }
    try:
        job = launch("extract", cfg, tmp_path, c.address)
        job.wait(300)
        err = job.stderr.read()
    finally:
        c.shutdown()
    assert job.returncode != 0
    assert "need 2 nodes with 2 GPUs each" in err and "the cluster's nodes have 3, 1, 0 GPUs" in err, err[-2000:]
    assert not out.exists() or not any(out.iterdir())
