"""The extraction job a user runs, next to a bare-forward script over the same conversations.

A: ``python -m pipeline.cli extract --config ...`` in a fresh process (imports, target hashing,
   Ray start, actor start, model load, tokenize, capture, write, manifest, fingerprints);
   and the same with ``--no-ray`` (one engine in the CLI's process).
B: a plain script a user would write without Strata: import torch and transformers, load the
   target, apply the chat template, run the decoder stack over each conversation alone (no
   padding) -- no Ray, nothing written.

Runs alternate A, B, A --no-ray, ... at the full size (min/median/max and the machine's load are
saved), then once each at smaller sizes for the wall-time-vs-dataset-size curve, whose
intercept is the fixed cost and whose slope is the per-token cost. The job's own breakdown
(the manifest's per-stage seconds) says where its time went.

    python tests/benchmarks/bench_extract_job.py                 # mid size: hidden 1024, 8 layers, vocab 32K
    python tests/benchmarks/bench_extract_job.py --engine vllm --sizes 50 --repeats 1  # vLLM, incl. its start
    python tests/benchmarks/bench_extract_job.py --shape tiny --sizes 10,20 --repeats 1   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

from _results import save_result  # noqa: E402
from bench_extract import SHAPES, build_target  # noqa: E402

BARE_SCRIPT = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
target, conversations = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).eval()
tok = AutoTokenizer.from_pretrained(target)
t1 = time.perf_counter()
ids = [tok.apply_chat_template(json.loads(line)["messages"], tokenize=True, return_dict=False)
       for line in open(conversations)]
ids = [x["input_ids"] if isinstance(x, dict) else x for x in ids]
t2 = time.perf_counter()
with torch.inference_mode():
    for seq in ids:
        model.model(input_ids=torch.tensor([seq]), use_cache=False)
t3 = time.perf_counter()
print(json.dumps({"import_and_load_s": t1 - t0, "tokenize_s": t2 - t1, "forward_s": t3 - t2,
                  "tokens": sum(map(len, ids)), "threads": torch.get_num_threads()}))
"""


def job_config(target: Path, conversations: Path, out: Path, cpus: int, engine: str = "hf") -> dict:
    """One capture actor holding every CPU (it tokenizes its own units). vLLM captures the
    residual stream only: its fourth point is the pre-norm final state."""
    final = "final:post_norm" if engine == "hf" else "final:pre_norm"
    return {
        "target": {"path": str(target)},
        "source": {"uri": str(conversations)},
        "output": {"uri": str(out)},
        "capture": ["layer_output:1", "layer_output:3", "layer_output:4", final],
        "engine": {"name": engine, "dtype": "bfloat16", "device": "cpu"},
        "ray": {"num_actors": 1, "cpus_per_actor": cpus},
    }


def run_cli(command: str, cfg: dict, work: Path, *flags: str) -> float:
    """``strata <command> --config <cfg> <flags>`` in a fresh process with its own local Ray
    (what a user pays, imports to exit); its wall seconds."""
    import yaml

    path = work / f"{command}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    t0 = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", command, "--config", str(path), *flags],
        cwd=ROOT,
        env={**os.environ, "RAY_ADDRESS": ""},
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if run.returncode:
        raise SystemExit(f"strata {command} failed ({run.returncode}):\n{run.stderr[-4000:]}")
    return time.perf_counter() - t0


def run_job(cfg: dict, work: Path, ray: bool = True) -> dict:
    wall = run_cli("extract", cfg, work, "--no-progress", *(() if ray else ("--no-ray",)))
    from schemas.manifest import DatasetManifest

    m = DatasetManifest.model_validate_json((Path(cfg["output"]["uri"]) / "manifest.json").read_text())
    units = m.unit_seconds()
    s = m.seconds
    # The capture actor's critical path (engine_start includes the worker module's imports, torch
    # among them); what else the capture stage took is Ray's (the actor's process start with
    # Ray's own imports, scheduling, object transfers).
    actor = sum(
        units.get(k, 0.0) for k in ("engine_start", "tokenize", "forward", "byte_split", "writer_wait", "commit")
    )
    return {
        "wall_s": wall,
        "tokens": m.totals.tokens,
        "bytes": m.totals.bytes,
        "job_stages_s": s,
        "unit_stages_summed_s": {k: round(v, 4) for k, v in units.items()},
        "process_start_and_imports_s": wall - s["total"],
        "ray_overhead_s": s["capture"] - actor if ray else None,
    }


def run_script(argv: list[str], what: str, timeout: float) -> dict:
    """A baseline script in a fresh process, timed from outside: its wall seconds and the JSON
    object its last line of stdout prints."""
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if run.returncode:
        raise SystemExit(f"{what} failed ({run.returncode}):\n{run.stderr[-4000:]}")
    return {"wall_s": wall, **json.loads(run.stdout.strip().splitlines()[-1])}


def run_bare(target: Path, conversations: Path) -> dict:
    return run_script(["-c", BARE_SCRIPT, str(target), str(conversations)], "bare-forward script", 1800)


def spread(xs: list[float]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "runs": xs}


