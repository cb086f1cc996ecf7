"""A draft trained elsewhere as a Strata artifact: its own files byte for byte, plus a manifest
whose trained points are the probe's inference (provenance ``inferred``, the evidence beside it)
and fingerprints of those points computed on the probe prompts, so the gate can measure a feed
against them exactly as for a draft trained here. A tie the probe leaves open in a slot is kept
as that slot's alternatives (fingerprinted too): the gate accepts a feed of any of them."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from pipeline import conventions
from pipeline.draft.export import atomic_dir
from pipeline.draft.foreign import ForeignDraftError
from pipeline.fingerprint import Fingerprints, from_samples
from pipeline.identity import target_config, target_identity
from schemas.artifact import (
    ARTIFACT_CONFIG,
    ARTIFACT_FINGERPRINTS,
    ARTIFACT_MANIFEST,
    ARTIFACT_WEIGHTS,
    DraftArtifactManifest,
    content_digest,
)
from schemas.capture import CapturePoint

FINGERPRINT_DIM, FINGERPRINT_SEED = 64, 0


def probe_fingerprints(
    probe, trained: list[CapturePoint], dim: int = FINGERPRINT_DIM, seed: int = FINGERPRINT_SEED
) -> Fingerprints:
    """Sketches of the trained points on the probe prompts (the HF target's values)."""
    cap = probe.capture
    samples = (
        (f"probe-{row}", cap.tokens[row, :L], {str(p): cap.states[cap.index(p)][row, :L] for p in trained}, None)
        for row, L in enumerate(cap.lengths.tolist())
    )
    return from_samples(samples, [str(p) for p in trained], dim, seed)


def _weights_file(d: Path) -> Path:
    files = [f for f in sorted(d.glob("*.safetensors")) if not f.name.startswith("strata_")]
    if len(files) != 1:
        raise ForeignDraftError(
            f"{d}: {len(files)} safetensors files; importing needs the draft in one file ({ARTIFACT_WEIGHTS})"
        )
    return files[0]


def adopt(probe, out_dir: str | Path) -> DraftArtifactManifest:
    """Write the imported artifact to ``out_dir`` (atomically); refuses a probe that settled nothing."""
    r, d = probe.report, probe.draft
    admissible = probe.admissible
    if admissible is None:
        raise ForeignDraftError(
            f"{d.directory}: cannot import a draft whose training layers are not known: {r.summary}"
        )
    points = [ks[0] for ks in admissible]
    alternatives = [ks[1:] for ks in admissible] if any(len(ks) > 1 for ks in admissible) else []
    n = r.num_layers
    engine = "sglang" if f"eagle_config.{conventions.AUX_KEY}" in d.claimed else "vllm"  # whose key it writes
    tcfg = probe.cfg.target
    ident = target_identity(tcfg.path, tcfg.name, tcfg.revision)
    family = conventions.engine_family(engine, target_config(tcfg.path))
    fp = probe_fingerprints(probe, list(dict.fromkeys(p for ks in admissible for p in ks)))
    with atomic_dir(Path(out_dir)) as tmp:
        shutil.copyfile(_weights_file(d.directory), tmp / ARTIFACT_WEIGHTS)
        shutil.copyfile(d.directory / ARTIFACT_CONFIG, tmp / ARTIFACT_CONFIG)
        name, sha = fp.save(str(tmp), name=ARTIFACT_FINGERPRINTS)
        evidence = {
            k: v
            for k, v in r.model_dump(mode="json").items()
            if k
            in (
                "summary",
                "layout",
                "prompts",
                "positions",
                "best",
                "runner_up",
                "margin",
                "margin_se",
                "z",
                "evaluated",
                "claimed",
                "claimed_readings",
                "declared",
                "admissible",
                "verdict",
            )
        }
        evidence["source"] = str(d.directory)
        evidence["source_sha256"] = hashlib.sha256((tmp / ARTIFACT_WEIGHTS).read_bytes()).hexdigest()
        ids = d.claimed_ids
        manifest = DraftArtifactManifest(
            content_digest=content_digest(tmp),
            serving_engine=engine,  # type: ignore[arg-type]
            engine_family=family if engine == "sglang" else None,
            aux_capture_points=points,
            aux_alternatives=alternatives,
            aux_layer_ids=ids or [],
            aux_layer_ids_convention="as found in the imported config (not written by Strata)",
            ids_valid_for=conventions.releases_reading(d.config, points, engine, family, n),
            target=ident,
            draft_config=d.model.config.to_dict(),
            training={"trained_by": "elsewhere (imported)", "layout": d.layout},
            fingerprints={
                "path": name,
                "sha256": sha,
                "probe_samples": len(fp.sample_ids),
                "dim": fp.dim,
                "seed": fp.seed,
                "computed_from": "the probe prompts, through HF transformers",
            },
            provenance=r.provenance or "inferred",
            probe=evidence,
        )
        (tmp / ARTIFACT_MANIFEST).write_text(manifest.model_dump_json(indent=1))
    return manifest
