"""Per-tensor provenance: stored in each tensor column's Arrow field metadata."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from schemas.capture import CapturePoint

DType = Literal["bfloat16", "float16", "float32"]
TrainDType = Literal["bfloat16", "float32"]  # DeepSpeed trains the draft in these (no fp16 loss scaling)

DTYPE_BYTES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4}


class EngineRef(BaseModel):
    """The engine that produced a tensor and what it calls that tensor natively."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str  # "hf", "vllm", "sglang"
    version: str
    native_id: int | None  # the engine's own integer for this point, if it has one
    native_id_convention: str  # what that integer means, e.g. "hf_hidden_states_index"
    tp_size: int = 1


class TensorProvenance(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    capture_point: CapturePoint
    boundary: str  # "r_3" or "final_post": the same fact in boundary notation (pipeline.conventions)
    dtype: DType
    hidden_size: int
    encoding: str  # see schemas.dataset.ENCODING_DOC
    engine: EngineRef
    target_model: str
    target_key: str  # TargetIdentity.key of the model that produced it
