"""The training job's configuration: dataset, target, draft, optimiser, DeepSpeed, export."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, Field, field_validator, model_validator

from schemas import acceptance
from schemas.capture import CapturePoint, parse_points
from schemas.config import S3Config, Strict, TargetConfig
from schemas.provenance import DType, TrainDType


class OptimConfig(Strict):
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = Field(20, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    grad_clip: float = Field(0.5, gt=0)


class CheckpointConfig(Strict):
    every: int = Field(50, ge=1, description="steps between checkpoints (and one at the end)")
    keep: int = Field(3, ge=1, description="checkpoints kept; older ones are deleted after each commit")


class DeepSpeedConfig(Strict):
    zero_stage: Literal[1, 2, 3] = 2
    dtype: TrainDType = "bfloat16"
    config_file: str | None = Field(
        None,
        description="DeepSpeed JSON (e.g. infra/deepspeed/zero3-offload.json) merged over Strata's settings; "
        "batch size, accumulation and clipping stay Strata's (they are part of the training plan)",
    )


class ExportConfig(Strict):
    engines: list[Literal["sglang", "vllm"]] = ["sglang", "vllm"]
    engine_family: str = Field(
        "auto",
        validation_alias=AliasChoices("engine_family", "sglang_family"),
        description="SGLang capture rule (architecture or model file); auto = from config.json",
    )
    engine_versions: dict[Literal["sglang", "vllm"], str] = Field(
        default_factory=dict, description="write ids for these engine releases (default: the newest with a known rule)"
    )
    dtype: DType = "bfloat16"


class HeldoutAcceptanceConfig(Strict):
    """Acceptance of the finished draft on held-out prompts (the dataset's probe samples up to
    their first assistant turn, never trained on), by Strata's reference speculative decoding on
    the target -- with validation's defaults (``schemas.acceptance``)."""

    prompts: int = Field(acceptance.PROMPTS, ge=0, description="0 skips the measurement (it loads the target once)")
    speculative_tokens: int = Field(acceptance.SPECULATIVE_TOKENS, ge=1)
    max_new_tokens: int = Field(acceptance.MAX_NEW_TOKENS, ge=1)


STREAM_DATA_DIR = "data"


class StreamConfig(Strict):
    """Training fed by capture actors through Ray's object store instead of a stored dataset."""

    stream: str = Field(
        description="extraction config (YAML or JSON, a path relative to where the job runs): its target, "
        "source, capture points, engine and ray capture actors feed training; only the held-out samples "
        "(evaluation and fingerprint probes) are written, with a manifest of every streamed row, to the run's data/"
    )
    in_flight: int = Field(
        2,
        ge=1,
        description="batches per training worker captured ahead and held in Ray's object store: the memory "
        "bound, however large the source",
    )
    cache: str | None = Field(
        None,
        description="URI (local or s3://) that keeps the first epoch's captured batches as Parquet shards (one "
        "per step and worker, the dataset's columns and provenance): later epochs, and a rerun of the same stream, "
        "read them instead of capturing again. Unset: every epoch captures again (deterministically)",
    )


