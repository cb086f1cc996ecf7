"""Acceptance of a finished draft on held-out prompts, next to what its training accuracy
predicts -- measured once at the end of a run, recorded in ``metrics.jsonl``, the final
metrics and (through them) every exported artifact.

Per-position accuracy only predicts acceptance if the draft sees at serving time what it
saw in training; speculating for real on prompts it never saw (the dataset's probe samples
up to their first assistant turn, which ``split_eval`` always holds out) is the check. It is
the same measurement validation and the cost table make (``pipeline.acceptance``).
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Callable
from pathlib import Path

from pipeline.acceptance import line
from pipeline.cluster import init_ray
from pipeline.draft.model import simulated_acceptance_length
from pipeline.engines.hf import HFEngine
from pipeline.fingerprint import Fingerprints
from pipeline.store.fs import atomic_write_bytes, exists, join, read_bytes, resolve
from pipeline.store.reader import load_manifest
from pipeline.train.export import export_run
from pipeline.train.loop import FINAL_METRICS
from pipeline.train.metrics import METRICS_FILE
from schemas.acceptance import HeldoutAcceptance
from schemas.capture import CapturePoint
from schemas.train import TrainConfig

log = logging.getLogger(__name__)


def measure(cfg: TrainConfig, aux: list[str], eval_acc: list[float]) -> dict:
    """Strata's reference speculative decoding (HF target + the run's latest draft, fed ``aux``)
    on the held-out prompts; ``predicted_accepted_per_step`` is the same quantity from eval
    accuracy. Reads the run from ``cfg.output``, so it runs wherever the workers can."""
    with tempfile.TemporaryDirectory(prefix="strata-heldout-") as tmp:
        engine = cfg.export.engines[0]
        export_run(cfg.output, cfg.s3, engines=[engine], dest_uri=tmp)
        return _measure(cfg, Path(tmp) / engine, aux, eval_acc)


def _measure(cfg: TrainConfig, draft_dir: Path, aux: list[str], eval_acc: list[float]) -> dict:
    h = cfg.heldout_acceptance
    manifest = load_manifest(cfg.dataset, cfg.s3)
    if not manifest.fingerprints:
        return {"skipped": "the dataset has no probe samples (fingerprint.probe_samples = 0)"}
    fp = Fingerprints.load(cfg.dataset, cfg.s3, name=manifest.fingerprints["path"])
    prompts = fp.prompts(h.prompts)
    eng = HFEngine(cfg.target.path, [], "bfloat16" if cfg.use_gpu else "float32", "auto")
    try:
        res = eng.serve_draft(
            draft_dir, prompts, h.max_new_tokens, h.speculative_tokens, feed_points=[CapturePoint.parse(p) for p in aux]
        )
        lossless = res.outputs == eng.greedy(prompts, h.max_new_tokens)
    finally:
        eng.close()
    return {
        "kind": "heldout_acceptance",
        **res.acceptance.model_dump(exclude={"lossless"}),
        "prompt_sample_ids": fp.sample_ids[: len(prompts)],
        "max_new_tokens": h.max_new_tokens,
        "lossless": lossless,
        "predicted_accepted_per_step": simulated_acceptance_length(eval_acc[: h.speculative_tokens])
        if eval_acc
        else None,
    }


def measure_and_record(
    cfg: TrainConfig,
    aux: list[str],
    metrics: dict,
    use_ray: bool,
    on: Callable[[TrainConfig, list[str], list[float]], dict] | None = None,
) -> dict:
    """Measure and add the result to ``metrics.jsonl`` and ``final_metrics.json``, which the export
    then carries into every artifact. ``on``: the ``measure`` of a process that already holds the
    worker's resources (a one-worker run's); else a Ray task with ``use_ray``, else here."""
    if cfg.heldout_acceptance.prompts == 0:
        return {"skipped": "heldout_acceptance.prompts = 0"}
    eval_acc = (metrics.get("eval") or {}).get("acc_per_pos") or []
    if on is not None:
        result = on(cfg, aux, eval_acc)
    elif use_ray:  # on a worker with the resources the target needs, not on the driver
        import ray

        init_ray(cfg.ray_address)
        task = ray.remote(num_cpus=1, num_gpus=1 if cfg.use_gpu else 0)(measure)
        result = ray.get(task.remote(cfg, aux, eval_acc))
    else:
        result = measure(cfg, aux, eval_acc)
    if "skipped" not in result:
        result["step"] = metrics.get("steps")
        log.info(
            "held-out acceptance: %s; training accuracy predicts %.2f accepted per step, measured %.2f",
            line(HeldoutAcceptance.model_validate(result)),
            result["predicted_accepted_per_step"] or float("nan"),
            result["accepted_per_step"],
        )
    fs, root = resolve(cfg.output, cfg.s3)
    lines = read_bytes(fs, join(root, METRICS_FILE)).decode() if exists(fs, join(root, METRICS_FILE)) else ""
    lines = "".join(ln + "\n" for ln in lines.splitlines() if json.loads(ln).get("kind") != "heldout_acceptance")
    atomic_write_bytes(fs, join(root, METRICS_FILE), (lines + json.dumps(result) + "\n").encode())
    metrics["heldout_acceptance"] = result
    atomic_write_bytes(fs, join(root, FINAL_METRICS), json.dumps(metrics, indent=1).encode())
    return result
