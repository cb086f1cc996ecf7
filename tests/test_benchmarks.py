"""Benchmarks that must keep working: the GPU benchmark (extraction, the draft step, packing,
streaming vs extract-then-train; exercised on the CPU at tiny sizes, in a Python where Ray,
DeepSpeed, vLLM, zstandard and pydantic cannot be imported: a GPU box may have only torch,
transformers and pyarrow), the whole-job extraction benchmark, and the row-group layouts' reads."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent / "benchmarks" / "bench_gpu.py"
BLOCK = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"ray", "deepspeed", "vllm", "zstandard", "pydantic", "schemas"}:
            raise ModuleNotFoundError(f"{name} is not on this GPU box")
sys.meta_path.insert(0, Block())
sys.argv = sys.argv[1:]
sys.path.insert(0, sys.argv[0].rsplit("/", 1)[0])
exec(compile(open(sys.argv[0]).read(), sys.argv[0], "exec"), {"__name__": "__main__", "__file__": sys.argv[0]})
"""


def run_benchmark(script: str, *args: str, out: Path, timeout: int = 900) -> dict:
    """Run ``tests/benchmarks/<script>`` with ``args`` in a fresh process; the JSON it saved to ``out``."""
    run = subprocess.run(
        [sys.executable, str(Path(__file__).resolve().parent / "benchmarks" / script), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


def test_gpu_benchmark_needs_only_torch_transformers_pyarrow(tmp_path):
    out = tmp_path / "gpu.json"
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            BLOCK,
            str(BENCH),
            "--shape",
            "tiny",
            "--device",
            "cpu",
            "--repeats",
            "1",
            "--steps",
            "1",
            "--ttt",
            "2",
            "--writers",
            "2",
            "--dtype",
            "float32",
            "--epochs",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(out.read_text())
    ex = r["extraction"]
    assert ex["batches"] > 1 and ex["written_bytes_last_run"] > 0
    # The shards hold every captured byte: 4 points x 4 bytes (fp32 here) x H per real token,
    # less what zstd saves on the exponent planes.
    assert ex["written_bytes_last_run"] <= ex["real_tokens"] * 4 * 4 * 64
    assert set(ex["tokens_per_s"]) == {"bare_forward", "capture"} and r["draft_step"]["ttt"] == 2
    # packing: the demo's lengths planned as training plans them, both layouts timed
    for dist in ("demo", "chat"):
        pk = r["packing"][dist]
        assert set(pk["real_tokens_per_s"]) == {"padded", "packed"} and pk["packed_over_padded"] > 0
        assert pk["steps_per_epoch"]["packed"] <= pk["steps_per_epoch"]["padded"]
    assert r["packing"]["demo"]["padding_fraction_padded"] > 0
    # streaming vs extract-then-train: only the offline mode writes, both train every planned step
    # on the same samples (the drafts differ by float summation order alone)
    st = r["stream"]
    (streamed,), (offline,) = st["runs"]["streamed"], st["runs"]["offline"]
    assert streamed["bytes_written"] == 0 < offline["bytes_written"] == st["offline_bytes_written"]
    assert offline["bytes_written"] <= st["real_tokens_trained"] * 4 * 4 * 64 + 65536  # one epoch; + Parquet's own
    assert st["steps"] > 1 and offline["extract_s"] + offline["train_s"] == offline["wall_s"]
    assert 0 <= st["draft_rel_diff"] < 1e-2 and streamed["peak_host_rss_gb"] > 0
    # stamped with what it measured: this checkout's commit (this is a git clone) and the date
    import datetime

    stamp = r["measured_at"]
    head = subprocess.run(
        ["git", "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True, cwd=BENCH.parent
    ).stdout.strip()
    assert stamp["commit"].split("+")[0] == head and stamp["date"] == datetime.date.today().isoformat()


def test_extract_job_benchmark_times_the_cli_job_against_a_bare_script(tmp_path):
    """Tiny sizes: what the JSON must hold, not how fast anything is."""
    r = run_benchmark(
        "bench_extract_job.py",
        *("--shape", "tiny", "--conversations", "16", "--sizes", "8", "--repeats", "1"),
        *("--work", str(tmp_path / "work")),
        out=tmp_path / "job.json",
    )
    curve = r["scaling_curve"]
    assert [c["conversations"] for c in curve] == [8, 16] and curve[0]["tokens"] < curve[1]["tokens"]
    assert all(c["job_wall_s"] > 0 and c["bare_wall_s"] > 0 for c in curve)
    fixed = r["fixed_costs_s"]
    assert fixed["ray_start"] > 0 and fixed["engine_start"] > 0 and fixed["process_start_and_imports"] > 0
    units = r["breakdown_best_job"]["unit_stages_summed_s"]
    assert {"tokenize", "forward", "byte_split", "compress", "hash", "write", "commit"} <= set(units)
    assert r["tokens"] == curve[1]["tokens"] and 0 < r["ratios"]["whole_job_over_bare_script"]
    no_ray = r["breakdown_best_job_no_ray"]["job_stages_s"]
    assert "ray_start" not in no_ray and no_ray["capture"] > 0 and r["ratios"]["whole_job_no_ray_over_bare_script"] > 0


def test_train_job_benchmark_times_the_cli_job_against_the_plain_loop(tmp_path):
    """Tiny sizes: the job (worker loading; ray_data loading runs in test_multinode), the plain loop
    and DeepSpeed alone, and the job's windows; not how fast anything is."""
    r = run_benchmark(
        "bench_train_job.py",
        *("--shape", "tiny", "--conversations", "40", "--steps", "8", "--repeats", "1", "--loadings", "worker"),
        *("--work", str(tmp_path / "work"), "--profile-cpu"),
        out=tmp_path / "train.json",
    )
    (w,) = r["job_windows"]
    (plain_run,) = r["plain_process_runs"]
    for run in (w, plain_run):  # tiny steps may be too short for a busy interval: the profile's shape only
        assert set(run["cpu_while_training"]) >= {"seconds", "cores"}
    assert w["steps"] == 8 and w["tokens_per_s"] > 0 and 0 <= w["data_wait_fraction"] < 1
    assert "job_ray_data_loading_windows" not in r  # not asked for
    assert r["plain_tokens_per_s"]["min"] > 0 and r["deepspeed_tokens_per_s"]["min"] > 0
    assert set(r["ratios"]) >= {
        "job_over_plain",
        "job_over_plain_process",
        "deepspeed_over_plain",
        "plain_compute_over_job_wall",
    }
    # the plain loop as a process of its own, and each run's fixed cost (wall minus its steps at its steady rate)
    (p,) = r["plain_process_fixed_s"]["runs"]
    assert 0 < p < r["plain_process_wall_s"]["min"] and 0 < r["job_fixed_s"]["min"] < r["job_wall_s"]["min"]
    assert r["ratios"]["job_fixed_beyond_plain_process_s"] == r["job_fixed_s"]["median"] - p
    # and without a steady rate: the wall minus the seconds inside the steps (the windows cover them all)
    for run in (w, plain_run):
        assert 0 < run["steps_s"] < run["wall_s"] and run["outside_steps_s"] == run["wall_s"] - run["steps_s"]
    assert r["ratios"]["job_outside_steps_beyond_plain_process_s"] == (
        w["outside_steps_s"] - plain_run["outside_steps_s"]
    )
    assert w["timing"]["fit_parts"]["steps"] > 0 and {"ray_start", "prepare", "fit", "total"} <= set(w["timing"])


def test_stream_benchmark_times_streaming_against_extract_then_train(tmp_path):
    """Tiny sizes: both runs finish, the streaming run stores only its held-out samples, and every
    process role's memory is sampled; not how fast anything is. (The cached run C is left out here:
    what a cache stores and reads is test_stream's.)"""
    r = run_benchmark(
        "bench_stream.py",
        *("--shape", "tiny", "--conversations", "40", "--repeats", "1", "--work", str(tmp_path / "work")),
        "--no-cached",
        out=tmp_path / "stream.json",
    )
    assert set(r["wall_s"]) == {"offline", "streaming"}
    assert r["wall_s"]["offline"]["min"] > 0 and r["wall_s"]["streaming"]["min"] > 0
    assert 0 < r["data_bytes"]["streaming"] < r["data_bytes"]["offline"] / 2  # 8 probe samples of 40
    assert set(r["peak_rss_bytes"]["streaming"]) >= {"driver", "capture_actor", "training_worker"}
    assert set(r["peak_rss_bytes"]["offline_extract"]) >= {"driver", "capture_actor"}
    assert "capture_actor" not in r["peak_rss_bytes"]["offline_train"]
    assert r["peak_total_rss_bytes"]["streaming"] >= r["peak_rss_bytes"]["streaming"]["training_worker"]


def test_reads_benchmark_compares_the_row_group_layouts_on_one_plan(tmp_path):
    """Small sizes: both layouts decode the same plan, and a row group per sample reads fewer
    column-chunk bytes than a row group per forward batch (what a disk or S3 serves); not how fast."""
    r = run_benchmark(
        "bench_reads.py",
        "--conversations",
        "60",
        "--repeats",
        "1",
        "--work",
        str(tmp_path),
        out=tmp_path / "reads.json",
    )
    (fwd,), (per,) = r["runs"]["per_forward"], r["runs"]["per_sample"]
    assert fwd["samples"] == per["samples"] == 60 and fwd["batches"] == per["batches"] > 1
    assert per["row_groups"] == 60 > fwd["row_groups"]
    assert per["bytes_read"] < fwd["bytes_read"] and r["bytes_read_per_sample_over_per_forward"] < 1


def test_cpu_sampler_attributes_a_busy_process_and_its_threads(tmp_path):
    """The profile bench_train_job.py --profile-cpu records: a child spinning one core for 3 s
    is seen using about one core, on its main thread, and no more cores are used than the machine has."""
    sys.path.insert(0, str(BENCH.parent))
    from _cpu import CpuSampler

    spin = tmp_path / "spin.py"
    spin.write_text("import time\nt = time.perf_counter()\nwhile time.perf_counter() - t < 3: pass\n")
    roles = {"spin.py": "spinner"}
    with CpuSampler(interval=0.5, threads_of="spin.py") as cpu:
        subprocess.run([sys.executable, str(spin)], check=True)
    busy = cpu.busy_phase(roles, "spinner", min_cores=0.5, skip=0.0)
    assert 1.5 <= busy["seconds"] <= 4.0, busy
    assert 0.7 <= busy["cores"]["spinner"] <= 1.1, busy
    assert busy["cores"]["idle"] > -0.1, busy  # nothing counted twice (a renamed kernel thread once was)
    assert busy["threads"]["main"] >= 0.7, busy


def test_demo_probe_benchmark_runs_the_demos_probe_chapter(pretrained_run, pretrained_target, tmp_path):
    """On a stand-in for a finished demo (the shared run trained on r_2, r_6, r_9, stdlib conversations
    as the regenerated ones, the incident's ids in the config): the chapter runs for the draft and its
    random-init copy. The trained draft's answer admits every trained boundary and blocks the incident;
    the random-init copy fits the target worse than its token frequencies and settles nothing."""
    from pipeline import conventions
    from pipeline.data.stdlib import write_conversations
    from schemas.capture import CapturePoint

    demo, art = tmp_path / "demo", pretrained_run / "export" / "vllm"
    demo.mkdir()
    (demo / "target").symlink_to(pretrained_target)
    (demo / "run").symlink_to(pretrained_run)
    cfg = json.loads((pretrained_run / "run.json").read_text())["cfg"]
    (demo / "train.yaml").write_text(json.dumps(cfg))  # JSON is YAML
    write_conversations(demo / "regenerated" / "conversations.jsonl", n=40)
    trained = [CapturePoint.model_validate(p) for p in cfg["aux"]]
    incident = [CapturePoint.parse("embedding"), *trained[:-1]]
    bad = conventions.draft_config_feeding(json.loads((art / "config.json").read_text()), incident, "vllm", 12)
    (demo / "misconfigured-config.json").write_text(json.dumps(bad))
    r = run_benchmark(
        "bench_demo_probe.py",
        *("--demo", str(demo), "--epochs", "0", str(cfg["epochs"]), "--prompts", "16"),
        out=tmp_path / "demo_probe.json",
    )
    assert r["incident_fed"] == ["r_0", "r_2", "r_6"]
    untrained, draft = r["rows"]
    assert (untrained["draft_epochs"], draft["draft_epochs"]) == (0, cfg["epochs"])
    assert untrained["verdict"] == "inconclusive" and untrained["admissible"] is None
    assert untrained["over_frequencies"] < 0 and "settled nothing" in untrained["against_training"]
    assert draft["over_frequencies"] > 0 and draft["admissible"] is not None, draft["chapter"]
    assert all(b in ks for b, ks in zip(["r_2", "r_6", "r_9"], draft["admissible"], strict=True)), draft["admissible"]
    assert "ANOTHER" not in draft["against_training"] and "MISSED" not in draft["against_training"]
    assert draft["chapter"][-2].endswith("strata validate on this directory blocks it") or (
        draft["verdict"] == "inferred"
    ), draft["chapter"]
    assert not (pretrained_run / "run-e0").exists() and (demo / "run-e0").exists()  # the shared run untouched