class TrainConfig(Strict):
    dataset: str | None = Field(None, description="extracted dataset URI (local or s3://); or data.stream")
    data: StreamConfig | None = Field(None, description="streaming mode: batches captured as training consumes them")
    target: TargetConfig
    output: str = Field(description="run directory: checkpoints, metrics.jsonl, exported drafts")
    aux: list[CapturePoint] | None = Field(None, description="aux slots; default: every residual point of the dataset")
    draft_vocab_size: int = Field(32000, gt=0)
    ttt_steps: int = Field(7, ge=1)
    loss_decay: float = Field(0.8, gt=0, le=1)
    soft_target: Literal["draft_vocab", "full_vocab"] = Field(
        "draft_vocab",
        description="draft_vocab: the target renormalised over the draft vocabulary (SpecForge, "
        "EAGLE); full_vocab: its full-vocabulary probabilities of the draft tokens (positions weighted by the "
        "target mass inside the draft vocab)",
    )
    batch_tokens: int = Field(
        4096, gt=0, description="tokens per worker per step: real tokens when packing, padded ones otherwise"
    )
    packing: bool = Field(
        True,
        description="pack a batch's sequences end to end in one row (each with its own positions, attending "
        "only to itself) instead of padding each to the batch's longest: no compute on padding, and the same "
        "training up to fp32 rounding",
    )
    epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1)
    eval_fraction: float = Field(0.05, ge=0, lt=1)
    metrics_every: int = Field(10, ge=1)
    checkpoint: CheckpointConfig = CheckpointConfig()
    resume: Literal["latest", "none"] = "latest"
    init_from: str | None = Field(
        None,
        description="warm start: an exported draft directory (same target, capture points and draft shape); "
        "its weights and draft vocab are the starting point",
    )
    seed: int = 0
    optim: OptimConfig = OptimConfig()
    deepspeed: DeepSpeedConfig = DeepSpeedConfig()
    num_workers: int = Field(2, ge=1)
    cpus_per_worker: float = Field(1.0, gt=0)
    data_loading: Literal["worker", "ray_data"] = Field(
        "worker",
        description="worker: each training worker reads and decodes its own batches on a background "
        "thread, two ahead (no copies between processes); ray_data: Ray Data tasks (0.25 CPU each) decode "
        "them elsewhere on the cluster, for when the workers' nodes have no CPU to spare",
    )
    stall_timeout_s: float | None = Field(
        3600,
        ge=0,
        description="stop with an error when the workers cannot be placed for this long (another "
        "job took the CPUs), or, with ray_data loading, when no batch arrives for this long: Ray otherwise waits "
        "forever on work it cannot schedule. 0 or null: no limit",
    )
    use_gpu: bool = False
    ray_address: str | None = None
    resource_wait_s: float = Field(
        600,
        ge=0,
        description="on a cluster the job was submitted to: how long to wait for the autoscaler to "
        "provide the workers' CPUs/GPUs before refusing (a local Ray is checked at once)",
    )
    export: ExportConfig = ExportConfig()
    heldout_acceptance: HeldoutAcceptanceConfig = HeldoutAcceptanceConfig()
    s3: S3Config = S3Config()

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, v: Any) -> Any:
        """``checkpoint_every: N`` (older configs) is ``checkpoint: {every: N}``."""
        if isinstance(v, dict) and "checkpoint_every" in v:
            v = {**v}
            every = v.pop("checkpoint_every")
            v["checkpoint"] = {**(v.get("checkpoint") or {}), "every": every}
        return v

    @model_validator(mode="after")
    def _one_source(self) -> TrainConfig:
        """A streaming run sets ``dataset`` itself, to the held-out data it writes (``stream_data``)."""
        if (
            self.data is None
            and self.dataset is None
            or self.data is not None
            and self.dataset
            not in (
                None,
                self.stream_data,
            )
        ):
            raise ValueError(
                "give exactly one of dataset (an extracted dataset) and data.stream (an extraction config "
                "whose capture actors feed training)" + ("; both are set" if self.dataset is not None else "")
            )
        return self

    @property
    def stream_data(self) -> str:
        """Where a streaming run writes its held-out samples and the manifest of what it streamed."""
        return self.output.rstrip("/") + "/" + STREAM_DATA_DIR

    @field_validator("aux", mode="before")
    @classmethod
    def _parse_aux(cls, v: Any) -> Any:
        return None if v is None else parse_points(v)

    @field_validator("aux")
    @classmethod
    def _servable_aux(cls, v: list[CapturePoint] | None) -> list[CapturePoint] | None:
        post = [str(p) for p in v or [] if p.kind == "final" and p.norm == "post"]
        if post:
            raise ValueError(
                f"{post[0]} is the post-norm final state (what the LM head reads): no serving engine "
                "feeds it to a draft, so a draft trained on it cannot be served. Use final:pre_norm "
                "or a layer output"
            )
        return v
