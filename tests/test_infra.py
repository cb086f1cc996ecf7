"""infra/: the KubeRay, CronJob and `ray up` manifests, the cluster job configs and the
DeepSpeed files parse, carry what their controllers require, and agree with jobs/ and
each other (one image, entrypoints that exist, GPUs per extraction actor = TP size)."""

import json
import re
import shlex
from pathlib import Path

import pytest
import ray
import yaml

from schemas.config import load_config
from schemas.extract import ExtractConfig
from schemas.retrain import RetrainConfig
from schemas.train import TrainConfig
from schemas.validation import ValidateConfig

REPO = Path(__file__).resolve().parents[1]
INFRA = REPO / "infra"
CONFIG_MODEL = {"extract": ExtractConfig, "train": TrainConfig, "retrain": RetrainConfig, "validate": ValidateConfig}


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def all_k8s() -> list[tuple[str, dict]]:
    out = []
    for p in sorted((INFRA / "k8s").glob("*.yaml")):
        for d in docs(p):
            out.append((p.name, d))
            if d["kind"] == "ConfigMap":  # the RayJob the CronJob creates
                out += [(f"{p.name}:{k}", yaml.safe_load(v)) for k, v in d["data"].items() if k.endswith(".yaml")]
    return out


def image_tag() -> str:
    return re.search(r"-t (\S+) \.", (INFRA / "docker" / "Dockerfile").read_text()).group(1)


def images(obj) -> list[str]:
    if isinstance(obj, dict):
        return ([obj["image"]] if isinstance(obj.get("image"), str) else []) + [
            i for v in obj.values() for i in images(v)
        ]
    if isinstance(obj, list):
        return [i for v in obj for i in images(v)]
    return []


def cluster_specs() -> list[tuple[str, dict]]:
    out = []
    for name, d in all_k8s():
        if d["kind"] == "RayCluster":
            out.append((name, d["spec"]))
        elif d["kind"] == "RayJob":
            out.append((name, d["spec"]["rayClusterSpec"]))
    return out


def test_every_manifest_parses_with_its_required_fields():
    kinds = {}
    for name, d in all_k8s():
        assert {"apiVersion", "kind", "metadata"} <= set(d), name
        assert d["metadata"].get("name") or d["metadata"].get("generateName"), name
        kinds.setdefault(d["kind"], []).append(name)
    assert {"RayCluster", "RayJob", "CronJob", "ConfigMap", "ServiceAccount", "Role", "RoleBinding"} <= set(kinds)
    assert len(kinds["RayJob"]) == 3  # extract, train, and the retrain job the CronJob submits


@pytest.mark.parametrize("name, spec", cluster_specs(), ids=[n for n, _ in cluster_specs()])
def test_ray_cluster_specs(name, spec):
    assert spec["rayVersion"].rsplit(".", 1)[0] == ray.__version__.rsplit(".", 1)[0], "same Ray as pyproject"
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0", "no work on the head"
    assert head["template"]["spec"]["containers"][0]["name"] == "ray-head"
    assert spec["workerGroupSpecs"], name
    for g in spec["workerGroupSpecs"]:
        c = g["template"]["spec"]["containers"][0]
        gpus = c["resources"]["limits"]["nvidia.com/gpu"]
        assert g["rayStartParams"]["num-gpus"] == gpus == c["resources"]["requests"]["nvidia.com/gpu"], g["groupName"]
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"], g["groupName"]
        mounts = {m["name"] for m in c.get("volumeMounts", [])}
        assert mounts <= {v["name"] for v in g["template"]["spec"].get("volumes", [])}, g["groupName"]


def test_one_image_everywhere():
    tag = image_tag()
    found = [i for _, d in all_k8s() if d["kind"] != "CronJob" for i in images(d)]
    found += [yaml.safe_load((INFRA / "ray" / "cluster.yaml").read_text())["docker"]["image"]]
    assert found and set(found) == {tag}


def entrypoints() -> list[tuple[str, str]]:
    return [(n, d["spec"]["entrypoint"]) for n, d in all_k8s() if d["kind"] == "RayJob"]


@pytest.mark.parametrize("name, entrypoint", entrypoints(), ids=[n for n, _ in entrypoints()])
def test_rayjob_entrypoints_run_jobs_with_valid_configs(name, entrypoint):
    argv = shlex.split(entrypoint)
    assert argv[0] == "python" and argv[1].startswith("jobs/") and (REPO / argv[1]).is_file(), entrypoint
    config = Path(argv[argv.index("--config") + 1])
    assert (REPO / config).is_file(), config
    kind = Path(argv[1]).stem
    cfg = load_config(REPO / config, CONFIG_MODEL[kind])  # validates, naming any bad field
    gpu_groups = {
        g["groupName"]: int(g["rayStartParams"]["num-gpus"])
        for _, spec in cluster_specs()
        for g in spec["workerGroupSpecs"]
    }
    if kind in ("extract", "retrain"):
        ex = cfg if kind == "extract" else cfg.extract_config("/x", "/y")
        assert ex.ray.gpus_per_actor == ex.engine.tp_size > 1
        assert gpu_groups["extract-tp4"] % ex.engine.tp_size == 0
    if kind in ("train", "retrain"):
        tr = cfg if kind == "train" else cfg.train_config("/x", "/y", None)
        assert tr.use_gpu and tr.num_workers <= gpu_groups["train-gpu"]


