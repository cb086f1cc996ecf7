"""The four jobs as a user runs them on a cluster: `ray job submit --working-dir .` against
a Ray head started on 127.0.0.1 (only that cluster is stopped afterwards), extract ->
train -> validate (recording into a registry) -> promote, then the registry is checked."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.registry.registry import Registry
from pipeline.store.objects import LocalStore
from pipeline.store.reader import DatasetReader

REPO = Path(__file__).resolve().parents[1]


def submit(cluster, *argv: str) -> subprocess.CompletedProcess:
    ray_bin = str(Path(sys.executable).parent / "ray")
    return subprocess.run(
        [ray_bin, "job", "submit", "--address", cluster["dashboard"], "--working-dir", ".", "--", "python", *argv],
        cwd=REPO,
        env={**os.environ, **cluster["env"]},
        capture_output=True,
        text=True,
        timeout=900,
    )


def ok(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    assert "succeeded" in res.stdout, res.stdout[-2000:]
    return res.stdout


def test_extract_train_validate_promote_through_ray_job_submit(ray_cluster, tiny_target, conversations, tmp_path):
    ds, run, reg_dir = tmp_path / "ds", tmp_path / "run", tmp_path / "registry"
    (tmp_path / "extract.yaml").write_text(
        json.dumps(
            {
                "target": {"path": str(tiny_target)},
                "source": {"uri": str(conversations)},
                "output": {"uri": str(ds), "rows_per_shard": 16},
                "capture": ["layer_output:1", "layer_output:2", "layer_output:3", "final:post_norm"],
                "max_length": 128,
                "engine": {"dtype": "float32", "device": "cpu"},
                "fingerprint": {"probe_samples": 4},
                "ray": {"num_actors": 1, "cpus_per_actor": 1},
            }
        )
    )
    ok(submit(ray_cluster, "jobs/extract.py", "--config", str(tmp_path / "extract.yaml"), "--no-progress"))
    assert DatasetReader(str(ds)).manifest.totals.rows == 40

    (tmp_path / "train.yaml").write_text(
        json.dumps(
            {
                "dataset": str(ds),
                "target": {"path": str(tiny_target)},
                "output": str(run),
                "draft_vocab_size": 4096,
                "ttt_steps": 2,
                "batch_tokens": 1024,
                "epochs": 1,
                "num_workers": 1,
                "eval_fraction": 0.1,
                "deepspeed": {"zero_stage": 2, "dtype": "float32"},
                "export": {"dtype": "float32", "engines": ["vllm"]},
            }
        )
    )
    ok(submit(ray_cluster, "jobs/train.py", "--config", str(tmp_path / "train.yaml")))
    art = run / "export" / "vllm"
    digest = json.loads((art / "strata_artifact.json").read_text())["content_digest"]

    (tmp_path / "validate.yaml").write_text(
        json.dumps(
            {
                "artifact": str(art),
                "acceptance_prompts": 1,
                "max_new_tokens": 8,
                "serving": {"engine": "vllm", "replay": "hf", "dtype": "float32", "target": {"path": str(tiny_target)}},
            }
        )
    )
    from pipeline.cli import main as strata

    assert (
        strata(
            [
                "registry",
                "create-channel",
                "production",
                "--validate-config",
                str(tmp_path / "validate.yaml"),
                "--registry",
                str(reg_dir),
            ]
        )
        == 0
    )
    out = ok(
        submit(ray_cluster, "jobs/validate.py", "--config", str(tmp_path / "validate.yaml"), "--registry", str(reg_dir))
    )
    assert "PASS" in out
    out = ok(submit(ray_cluster, "jobs/promote.py", digest, "--channel", "production", "--registry", str(reg_dir)))
    assert f"production -> {digest}" in out

    reg = Registry(LocalStore(reg_dir))
    assert reg.pointer("production")[0].artifact_digest == digest
    actions = [(e.action, e.decision) for e in reg.history()]
    assert ("add_record", "accepted") in actions and actions[-1] == ("promote", "accepted")


LISTENERS = r"""
import json, os, signal, sys, time, psutil
from pipeline.cluster import init_ray, start_ray_meanwhile
if sys.argv[1] == "meanwhile":  # as `strata train` starts it: on a helper thread, while the driver imports
    start_ray_meanwhile(dashboard=False)
    time.sleep(4)  # the driver's imports; the start finishes on the helper thread meanwhile
    assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN, None)