def fit(points: list[tuple[float, float]]) -> dict:
    """Least-squares wall = fixed + per_token * tokens."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return {"fixed_s": my - slope * mx, "per_1k_tokens_s": slope * 1000}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="mid")
    ap.add_argument("--conversations", type=int, default=200)
    ap.add_argument("--sizes", default="50,100", help="smaller dataset sizes for the scaling curve")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    ap.add_argument("--work", default=None, help="directory for the target (cached) and outputs")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from pipeline.data.stdlib import write_conversations

    work = Path(a.work or Path(tempfile.gettempdir()) / "strata-bench-extract-job")
    work.mkdir(parents=True, exist_ok=True)
    target = build_target(a.shape, work)
    cpus = os.cpu_count() or 2
    sizes = sorted({*(int(x) for x in a.sizes.split(",") if x), a.conversations})
    convs = {}
    for n in sizes:
        convs[n] = work / f"conversations-{n}.jsonl"
        write_conversations(convs[n], n)

    def job(n: int, tag: str, ray: bool = True) -> dict:
        out = Path(tempfile.mkdtemp(prefix=f"ds-{tag}-", dir=work)) / "ds"
        return run_job(job_config(target, convs[n], out, cpus, a.engine), work, ray)

    load_before = os.getloadavg()
    jobs, bares, local = [], [], []
    for r in range(a.repeats):  # alternated, so drift in the machine hits all alike
        jobs.append(job(a.conversations, f"r{r}"))
        bares.append(run_bare(target, convs[a.conversations]))
        local.append(job(a.conversations, f"l{r}", ray=False))
        print(
            f"repeat {r}: job {jobs[-1]['wall_s']:.1f}s, bare script {bares[-1]['wall_s']:.1f}s, "
            f"job --no-ray {local[-1]['wall_s']:.1f}s",
            flush=True,
        )
    curve = [
        {"conversations": a.conversations, "tokens": j["tokens"], "job_wall_s": j["wall_s"], "bare_wall_s": b["wall_s"]}
        for j, b in zip(jobs, bares, strict=True)
    ]
    for n in sizes:
        if n != a.conversations:
            j, b = job(n, f"n{n}"), run_bare(target, convs[n])
            curve.append(
                {"conversations": n, "tokens": j["tokens"], "job_wall_s": j["wall_s"], "bare_wall_s": b["wall_s"]}
            )
    load_after = os.getloadavg()

    best = min(jobs, key=lambda j: j["wall_s"])
    by_size = {n: [c for c in curve if c["conversations"] == n] for n in sizes}  # one point per size: the median
    job_fit = fit([(cs[0]["tokens"], statistics.median(c["job_wall_s"] for c in cs)) for cs in by_size.values()])
    bare_fit = fit([(cs[0]["tokens"], statistics.median(c["bare_wall_s"] for c in cs)) for cs in by_size.values()])
    capture = [j["job_stages_s"]["capture"] for j in jobs]
    forward = [b["forward_s"] for b in bares]
    result = {
        "benchmark": "extract_job",
        "engine": a.engine,
        "host": platform.node(),
        "cpu_count": cpus,
        "shape": a.shape,
        "model": SHAPES[a.shape],
        "dtype": "bfloat16",
        "conversations": a.conversations,
        "tokens": best["tokens"],
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "job_wall_s": spread([j["wall_s"] for j in jobs]),
        "job_no_ray_wall_s": spread([j["wall_s"] for j in local]),
        "bare_script_wall_s": spread([b["wall_s"] for b in bares]),
        "bare_forward_s": spread(forward),
        "job_capture_stage_s": spread(capture),
        "ratios": {
            # what a user pays: bare script wall / job wall (both from process start)
            "whole_job_over_bare_script": statistics.median(b["wall_s"] for b in bares)
            / statistics.median(j["wall_s"] for j in jobs),
            "whole_job_no_ray_over_bare_script": statistics.median(b["wall_s"] for b in bares)
            / statistics.median(j["wall_s"] for j in local),
            # keeps up with its target: the job's capture stage (capture + write + commit, with Ray)
            # against the bare script's forward loop, same tokens
            "capture_stage_over_bare_forward": statistics.median(forward) / statistics.median(capture),
            # per-token cost from the scaling curve: fixed costs cancel
            "marginal_job_over_bare": bare_fit["per_1k_tokens_s"] / job_fit["per_1k_tokens_s"]
            if job_fit["per_1k_tokens_s"] > 0
            else None,
        },
        "fixed_costs_s": {
            "process_start_and_imports": best["process_start_and_imports_s"],
            **{k: v for k, v in best["job_stages_s"].items() if k not in ("capture", "total")},
            "engine_start": best["unit_stages_summed_s"].get("engine_start", 0.0),
            "ray_overhead_in_capture": best["ray_overhead_s"],
            "bare_script_import_and_load": min(b["import_and_load_s"] for b in bares),
        },
        "scaling_curve": sorted(curve, key=lambda c: c["conversations"]),
        "fit_job": job_fit,
        "fit_bare_script": bare_fit,
        "breakdown_best_job": {k: best[k] for k in ("job_stages_s", "unit_stages_summed_s")},
        "breakdown_best_job_no_ray": {
            k: min(local, key=lambda j: j["wall_s"])[k] for k in ("job_stages_s", "unit_stages_summed_s")
        },
        "note": "job: python -m pipeline.cli extract with the engine named above, one capture actor holding every CPU, "
        "tokenizing its own units, "
        "4 capture points, zstd byte planes, fsync + atomic publish, manifest and 16 probe fingerprints. "
        "bare: plain HF script, one conversation per forward (no padding), nothing written. "
        "unit stages are summed over units and run concurrently (writer threads), so they can exceed "
        "the capture stage's wall time.",
    }
    save_result(result, f"extract_job_{a.shape}_{a.engine}_cpu.json", a.out)


if __name__ == "__main__":
    main()