def test_cronjob_submits_the_retrain_rayjob():
    objs = {d["kind"]: d for d in docs(INFRA / "k8s" / "cronjob-retrain.yaml")}
    cron = objs["CronJob"]["spec"]
    assert len(cron["schedule"].split()) == 5 and cron["concurrencyPolicy"] == "Forbid"
    pod = cron["jobTemplate"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == objs["ServiceAccount"]["metadata"]["name"]
    assert objs["RoleBinding"]["subjects"][0]["name"] == pod["serviceAccountName"]
    rule = objs["Role"]["rules"][0]
    assert "ray.io" in rule["apiGroups"] and "rayjobs" in rule["resources"] and "create" in rule["verbs"]
    cmd = pod["containers"][0]["command"]
    mount = pod["containers"][0]["volumeMounts"][0]["mountPath"]
    assert cmd[:3] == ["kubectl", "create", "-f"] and cmd[3].startswith(mount)
    assert pod["volumes"][0]["configMap"]["name"] == objs["ConfigMap"]["metadata"]["name"]
    job = yaml.safe_load(objs["ConfigMap"]["data"][Path(cmd[3]).name])
    assert job["kind"] == "RayJob" and "jobs/retrain.py" in job["spec"]["entrypoint"]
    assert job["metadata"]["generateName"], "each scheduled pass needs its own RayJob name"


def test_ray_up_cluster_yaml():
    c = yaml.safe_load((INFRA / "ray" / "cluster.yaml").read_text())
    assert c["head_node_type"] in c["available_node_types"]
    assert c["available_node_types"][c["head_node_type"]]["resources"]["CPU"] == 0
    tp = load_config(INFRA / "configs" / "extract.yaml", ExtractConfig).engine.tp_size
    assert c["available_node_types"]["extract-tp4"]["resources"]["GPU"] % tp == 0
    assert sum(t.get("max_workers", 0) for t in c["available_node_types"].values()) <= c["max_workers"]


@pytest.mark.parametrize("path", sorted((INFRA / "deepspeed").glob("*.json")), ids=lambda p: p.name)
def test_deepspeed_configs_are_accepted_by_deepspeed(path, tiny_target, tmp_path):
    from deepspeed.runtime.config import DeepSpeedConfig

    from pipeline.train.trainer import ds_config

    extra = json.loads(path.read_text())
    stage = extra["zero_optimization"]["stage"]
    cfg = TrainConfig.model_validate(
        {
            "dataset": "/d",
            "target": {"path": str(tiny_target)},
            "output": "/o",
            "deepspeed": {"zero_stage": stage, "config_file": str(path)},
        }
    )
    merged = ds_config(cfg)
    assert merged["train_micro_batch_size_per_gpu"] == 1 and merged["zero_optimization"]["stage"] == stage
    parsed = DeepSpeedConfig(merged)  # DeepSpeed's own validation (unknown keys are errors)
    assert parsed.zero_optimization_stage == stage
    bad = TrainConfig.model_validate(
        {
            "dataset": "/d",
            "target": {"path": str(tiny_target)},
            "output": "/o",
            "deepspeed": {"zero_stage": 1 if stage != 1 else 2, "config_file": str(path)},
        }
    )
    with pytest.raises(ValueError, match="disagrees with deepspeed.zero_stage"):
        ds_config(bad)


def test_the_multinode_extraction_config_spans_whole_nodes():
    """One actor over two 8-GPU nodes: 16 GPU bundles plus the actor's own, refused on one node."""
    from pipeline.errors import UnusableInput
    from pipeline.placement import actor_bundles, check_nodes

    cfg = load_config(INFRA / "configs" / "extract-multinode.yaml", ExtractConfig)
    assert cfg.ray.nodes_per_actor == 2 and cfg.ray.gpus_per_actor == cfg.engine.tp_size == 16
    assert actor_bundles(cfg.ray) == [{"CPU": 8}] + [{"GPU": 1.0}] * 16
    node = {"Alive": True, "Resources": {"CPU": 96, "GPU": 8}}
    check_nodes(cfg.ray, [node, node, {"Alive": True, "Resources": {"CPU": 8}}])
    with pytest.raises(UnusableInput, match="need 2 nodes with 8 GPUs each"):
        check_nodes(cfg.ray, [node, {**node, "Alive": False}])


def test_the_streaming_training_config_names_an_extraction_config_for_the_same_target():
    from pipeline.train.stream import extract_config
    from schemas.train import TrainConfig

    cfg = load_config(INFRA / "configs" / "train-stream.yaml", TrainConfig)
    assert cfg.dataset is None and cfg.data is not None
    x = extract_config(
        cfg.model_copy(update={"data": cfg.data.model_copy(update={"stream": str(REPO / cfg.data.stream)})})
    )
    assert x.target.path == cfg.target.path and x.output.uri == cfg.stream_data
    assert x.ray.gpus_per_actor >= 1 and cfg.use_gpu  # capture actors and workers on their own GPUs