init_ray(dashboard=sys.argv[1] == "dashboard")
import ray
from ray._private.authentication.authentication_utils import is_token_auth_enabled

@ray.remote(num_cpus=1)
class Speaker:
    def say(self, word):
        print(word, flush=True)
        return os.getpid()

ray.get(Speaker.remote().say.remote("HELLO-FROM-THE-ACTOR"))
me = psutil.Process()
procs = [me, *me.children(recursive=True)]
found, commands = [], []
for p in procs:
    try:
        commands.append(" ".join(p.cmdline()))
        for c in p.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN:
                found.append([p.name(), c.laddr.ip, c.laddr.port])
    except psutil.Error:
        pass
print("LISTEN " + json.dumps({"listen": found, "node_ip": ray.util.get_node_ip_address(), "commands": commands,
                              "token_auth": is_token_auth_enabled()}), flush=True)
import time; time.sleep(1.5)  # the log monitor forwards the actor's output about once a second
ray.shutdown()
"""


@pytest.mark.parametrize("mode", ["dashboard", "lean", "meanwhile"])
def test_the_local_runtime_strata_starts_listens_on_loopback_only_with_auth(tmp_path, mode):
    """What `strata extract`/`train` start when no cluster is given, in a clean environment (none
    of the variables the other tests set). Without the dashboard (extraction, one-worker
    training) the runtime starts lean: no API server, no autoscaler monitor, a minimal agent;
    actors still run and their output still reaches the job's console. ``meanwhile``: started on
    a helper thread as `strata train` starts it, the runtime outlives the start (Linux ends a
    child when the thread that spawned it ends) and says nothing about a SIGTERM handler."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_USAGE_STATS_ENABLED="0")
    out = subprocess.run(
        [sys.executable, "-c", LISTENERS, mode], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    line = next((x for x in out.stdout.splitlines() if x.startswith("LISTEN ")), None)
    assert line, out.stdout[-2000:] + out.stderr[-3000:]
    got = json.loads(line[len("LISTEN ") :])
    names = {n for n, _, _ in got["listen"]}
    assert {"gcs_server", "raylet"} <= names, got
    outside = [x for x in got["listen"] if x[1] not in ("127.0.0.1", "::ffff:127.0.0.1", "::1")]
    assert not outside, f"listening beyond loopback: {outside}"
    assert got["node_ip"] == "127.0.0.1" and got["token_auth"] is True
    started = {
        "api server": any("dashboard/dashboard.py" in c for c in got["commands"]),
        "monitor": any("autoscaler/_private/monitor.py" in c for c in got["commands"]),
        # the agent renames its process; the raylet's command line carries the agent's command
        "minimal agent": any("dashboard/agent.py" in c and "--minimal" in c for c in got["commands"]),
        "log monitor": any("_private/log_monitor.py" in c for c in got["commands"]),
    }
    lean = mode != "dashboard"
    assert started == {"api server": not lean, "monitor": not lean, "minimal agent": lean, "log monitor": True}, (
        started,
        got["commands"],
    )
    assert "HELLO-FROM-THE-ACTOR" in out.stdout + out.stderr, out.stderr[-3000:]
    assert "SIGTERM handler is not set" not in out.stderr, out.stderr[-3000:]


def test_a_ray_start_begun_meanwhile_raises_its_error_where_the_job_waits_for_ray():
    """The helper thread's failure is the job's: the next init_ray raises it, once."""
    code = (
        "import ray\n"
        "def refuse(**_): raise RuntimeError('no room for a raylet')\n"
        "ray.init = refuse\n"
        "from pipeline.cluster import init_ray, start_ray_meanwhile\n"
        "start_ray_meanwhile(dashboard=False)\n"
        "try:\n"
        "    init_ray(dashboard=False)\n"
        "except RuntimeError as e:\n"
        "    print('RAISED', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "RAISED no room for a raylet" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
