"""Probe benchmark (not a test): prints and saves JSON.

For targets of several depths and drafts of several qualities (untrained, briefly trained,
trained), on the EAGLE-3 default aux set: the probe's wall time split into the target's capture
and the candidate search, the search's cost per candidate against the capture's forward pass
(a ratio in the same run), the margin over the runner-up in standard errors, and whether it
recovered the trained set.

Then the statistic's power, on the demo's pretrained target (12 layers): drafts trained on three aux
sets, and where each trained set ranks among *every* ascending set of three boundaries (286) by the
probe's measure (the draft's loss on the assistant tokens) and by greedy agreement over every
position (what the probe weighed before), with the probe's own verdict beside them -- on each draft
handed over as the other tools write it: SpecForge's layout without ids, speculators' with ids off by one.

    python tests/benchmarks/bench_probe.py                       # depths 6 12 61, tiny targets
    python tests/benchmarks/bench_probe.py --depths 6 --epochs 0 1 --conversations 60 --rank-sets 0   # smoke
    python tests/benchmarks/bench_probe.py --rank-sets 0 --out tests/benchmarks/results/probe_depths_cpu.json
    # drafts trained longer, probed on 300 prompts, without ranking all 286 sets (the min_margin data):
    python tests/benchmarks/bench_probe.py --depths --power-epochs 32 --power-prompts 300 --no-rank-all \
        --out tests/benchmarks/results/probe_power_e32_cpu.json
    # the same with three training seeds per set (init and data order): how much the verdict varies
    python tests/benchmarks/bench_probe.py --depths --power-epochs 32 --power-prompts 300 --no-rank-all \
        --power-seeds 0 1 2 --out tests/benchmarks/results/probe_power_seeds_cpu.json
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from _results import save_result  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the other tools' writers
from foreign_drafts import specforge_export, speculators_export  # noqa: E402

from pipeline import conventions  # noqa: E402
from pipeline.data.stdlib import write_conversations  # noqa: E402
from pipeline.demo.pretrain import PretrainRecipe, trained_tiny_target  # noqa: E402
from pipeline.demo.tiny import make_tiny_target  # noqa: E402
from pipeline.draft.foreign import read_draft  # noqa: E402
from pipeline.draft.model import draft_to_target  # noqa: E402
from pipeline.extract.job import run_extract  # noqa: E402
from pipeline.probe.capture import capture_boundaries  # noqa: E402
from pipeline.probe.job import probe_prompts, run_probe  # noqa: E402
from pipeline.probe.score import evidence  # noqa: E402
from pipeline.train.job import run_train  # noqa: E402
from schemas.capture import CapturePoint  # noqa: E402
from schemas.extract import ExtractConfig  # noqa: E402
from schemas.probe import ProbeConfig  # noqa: E402
from schemas.train import TrainConfig  # noqa: E402


def _extract(root: Path, target: Path, capture: list[str], conversations: int) -> None:
    write_conversations(root / "conv.jsonl", n=conversations)
    run_extract(
        ExtractConfig.model_validate(
            {
                "target": {"path": str(target)},
                "source": {"uri": str(root / "conv.jsonl")},
                "output": {"uri": str(root / "ds")},
                "capture": [*capture, "final:post_norm"],
                "max_length": 256,
                "engine": {"dtype": "float32", "device": "cpu"},
                "fingerprint": {"probe_samples": 0},
            }
        ),
        progress=False,
        use_ray=False,
    )


def _draft(root: Path, target: Path, aux: list[str], epochs: int, seed: int = 0) -> Path:
    """A draft trained ``epochs`` epochs on ``aux`` (``seed``: its init and data order); 0: the same
    draft with random weights."""
    if epochs == 0:
        out = random_init_copy(_draft(root, target, aux, 1), root / "untrained", target)
        (out / "strata_artifact.json").unlink()
        return out
    run = root / f"run-{epochs}-s{seed}-{'-'.join(aux).replace(':', '')}"
    if not run.exists():
        run_train(
            TrainConfig.model_validate(
                {
                    "dataset": str(root / "ds"),
                    "target": {"path": str(target)},
                    "output": str(run),
                    "aux": aux,
                    "draft_vocab_size": 2048,
                    "ttt_steps": 3,
                    "batch_tokens": 2048,
                    "epochs": epochs,
                    "seed": seed,
                    "num_workers": 1,
                    "eval_fraction": 0.05,
                    "optim": {"lr": 1e-2, "warmup_steps": 10},
                    "deepspeed": {"zero_stage": 2, "dtype": "float32"},
                    "export": {"dtype": "float32", "engines": ["vllm"]},
                    "heldout_acceptance": {"prompts": 0},
                }
            ),
            use_ray=False,
        )
    return run / "export" / "vllm"


def random_init_copy(src: Path, out: Path, target: Path, seed: int = 1) -> Path:
    """``src`` copied to ``out`` with the draft's weights replaced by a fresh random init (same tensors)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from pipeline.draft.model import init_weights

    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(src, out)
    model = read_draft(src, target).model
    init_weights(model, seed=seed)
    names = load_file(str(src / "model.safetensors")).keys()
    save_file(
        {
            k: v.contiguous() if v.is_floating_point() else v.to(torch.long)
            for k, v in model.state_dict().items()
            if k in names
        },
        str(out / "model.safetensors"),
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depths", type=int, nargs="*", default=[6, 12, 61])
    ap.add_argument("--epochs", type=int, nargs="+", default=[0, 1, 6], help="draft quality: training epochs")
    ap.add_argument("--conversations", type=int, default=240)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--rank-sets", type=int, default=300, help="pretrained-target part: conversations (0: skip it)")
    ap.add_argument("--power-epochs", type=int, default=8, help="pretrained-target part: draft training epochs")
    ap.add_argument("--power-prompts", type=int, help="pretrained-target part: probe prompts (default: --prompts)")
    ap.add_argument("--power-seeds", type=int, nargs="+", default=[0], help="pretrained-target part: training seeds")
    ap.add_argument(
        "--no-rank-all", dest="rank_all", action="store_false", help="skip ranking all 286 sets (the probe only)"
    )
    ap.add_argument("--out")
    args = ap.parse_args()
    power = (
        _power(args.rank_sets, args.power_prompts or args.prompts, args.power_epochs, args.rank_all, args.power_seeds)
        if args.rank_sets
        else []
    )
    rows = []
    for n in args.depths:
        root = Path(tempfile.mkdtemp(prefix=f"strata-bench-probe-{n}-"))
        target = make_tiny_target(root / "target", num_layers=n, hidden_size=args.hidden)
        trained = conventions.default_aux_points("vllm", n)
        _extract(root, target, [str(p) for p in trained], args.conversations)
        cfg = ProbeConfig.model_validate({"draft": "-", "target": {"path": str(target)}, "prompts": args.prompts})
        t0 = time.perf_counter()
        cap = capture_boundaries(target, probe_prompts(cfg))
        capture_s = time.perf_counter() - t0
        for epochs in args.epochs:
            draft = _draft(root, target, [str(p) for p in trained], epochs)
            t0 = time.perf_counter()
            probe = run_probe(cfg.model_copy(update={"draft": str(draft)}), progress=False, capture=cap)
            search_s = time.perf_counter() - t0
            r = probe.report
            rows.append(
                {
                    "layers": n,
                    "draft_epochs": epochs,
                    "verdict": r.verdict,
                    "recovered_trained_set": r.best.points == trained and r.verdict == "inferred",
                    "best": r.best.boundaries,
                    "runner_up": r.runner_up.boundaries,
                    "agreement_best": r.best.agreement,
                    "margin": r.margin,
                    "margin_se": r.margin_se,
                    "margin_in_se": round(r.margin / max(r.margin_se, 1e-12), 1),
                    "over_frequencies": r.over_frequencies,
                    "spread_over_median": r.spread,
                    "candidates": r.evaluated,
                    "capture_s": round(capture_s, 3),
                    "search_s": round(search_s, 3),
                    "search_per_candidate_over_capture": round(search_s / r.evaluated / capture_s, 4),
                    "positions": r.positions,
                    "prompts": r.prompts,
                }
            )
            print(rows[-1], flush=True)
    save_result(
        {
            "benchmark": "probe",
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "hidden_size": args.hidden,
            "trained_on": "each depth's EAGLE-3 default (r_2, r_N//2, r_N-3)",
            "rows": rows,
            "pretrained_target_power": power,
        },
        "probe_tiny_cpu.json",
        args.out,
    )


# The demo's pretrained target (12 layers, hidden 128) and three trained sets, as tests/test_probe.py.
POWER_SETS = {
    "the EAGLE-3 default": ["layer_output:1", "layer_output:5", "layer_output:8"],
    "another spread": ["layer_output:2", "layer_output:6", "layer_output:10"],
    "with the embedding": ["embedding", "layer_output:3", "layer_output:7"],
}


def _power(
    conversations: int, prompts: int, epochs: int = 8, rank_all: bool = True, seeds: list[int] | None = None
) -> list[dict]:
    """Each trained set's rank among every set of its size, by the probe's loss and by the old agreement
    (``rank_all``), and the probe's own answer -- for a draft per training seed."""
    root = Path(tempfile.mkdtemp(prefix="strata-bench-probe-pretrained-"))
    target = trained_tiny_target(root / "target", PretrainRecipe())
    n = PretrainRecipe().num_layers
    _extract(root, target, sorted({p for s in POWER_SETS.values() for p in s}), conversations)
    cfg = ProbeConfig.model_validate({"draft": "-", "target": {"path": str(target)}, "prompts": prompts})
    cap = capture_boundaries(target, probe_prompts(cfg))
    everywhere = torch.arange(cap.tokens.shape[1])[None, :] < cap.lengths[:, None]  # every real position
    out = []
    for name, aux, seed in ((name, aux, seed) for name, aux in POWER_SETS.items() for seed in seeds or [0]):
        draft_dir = _draft(root, target, aux, epochs, seed)
        draft = read_draft(draft_dir, target).model
        ids = draft_to_target(torch.arange(draft.config.draft_vocab_size), draft.d2t)
        on_assistant, on_all = cap.targets(ids), cap.head.targets(cap.final, everywhere, ids)
        trained = tuple(conventions.boundary(CapturePoint.parse(p), n) for p in aux)
        loss, agree = {}, {}
        for s in itertools.combinations(range(n + 1), len(aux)) if rank_all else ():
            e = evidence(draft, cap, on_assistant, s, cfg.steps)
            loss[s] = float(-e.fit.sum() / e.in_loss.sum())
            e = evidence(draft, cap, on_all, s, cfg.steps)
            agree[s] = float(e.hits.sum() / e.trained.sum())
        ranks = {}
        if rank_all:
            ranks = {
                "sets": len(loss),
                "rank_by_loss_on_assistant_tokens": sorted(loss, key=loss.get).index(trained) + 1,
                "rank_by_agreement_on_every_position": sorted(agree, key=lambda k: -agree[k]).index(trained) + 1,
                "loss_trained": round(loss[trained], 5),
                "loss_best_other": round(min(v for k, v in loss.items() if k != trained), 5),
                "loss_median": round(sorted(loss.values())[len(loss) // 2], 5),
            }
        # handed over as other tools write it: SpecForge's layout without ids, speculators' with ids off by one
        tag, points = draft_dir.parent.parent.name, [CapturePoint.parse(p) for p in aux]
        trained_on = [conventions.boundary_label(p, n) for p in points]
        sf = specforge_export(draft_dir, root / f"sf-{tag}", None, root / "wheels")
        off = conventions.aux_ids_for(conventions.shifted(points, 1, n), "vllm", n)
        sp = speculators_export(sf, root / f"sp-{tag}", target, off, root / "wheels", vocab_buffers=False)
        for layout, handed in (("SpecForge, no ids", sf), (f"speculators, ids {off} (off by one)", sp)):
            r = run_probe(cfg.model_copy(update={"draft": str(handed)}), progress=False, capture=cap).report
            row = {
                "set": name,
                "trained_on": trained_on,
                "draft_epochs": epochs,
                "seed": seed,
                "layout": layout,
                "prompts": r.prompts,
                **ranks,
                "probe_verdict": r.verdict,
                "probe_recovered_trained_set": r.verdict == "inferred" and r.best.boundaries == trained_on,
                "probe_summary": r.summary,
                "probe_min_margin": r.min_margin,
                "probe_best": r.best.boundaries,
                "probe_runner_up": r.runner_up.boundaries,
                "probe_margin": r.margin,
                "probe_margin_se": r.margin_se,
                "probe_over_frequencies": r.over_frequencies,
                "probe_slots": r.slots,
                "probe_admissible": r.admissible,
                "trained_set_admitted": r.admissible is not None
                and all(b in ks for b, ks in zip(trained_on, r.admissible, strict=True)),
            }
            out.append(row)
            print(row, flush=True)
    return out


if __name__ == "__main__":
    main()
