"""Export a training run's latest checkpoint for each serving engine, with the aux ids the
conventions module gives for the run's capture points."""

from __future__ import annotations

import json
import logging
import os
import tempfile

from safetensors.torch import load as st_load

from pipeline import conventions
from pipeline.draft.export import export_draft
from pipeline.draft.model import DraftConfig, Eagle3Draft
from pipeline.draft.target_head import load_embedding
from pipeline.identity import target_config, target_identity
from pipeline.store.fs import exists, join, publish_local_file, read_bytes, resolve
from pipeline.store.reader import load_manifest
from pipeline.train import checkpoint
from schemas.capture import CapturePoint
from schemas.train import TrainConfig

log = logging.getLogger(__name__)

RUN_FILE = "run.json"  # the run's plan without its sample lists (written by job.prepare)


def export_family(cfg: TrainConfig, engine: str, target_cfg: dict, override: str | None = None) -> str:
    """The capture-rule family an export for ``engine`` is written for (SGLang's can be forced)."""
    forced = (override or cfg.export.engine_family) if engine == "sglang" else "auto"
    return conventions.engine_family(engine, target_cfg, forced)


def export_run(
    run_uri: str,
    s3=None,
    engines: list[str] | None = None,
    dest_uri: str | None = None,
    engine_family: str | None = None,
    dtype: str | None = None,
) -> list[dict]:
    """Export the latest checkpoint of a training run for each serving engine.

    Writes ``<dest>/<engine>/`` (default dest: ``<run>/export``); the aux ids come from the
    run's capture points through the conventions module.
    """
    fs, root = resolve(run_uri, s3)
    if not exists(fs, join(root, RUN_FILE)):
        raise FileNotFoundError(f"{run_uri}: no {RUN_FILE}; is this a Strata training run directory?")
    run = json.loads(read_bytes(fs, join(root, RUN_FILE)))
    cfg = TrainConfig.model_validate(run["cfg"])
    name = checkpoint.latest(run_uri, s3)
    if name is None:
        raise FileNotFoundError(f"{run_uri}: no checkpoint to export yet")
    model = Eagle3Draft(DraftConfig(**run["draft"]))
    weights = st_load(read_bytes(fs, join(root, "checkpoints", name, "model.safetensors")))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or set(missing) != {"embed_tokens.weight"}:
        raise ValueError(
            f"checkpoint {name} does not match the run's draft: missing {missing}, unexpected {unexpected}"
        )
    model.embed_tokens.weight.data.copy_(load_embedding(cfg.target.path))
    model = model.float()
    identity = target_identity(cfg.target.path, cfg.target.name, cfg.target.revision)
    metrics_path = join(root, "final_metrics.json")
    metrics = json.loads(read_bytes(fs, metrics_path)) if exists(fs, metrics_path) else {}
    target_cfg = target_config(cfg.target.path)
    dfs, droot = resolve(dest_uri, s3) if dest_uri else (fs, join(root, "export"))
    fingerprints = None
    ds_manifest = load_manifest(cfg.dataset, cfg.s3)
    if ds_manifest.fingerprints:
        rfs, rroot = resolve(cfg.dataset, cfg.s3)
        fingerprints = (read_bytes(rfs, join(rroot, ds_manifest.fingerprints["path"])), ds_manifest.fingerprints)
    out = []
    with tempfile.TemporaryDirectory(prefix="strata-export-") as tmp:  # staged, then published
        for engine in engines or cfg.export.engines:
            family = export_family(cfg, engine, target_cfg, engine_family)
            dest = os.path.join(tmp, engine)
            m = export_draft(
                model,
                dest,
                engine,
                [CapturePoint.parse(p) for p in run["aux"]],
                identity,
                family=family,
                dtype=dtype or cfg.export.dtype,
                dataset_id=run["extra"].get("dataset_id"),
                dataset_manifest_sha256=run["extra"].get("dataset_manifest_sha256"),
                release=cfg.export.engine_versions.get(engine, conventions.NEWEST),
                training={
                    **{k: v for k, v in run["cfg"].items() if k != "s3"},
                    "checkpoint": name,
                    "data_source": ds_manifest.source.model_dump(mode="json"),
                },
                metrics=metrics,
                fingerprints=fingerprints,
            )
            for fname in os.listdir(dest):
                publish_local_file(os.path.join(dest, fname), dfs, join(droot, engine, fname))
            log.info(
                "exported %s draft (aux ids %s, %s) to %s",
                engine,
                m.aux_layer_ids,
                m.aux_layer_ids_convention,
                join(droot, engine),
            )
            out.append(m.model_dump(mode="json"))
    return out
