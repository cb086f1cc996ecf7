"""Draft artifact manifest: what a served draft was trained on, and how an engine must read it."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from schemas.capture import CapturePoint
from schemas.identity import TargetIdentity

ARTIFACT_MANIFEST = "strata_artifact.json"
ARTIFACT_WEIGHTS = "model.safetensors"
ARTIFACT_CONFIG = "config.json"  # the draft config the serving engine reads
# Not *.safetensors: vLLM and SGLang load every top-level *.safetensors of a draft as weights.
ARTIFACT_FINGERPRINTS = "strata_fingerprints.st"


class DraftArtifactManifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format_version: int = 1
    content_digest: str  # sha256 over weights + config.json of this directory
    serving_engine: Literal["sglang", "vllm"]
    engine_family: str | None = None  # SGLang rule architecture (LlamaForCausalLM, DeepseekV3ForCausalLM)
    aux_capture_points: list[CapturePoint]  # slot order (ascending along the forward pass)
    # per slot, other points an imported draft may as well have been trained on (a tie the probe left
    # open, provenance "inferred"); the gate accepts a feed of any of them. [] or all empty: none
    aux_alternatives: list[list[CapturePoint]] = []
    aux_layer_ids: list[int]  # what config.json carries, in this engine's convention
    aux_layer_ids_convention: str
    engine_release: str | None = None  # the release the ids were written for
    ids_valid_for: list[str] = []  # every known release (range) that reads them as aux_capture_points
    target: TargetIdentity
    dataset_id: str | None = None
    dataset_manifest_sha256: str | None = None
    draft_config: dict
    training: dict = {}
    metrics: dict = {}
    fingerprints: dict | None = None  # sketches of the trained points on held-out samples
    # "fingerprints": the trained points are the training data's own (extraction provenance);
    # "inferred": a draft trained elsewhere, its points inferred by ``strata probe`` (evidence in ``probe``)
    # "declared": stated by whoever trained it (the probe's evidence beside it)
    provenance: Literal["fingerprints", "inferred", "declared"] = "fingerprints"
    probe: dict | None = None


def content_digest(directory: str | Path) -> str:
    """An artifact's identity: what the engine loads (weights and config.json), hashed by name.
    The registry stores artifacts under it and validation checks it against the manifest."""
    h = hashlib.sha256()
    for name in (ARTIFACT_WEIGHTS, ARTIFACT_CONFIG):
        h.update(name.encode() + b"\0" + hashlib.sha256((Path(directory) / name).read_bytes()).digest())
    return h.hexdigest()
