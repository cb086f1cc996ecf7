"""Export a trained draft as a self-contained directory for SGLang or vLLM.

The aux layer ids in config.json are generated here from the dataset's typed capture
points through ``pipeline.conventions`` -- never typed by hand -- and a layout the engine
cannot capture is refused instead of written (the engine would silently use defaults).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pipeline import conventions
from pipeline.conventions import releases
from pipeline.draft.model import DraftConfig, Eagle3Draft
from pipeline.draft.target_head import load_embedding
from pipeline.dtypes import torch_dtype
from pipeline.errors import UnusableInput
from schemas.artifact import (
    ARTIFACT_CONFIG,
    ARTIFACT_FINGERPRINTS,
    ARTIFACT_MANIFEST,
    ARTIFACT_WEIGHTS,
    DraftArtifactManifest,
    content_digest,
)
from schemas.capture import CapturePoint
from schemas.identity import TargetIdentity

WEIGHTS = ARTIFACT_WEIGHTS


class ExportError(UnusableInput):
    pass


def draft_state_dict(model: Eagle3Draft, engine: str = "sglang") -> dict[str, torch.Tensor]:
    """Everything but the frozen target embedding, contiguous, on CPU.

    With the full target vocab as draft vocab, vLLM has no ``d2t`` parameter and refuses a
    file that carries one, so the (all-zero) offsets are left out for it.
    """
    sd = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if not k.startswith("embed_tokens.")}
    if engine == "vllm" and model.config.draft_vocab_size == model.config.vocab_size:
        if bool(sd["d2t"].any()):
            raise ExportError("draft vocab is the full target vocab but d2t is not the identity")
        del sd["d2t"]
    return sd


def serving_ids(
    aux_points: list[CapturePoint], num_layers: int, engine: str, family: str, release: str = conventions.NEWEST
) -> list[int]:
    """The ids ``engine`` at ``release`` needs to feed ``aux_points``; ExportError if it cannot load or feed them."""
    if not releases.serves_slots(engine, release, len(aux_points)):  # type: ignore[arg-type]
        raise ExportError(
            f"{engine} {release} has a fixed three-slot fc; this draft has {len(aux_points)} aux slots. "
            f"Servable by: {', '.join(releases.servable_by(len(aux_points)))}"
        )
    try:
        return conventions.aux_ids_for(aux_points, engine, num_layers, family, release)  # type: ignore[arg-type]
    except conventions.ConventionError as e:
        raise ExportError(f"cannot export for {engine} {release} ({family}): {e}") from None


def engine_config(
    cfg: DraftConfig,
    aux_points: list[CapturePoint],
    num_layers: int,
    engine: str,
    family: str,
    dtype: str,
    release: str = conventions.NEWEST,
) -> dict:
    """config.json for ``engine`` at ``release`` with the aux ids that make it capture exactly
    ``aux_points``, and the slot count its fc must read."""
    ids = serving_ids(aux_points, num_layers, engine, family, release)
    out = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "num_aux_hidden_states": len(aux_points),  # vLLM >= 0.22 and SGLang >= 0.5.12 size fc from it
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }
    if engine == "sglang":
        out["eagle_config"] = {conventions.AUX_KEY: ids, "use_aux_hidden_state": True}
    else:
        out[conventions.AUX_KEY] = ids
    return out


def export_draft(
    model: Eagle3Draft,
    out_dir: str | Path,
    engine: str,
    aux_points: list[CapturePoint],
    target: TargetIdentity,
    family: str = "llama",
    dtype: str = "bfloat16",
    dataset_id: str | None = None,
    dataset_manifest_sha256: str | None = None,
    release: str = conventions.NEWEST,
    training: dict | None = None,
    metrics: dict | None = None,
    fingerprints: tuple[bytes, dict] | None = None,
) -> DraftArtifactManifest:
    """Write ``out_dir`` atomically (a temp sibling renamed into place).

    ``fingerprints`` = (the dataset's fingerprints file, its manifest entry): copied in, so
    the draft can be validated after its training data is gone.
    """
    n = target.num_layers
    _check_aux(model, aux_points, n, engine)
    if release == conventions.NEWEST:
        release = releases.newest_release(engine)  # type: ignore[arg-type]
    cfg_json = engine_config(model.config, aux_points, n, engine, family, dtype, release)
    with atomic_dir(Path(out_dir)) as tmp:
        tdtype = torch_dtype(dtype)
        sd = {k: (v.to(tdtype) if v.is_floating_point() else v) for k, v in draft_state_dict(model, engine).items()}
        save_file(sd, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / ARTIFACT_CONFIG).write_text(json.dumps(cfg_json, indent=1))
        manifest = DraftArtifactManifest(
            content_digest=content_digest(tmp),
            serving_engine=engine,  # type: ignore[arg-type]
            engine_family=family if engine == "sglang" else None,
            aux_capture_points=list(aux_points),
            aux_layer_ids=cfg_json.get(conventions.AUX_KEY) or cfg_json["eagle_config"][conventions.AUX_KEY],
            aux_layer_ids_convention=conventions.native_id_convention(engine, family),  # type: ignore[arg-type]
            engine_release=release,
            ids_valid_for=conventions.releases_reading(cfg_json, aux_points, engine, family, n),
            target=target,
            dataset_id=dataset_id,
            dataset_manifest_sha256=dataset_manifest_sha256,
            draft_config=model.config.to_dict(),
            training=training or {},
            metrics=metrics or {},
            fingerprints=_copy_fingerprints(tmp, fingerprints) if fingerprints is not None else None,
        )
        (tmp / ARTIFACT_MANIFEST).write_text(manifest.model_dump_json(indent=1))
    return manifest


def _check_aux(model: Eagle3Draft, aux_points: list[CapturePoint], n: int, engine: str) -> None:
    if engine not in ("sglang", "vllm"):
        raise ExportError(f"unknown serving engine {engine!r}: expected sglang or vllm")
    if sorted(aux_points, key=lambda p: conventions.sort_key(p, n)) != list(aux_points):
        raise ExportError(f"aux capture points must be in ascending order, got {[str(p) for p in aux_points]}")
    if len(aux_points) != model.config.num_aux:
        raise ExportError(f"the draft reads {model.config.num_aux} aux slots, got {len(aux_points)} capture points")


def _copy_fingerprints(artifact: Path, fingerprints: tuple[bytes, dict]) -> dict:
    blob, meta = fingerprints
    if hashlib.sha256(blob).hexdigest() != meta["sha256"]:
        raise ExportError("the dataset's fingerprints file does not match its manifest digest")
    (artifact / ARTIFACT_FINGERPRINTS).write_bytes(blob)
    return {**meta, "path": ARTIFACT_FINGERPRINTS}


@contextmanager
def atomic_dir(out: Path) -> Iterator[Path]:
    """A temp sibling of ``out`` to fill; renamed into place when the block succeeds, removed
    when it fails, so ``out`` is never half-written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_draft(directory: str | Path, target_dir: str | Path | None = None, dtype=torch.float32) -> Eagle3Draft:
    """Load an exported draft back into the reference model (embedding from the target)."""
    d = Path(directory)
    manifest = DraftArtifactManifest.model_validate_json((d / ARTIFACT_MANIFEST).read_text())
    if manifest.provenance != "fingerprints":  # imported: the draft's own layout (SpecForge, speculators, vLLM)
        from pipeline.draft.foreign import read_draft

        if target_dir is None:
            raise ExportError(f"{d}: an imported draft needs the target to load (its embedding may be the target's)")
        return read_draft(d, target_dir).model.to(dtype)
    model = Eagle3Draft(DraftConfig(**manifest.draft_config))
    sd = load_file(str(d / WEIGHTS))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if k != "d2t" or model.config.draft_vocab_size != model.config.vocab_size]
    if unexpected or set(missing) != {"embed_tokens.weight"}:
        raise ExportError(f"{d}: weights do not match the draft: missing {missing}, unexpected {unexpected}")
    if target_dir is not None:
        model.embed_tokens.weight.data.copy_(load_embedding(target_dir))
    return model.to(dtype)
