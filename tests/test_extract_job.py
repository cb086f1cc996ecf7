"""The extraction job on a real Ray cluster (started by the tests on 127.0.0.1)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.cli import main as strata
from pipeline.extract.job import run_extract
from pipeline.store.reader import DatasetReader
from schemas.extract import ExtractConfig

pytestmark = pytest.mark.ray
REPO = Path(__file__).resolve().parents[1]

BAD = [
    b'{"messages": [{"role": "user"',
    b'{"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}',
    b'{"messages": [{"role": "user", "content": "only a question"}]}',
    b'{"conversations": [{"from": "human", "value": ""}, {"from": "gpt", "value": "y"}]}',
    b'{"messages": [{"role": "user", "content": "\xff\xfe"}, {"role": "assistant", "content": "y"}]}',
    # Poison rows that used to stop the whole extraction on every run:
    b'{"messages": [{"role": "user", "content": "x\\ud800y"}, {"role": "assistant", "content": "y"}]}',
    b"[" * 100_000 + b"]" * 100_000,
]


@pytest.fixture(scope="module")
def source(conversations, tmp_path_factory):
    """The demo conversations with one bad row of each class spliced in."""
    lines = conversations.read_bytes().splitlines()
    for i, bad in enumerate(BAD):
        lines.insert(3 + 7 * i, bad)
    p = tmp_path_factory.mktemp("src") / "mixed.jsonl"
    p.write_bytes(b"\n".join(lines) + b"\n")
    return p, len(lines)


def write_config(tmp_path, tiny_target, source, out, address=None, rows_per_shard=8) -> Path:
    cfg = {
        "target": {"path": str(tiny_target)},
        "source": {"uri": str(source)},
        "output": {"uri": str(out), "rows_per_shard": rows_per_shard},
        "capture": ["layer_output:1", "layer_output:2", "layer_output:3", "final:post_norm"],
        "max_length": 128,
        "engine": {"dtype": "float32", "device": "cpu"},
        "ray": {"num_actors": 1, "cpus_per_actor": 1, "address": address},
    }
    p = tmp_path / "extract.yaml"
    p.write_text(json.dumps(cfg))  # JSON is YAML
    return p


def test_extract_on_ray_reconciles_and_quarantines(ray_connected, tiny_target, source, tmp_path, capsys):
    src, nrows = source
    cfg_path = write_config(tmp_path, tiny_target, src, tmp_path / "ds", ray_connected["address"])
    from schemas.config import load_config

    cfg = load_config(cfg_path, ExtractConfig)
    m = run_extract(cfg, progress=False)
    assert m.totals.input_rows == nrows == m.totals.rows + m.totals.quarantined
    assert m.totals.quarantined == len(BAD)
    q = [json.loads(x) for x in (tmp_path / "ds" / "quarantine.jsonl").read_text().splitlines()]
    assert sorted(x["source_row"] for x in q) == [3 + 7 * i for i in range(len(BAD))]
    reasons = sorted(x["reason"] for x in q)
    for want in (
        "malformed JSON",
        "turn 0: unknown role 'robot'",
        "no assistant turn",
        "turn 0: empty content",
        "invalid UTF-8",
        "turn 0: content contains \\ud800, a lone surrogate",
        "JSON nested deeper",
    ):
        assert any(r.startswith(want) for r in reasons), (want, reasons)
    r = DatasetReader(cfg.output.uri)
    ids = [s.sample_id for s in r.iter_samples()]
    assert len(ids) == len(set(ids)) == m.totals.rows
    assert not (tmp_path / "ds" / "_tmp").exists()
    deep = next(x for x in q if x["reason"].startswith("JSON nested deeper"))  # capped, hashed
    assert deep["bytes"] == 200_000 and len(deep["line"]) == 4096 and deep["truncated"] and len(deep["sha256"]) == 64
    # Where the time went: the job's stages are disjoint parts of its total; every unit with rows
    # was tokenized and captured; the one capture actor's start is charged to exactly one unit.
    stages = {k: v for k, v in m.seconds.items() if k != "total"}
    assert set(stages) == {"target_identity", "source_scan", "ray_start", "capture", "manifest", "fingerprints"}
    assert 0 < sum(stages.values()) <= m.seconds["total"]
    written = [s for s in m.shards if s.path]
    assert all(s.seconds["tokenize"] > 0 and s.seconds["forward"] > 0 and s.seconds["commit"] > 0 for s in written)
    assert sum("engine_start" in s.seconds for s in m.shards) == 1
    assert m.unit_seconds()["forward"] == pytest.approx(sum(s.seconds["forward"] for s in written))
    assert "where the time went" not in capsys.readouterr().out  # a log line, not stdout
    # Re-running a finished job is a no-op that returns the same dataset.
    assert run_extract(cfg, progress=False).dataset_id == m.dataset_id
    # strata inspect: provenance per column, shard table, totals.
    assert strata(["inspect", cfg.output.uri]) == 0
    out = capsys.readouterr().out
    assert "layer_output:2" in out and "r_3" in out and "hf_hidden_states_index" in out
    assert f"input {nrows} = written {m.totals.rows} + quarantined {len(BAD)}" in out
    assert strata(["inspect", cfg.output.uri, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dataset_id"] == m.dataset_id


def test_resume_ignores_and_removes_a_torn_commit_record(tiny_target, source, tmp_path):
    """A writer killed while publishing a unit record leaves a temp sibling: it is no commit."""
    from pipeline.extract.job import ExtractionError
    from schemas.config import load_config

    src, nrows = source
    cfg = load_config(write_config(tmp_path, tiny_target, src, tmp_path / "ds"), ExtractConfig)
    first = run_extract(cfg, progress=False, use_ray=False)
    units = tmp_path / "ds" / "_units"
    # The state of a run killed while committing unit 0: no manifest, unit 0's record half-written.
    (tmp_path / "ds" / "manifest.json").unlink()
    (units / "unit-00000.json").unlink()
    torn = units / ".unit-00000.json.tmp-dead"
    torn.write_bytes(b'{"unit": 0, "sha')
    again = run_extract(cfg, progress=False, use_ray=False)
    assert again.dataset_id == first.dataset_id and again.totals.input_rows == nrows and not torn.exists()
    assert (units / "unit-00000.json").exists()
    (tmp_path / "ds" / "manifest.json").unlink()
    (units / "unit-00099.json").write_bytes(b"not a record")
    with pytest.raises(ExtractionError, match=r"unit-00099.json: unreadable commit record"):
        run_extract(cfg, progress=False, use_ray=False)


def run_job(cfg_path, env_extra, cluster):
    env = {**os.environ, **cluster["env"], "RAY_ADDRESS": cluster["address"], **env_extra}
    return subprocess.run(
        [sys.executable, "jobs/extract.py", "--config", str(cfg_path), "--no-progress"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_resume_after_crash_is_exactly_once(ray_cluster, tiny_target, source, tmp_path):
    """The driver SIGKILLed (like a lost head node) once two units are committed; the cluster and
    its actors stay up."""
    import signal
    import time

    src, nrows = source
    out = tmp_path / "ds"
    cfg_path = write_config(tmp_path, tiny_target, src, out, rows_per_shard=4)
    env = {**os.environ, **ray_cluster["env"], "RAY_ADDRESS": ray_cluster["address"]}
    driver = subprocess.Popen(
        [sys.executable, "jobs/extract.py", "--config", str(cfg_path), "--no-progress"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while len(list((out / "_units").glob("unit-*.json"))) < 2 and driver.poll() is None:
        assert time.monotonic() < deadline, "no unit was committed in time"
        time.sleep(0.02)
    driver.send_signal(signal.SIGKILL)
    assert driver.wait(30) == -signal.SIGKILL, driver.stderr.read()[-3000:]
    assert not (out / "manifest.json").exists()
    committed = sorted((out / "_units").glob("unit-*.json"))
    assert 2 <= len(committed) < -(-nrows // 4)
    # Shards of units committed at the kill, with their mtime: a rewrite, even of equal bytes, shows.
    before = {
        p.name: (p.read_bytes(), p.stat().st_mtime_ns)
        for p in (out / "shards").glob("*.parquet")
        if (out / "_units" / p.name.replace("part", "unit").replace(".parquet", ".json")) in committed
    }

    resumed = run_job(cfg_path, {}, ray_cluster)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # A dead driver's capture actors may still commit the unit in hand while Ray reaps them, so
    # the resumed run can find more than we counted - never fewer, and it extracts only the rest.
    found = re.search(r"rows in (\d+) units; (\d+) already committed, (\d+) to extract", resumed.stderr)
    assert found, resumed.stderr[-3000:]
    units, skipped, extracted = map(int, found.groups())
    assert units == -(-nrows // 4) and skipped + extracted == units and skipped >= len(committed)
    assert before
    for name, (data, mtime) in before.items():  # committed shards were skipped, not rewritten
        assert (out / "shards" / name).read_bytes() == data and (out / "shards" / name).stat().st_mtime_ns == mtime
    r = DatasetReader(str(out))
    rows = [s.sample_id for s in r.iter_samples()]
    q = (out / "quarantine.jsonl").read_text().splitlines()
    assert len(rows) == len(set(rows)) and len(rows) + len(q) == nrows
    m = r.manifest
    covered = sorted(x for s in m.shards for x in range(*s.source_rows))
    assert covered == list(range(nrows))


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda c: c.update(capture=["layer_output:5", "final:pre_norm"]), "name the same tensor (r_6)"),
        (
            lambda c: (c["engine"].update(name="sglang"), c.update(capture=["layer_output:1", "final:pre_norm"])),
            "engine sglang cannot capture final:pre_norm, the pre-norm final state (r_6), on this target",
        ),
    ],
)
def test_plans_that_would_fail_later_are_refused_up_front(tiny_target, source, tmp_path, edit, needle):
    from pipeline.extract.job import ExtractionError
    from schemas.config import validate_config

    raw = json.loads(write_config(tmp_path, tiny_target, source[0], tmp_path / "ds").read_text())
    raw["capture"] = ["embedding", "layer_output:1"]
    edit(raw)
    with pytest.raises(ExtractionError, match=re.escape(needle)):
        run_extract(validate_config(raw, ExtractConfig), progress=False, use_ray=False)
    assert not (tmp_path / "ds").exists()  # refused before anything was written


def test_empty_source_and_missing_chat_template_are_refused(tiny_target, tmp_path):
    import shutil

    from pipeline.extract.job import ExtractionError
    from schemas.config import load_config

    (tmp_path / "empty.jsonl").write_bytes(b"")
    cfg = load_config(write_config(tmp_path, tiny_target, tmp_path / "empty.jsonl", tmp_path / "ds"), ExtractConfig)
    with pytest.raises(ExtractionError, match="has no rows: nothing to extract"):
        run_extract(cfg, progress=False, use_ray=False)
    bare = tmp_path / "bare-target"
    shutil.copytree(tiny_target, bare)
    for f in bare.glob("chat_template*"):
        f.unlink()
    tok_cfg = bare / "tokenizer_config.json"
    tok_cfg.write_text(json.dumps({k: v for k, v in json.loads(tok_cfg.read_text()).items() if k != "chat_template"}))
    cfg = cfg.model_copy(update={"target": cfg.target.model_copy(update={"path": str(bare)})})
    with pytest.raises(ExtractionError, match="has no chat template"):
        run_extract(cfg, progress=False, use_ray=False)


def test_a_second_job_on_the_same_output_refuses_and_rows_stay_exactly_once(tiny_target, source, tmp_path):
    import threading

    from pipeline.extract.job import ExtractionError
    from pipeline.store.lease import Lease
    from pipeline.store.objects import LocalStore
    from schemas.config import load_config

    src, nrows = source
    cfg = load_config(write_config(tmp_path, tiny_target, src, tmp_path / "ds"), ExtractConfig)
    with Lease(LocalStore(tmp_path / "ds"), "extract", ttl_s=60):  # a job that is running
        with pytest.raises(ExtractionError, match="is being extracted by .*wait for it"):
            run_extract(cfg, progress=False, use_ray=False)
    # Two jobs started at once: one extracts; the other refuses, or finds the finished dataset.
    results: dict[int, object] = {}
    barrier = threading.Barrier(2)

    def job(i):
        barrier.wait()
        try:
            results[i] = run_extract(cfg, progress=False, use_ray=False)
        except ExtractionError as e:
            results[i] = e

    threads = [threading.Thread(target=job, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    done = [r for r in results.values() if not isinstance(r, Exception)]
    assert len(results) == 2 and done, results
    assert all("is being extracted by" in str(r) for r in results.values() if isinstance(r, Exception))
    ids = [s.sample_id for s in DatasetReader(cfg.output.uri).iter_samples()]
    assert len(ids) == len(set(ids)) == done[0].totals.rows and done[0].totals.input_rows == nrows
    assert not (tmp_path / "ds" / "leases" / "extract.json").exists()  # released


@pytest.mark.parametrize("delay", [0.0, 0.7])
def test_killing_the_whole_process_tree_during_commits_loses_and_duplicates_nothing(
    tiny_target, source, tmp_path, delay
):
    """`python jobs/extract.py` with its own local Ray: once units start committing, SIGKILL the
    driver and every process under it (GCS, raylet, workers) at once; the rerun finishes with
    every source row exactly once and the shards committed before the kill untouched."""
    import signal
    import time

    import psutil

    src, nrows = source
    out = tmp_path / "ds"
    cfg_path = write_config(tmp_path, tiny_target, src, out)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, "jobs/extract.py", "--config", str(cfg_path), "--no-progress"]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    deadline = time.monotonic() + 300
    while not list((out / "_units").glob("unit-*.json")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(delay)
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in tree:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait(30)
    psutil.wait_procs(tree, timeout=30)
    # (bytes, mtime) of every shard committed before the kill: a rewrite, even of equal bytes, shows
    before = {
        p.name: (p.read_bytes(), p.stat().st_mtime_ns)
        for p in (out / "shards").glob("*.parquet")
        if (out / "_units" / p.name.replace("part", "unit").replace(".parquet", ".json")).exists()
    }
    assert before, "the kill came before any unit was committed"
    resumed = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    r = DatasetReader(str(out))
    r.verify_all()
    rows = [s.sample_id for s in r.iter_samples()]
    q = (out / "quarantine.jsonl").read_text().splitlines()
    assert len(rows) == len(set(rows)) and len(rows) + len(q) == nrows
    for name, (data, mtime) in before.items():
        assert (out / "shards" / name).read_bytes() == data and (out / "shards" / name).stat().st_mtime_ns == mtime


def test_killing_a_capture_actor_mid_run_loses_and_duplicates_nothing(ray_connected, tiny_target, source, tmp_path):
    """SIGKILL the process of a live capture actor once units commit: Ray restarts it and retries
    its units, or the job fails; either way, after at most one rerun every source row is written exactly once."""
    import signal
    import threading
    import time

    from ray.util.state import list_actors

    from schemas.config import load_config

    src, nrows = source
    out = tmp_path / "ds"
    cfg = load_config(write_config(tmp_path, tiny_target, src, out, ray_connected["address"]), ExtractConfig)
    result: dict = {}

    def run():
        try:
            result["m"] = run_extract(cfg, progress=False)
        except Exception as e:  # the kill may fail the job; the rerun must fix it
            result["error"] = e

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 300
    victim = None
    while victim is None and time.monotonic() < deadline and t.is_alive():
        if list((out / "_units").glob("unit-*.json")):
            alive = [
                a
                for a in list_actors(filters=[("state", "=", "ALIVE")])
                if "CaptureActor" in (a.class_name or "") and a.pid
            ]
            victim = alive[0].pid if alive else None
        time.sleep(0.05)
    assert victim, "no live capture actor was found while units were committing"
    os.kill(victim, signal.SIGKILL)
    t.join(600)
    if "error" in result:
        result["m"] = run_extract(cfg, progress=False)
    m = result["m"]
    r = DatasetReader(str(out))
    r.verify_all()
    rows = [s.sample_id for s in r.iter_samples()]
    assert len(rows) == len(set(rows)) == m.totals.rows and m.totals.rows + m.totals.quarantined == nrows


@pytest.mark.ray
def test_a_plan_the_cluster_cannot_run_is_refused_not_left_hanging(ray_connected, tiny_target, source, tmp_path):
    """A capture actor that needs more CPUs than the cluster has would be queued by Ray forever.
    Refused in one line, before anything is written."""
    import ray

    from pipeline.errors import UnusableInput
    from schemas.config import validate_config

    raw = json.loads(write_config(tmp_path, tiny_target, source[0], tmp_path / "ds").read_text())
    # A cluster the job was submitted to may autoscale: the job asks for the actors and waits
    # (2 s here) before refusing.
    raw["ray"] = {"cpus_per_actor": ray.cluster_resources()["CPU"] + 1, "resource_wait_s": 2}
    with pytest.raises(
        UnusableInput,
        match=r"capture actors x cpus_per_actor .* but the Ray cluster has .* after "
        r"waiting 2 s for the autoscaler: lower ray",
    ):
        run_extract(validate_config(raw, ExtractConfig), progress=False)
    assert not (tmp_path / "ds").exists()


@pytest.mark.ray
def test_the_job_process_leaves_torch_and_transformers_to_the_capture_actors(
    ray_connected, tiny_target, source, tmp_path
):
    """Importing them costs the CLI's process seconds before Ray even starts; everything that
    computes (tokenizer, engine, fingerprints) runs in the capture actors. A whole extraction in
    a fresh process, fingerprints included, must end without either module loaded there."""
    src, nrows = source
    cfg_path = write_config(tmp_path, tiny_target, src, tmp_path / "ds", ray_connected["address"])
    script = (
        "import json, sys\nfrom pipeline.cli import main\n"
        f"code = main(['extract', '--config', {str(cfg_path)!r}, '--no-progress'])\n"
        "print(json.dumps({'code': code, 'loaded': sorted(m for m in ('torch', 'transformers') "
        "if m in sys.modules)}))"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=ray_connected["env"], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {"code": 0, "loaded": []}, run.stderr[-3000:]
    m = DatasetReader(str(tmp_path / "ds")).manifest
    assert m.fingerprints and m.fingerprints["probe_samples"] > 0
    assert m.totals.rows + m.totals.quarantined == nrows and m.software["torch"] and m.software["transformers"]


def test_a_job_that_stops_progressing_fails_instead_of_waiting_forever(tiny_target, source, tmp_path):
    """Ray queues work it cannot schedule without a word; the job gives up after
    ray.stall_timeout_s without a committed unit (here shorter than starting the capture actor)
    and says what to do, exit 1, with nothing published."""
    src, _ = source
    cfg_path = write_config(tmp_path, tiny_target, src, tmp_path / "ds")
    cfg = json.loads(cfg_path.read_text())
    cfg["ray"]["stall_timeout_s"] = 0.5
    cfg_path.write_text(json.dumps(cfg))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    run = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "extract", "--config", str(cfg_path), "--no-progress"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 1, run.stderr[-3000:]
    assert "nothing finished in 0.5 s" in run.stderr and "ray.stall_timeout_s" in run.stderr, run.stderr[-3000:]
    assert not (tmp_path / "ds" / "manifest.json").exists()


def test_the_worker_modules_imports_count_in_the_engine_start_not_in_ray(tiny_target, source, tmp_path):
    """The capture actor imports torch with the worker module: a job's breakdown counts those
    seconds in the engine's start (the bare script pays them too), not in Ray's share."""
    from pipeline.extract.job import build_schema
    from pipeline.extract.worker import CaptureWorker
    from pipeline.identity import target_identity
    from schemas.config import load_config
    from schemas.manifest import ShardRecord

    src, _ = source
    cfg = load_config(write_config(tmp_path, tiny_target, src, tmp_path / "ds"), ExtractConfig)
    schema, _ = build_schema(cfg, target_identity(cfg.target.path, cfg.target.name, cfg.target.revision))
    rows = Path(src).read_bytes().splitlines()[:4]
    worker = CaptureWorker(cfg.model_dump_json(), schema, in_ray=False, imports_s=7.0)
    try:
        first = ShardRecord.model_validate_json(worker.process(0, 0, rows))
        second = ShardRecord.model_validate_json(worker.process(1, 4, rows))
    finally:
        worker.close()
    assert first.seconds["engine_start"] >= 7.0 and "engine_start" not in second.seconds
