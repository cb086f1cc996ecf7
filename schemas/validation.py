"""Validation contracts: how a draft will be served, the validation job's config, the verdict."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from schemas import acceptance
from schemas.capture import CapturePoint, parse_points
from schemas.config import S3Config, TargetConfig
from schemas.provenance import DType


class ServingConfig(BaseModel):
    """The ``serving`` section a user writes: the deployment a draft is validated for (the engine
    reads ``draft_config`` by its rules). Resolved into a pinned ``schemas.registry.Deployment``."""

    model_config = ConfigDict(extra="forbid")

    engine: Literal["vllm", "sglang"]
    engine_version: str | None = Field(
        None,
        description="the engine release that will serve; selects its id-reading rule. None: the installed "
        "release with replay: engine, else the newest release with a known rule",
    )
    engine_family: str = Field(
        "auto",
        description="capture rule: an architecture or model file (deepseek_v2); "
        "auto = the target config.json's architectures",
    )
    vllm_runner: Literal["auto", "v1", "v2"] = Field(
        "auto",
        description="vLLM model runner: V1 and Model Runner V2 read draft configs differently; auto = "
        "whichever vLLM may pick (V2 is its GPU default from 0.28/0.29; CPUs run V1)",
    )
    dtype: DType = "bfloat16"
    tp_size: int = 1
    attn_implementation: Literal["sdpa", "eager"] = Field("sdpa", description="HF replay only")
    replay: Literal["engine", "hf"] = Field(
        "engine",
        description="engine: replay and serve through the engine itself (vLLM; SGLang from its own env); "
        "hf: HF transformers with the engine's reading rules, where the engine cannot run",
    )
    max_model_len: int = Field(2048, gt=0, description="engine context length for replay and serving")
    target: TargetConfig
    draft_config: str | None = Field(None, description="the config.json the engine will read; default: the artifact's")


class Tolerances(BaseModel):
    model_config = ConfigDict(extra="forbid")

    match_rel_l2: float = Field(0.05, gt=0, description="max relative L2 between fed values and training values")
    neighbour_factor: float = Field(4.0, gt=1, description="every other boundary must be this many times farther")
    acceptance_floor: float = Field(1.0, ge=1, description="min mean acceptance length (tokens per verify step)")
    acceptance_vs_heldout: float = Field(
        0.5,
        ge=0,
        le=1,
        description="block when accepted tokens per step through the engine fall below this "
        "fraction of the held-out acceptance measured at training, beyond the noise of both measurements "
        "(calibration: tests/benchmarks/calibrate_acceptance.py)",
    )
    acceptance_z: float = Field(3.0, ge=0, description="how many standard errors of noise the comparison allows")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, v: Any) -> Any:
        if isinstance(v, dict) and "acceptance_vs_predicted" in v:
            raise ValueError(
                "acceptance_vs_predicted was replaced by acceptance_vs_heldout: the gate compares "
                "with the acceptance measured at training on held-out prompts (the teacher-forced "
                "prediction is reported, not gated)"
            )
        return v


class ProbeOptions(BaseModel):
    """How ``strata probe`` asks a draft which layers it was trained on (also for validating a draft
    trained elsewhere, which has no fingerprints)."""

    model_config = ConfigDict(extra="forbid")

    conversations: str | None = Field(
        None,
        description="JSONL/Parquet conversations to probe with (yours); default: the built-in stdlib conversations",
    )
    prompts: int = Field(32, gt=1, description="probe conversations (prompts are resampled for the margin's error)")
    max_length: int = Field(256, gt=8)
    steps: int = Field(
        2,
        ge=1,
        le=8,
        description="TTT steps scored: step 0 reads the aux states directly, later "
        "steps carry their effect through the draft's own states",
    )
    resamples: int = Field(1000, ge=100, description="bootstrap resamples of the prompts")
    z: float = Field(3.0, gt=0, description="margin over its standard error needed for a conclusion")
    min_margin: float = Field(
        0.0002,
        ge=0,
        description="nats per token the runner-up must fit worse by, beyond z standard errors: sets closer "
        "than this are a tie however many prompts are used (adjacent boundaries in one slot: within 0.0003 "
        "either way for drafts trained alike; a 32-epoch draft's trained set over its nearest rival: "
        "0.0004-0.0009 in eight of nine)",
    )
    dtype: Literal["float32", "bfloat16"] = "float32"
    candidates: list[list[CapturePoint]] | None = Field(
        None,
        description="score only these aux sets (e.g. the readings you are deciding between); default: every "
        "reading of the config's ids, every default, shifts, the embedding inserted, then a per-slot search",
    )

    trained_on: list[CapturePoint] | None = Field(
        None,
        description="the trained points as declared by whoever trained the draft (its training config, a model "
        "card): the gate checks the deployment against them, recorded as declared; the probe's evidence is reported "
        "beside them",
    )

    @field_validator("trained_on", mode="before")
    @classmethod
    def _parse_trained(cls, v: Any) -> Any:
        return None if v is None else parse_points(v)

    @field_validator("candidates", mode="before")
    @classmethod
    def _parse(cls, v: Any) -> Any:
        if v is None:
            return v
        if len(v) < 2:
            raise ValueError("candidates: give at least two aux sets to decide between")
        return [parse_points(c) for c in v]


class ValidateConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    artifact: str = Field(description="exported draft directory (with strata_artifact.json + fingerprints)")
    serving: ServingConfig
    tolerances: Tolerances = Tolerances()
    # one protocol with training's held-out measurement and the cost table (schemas.acceptance)
    acceptance_prompts: int = Field(acceptance.PROMPTS, ge=0)
    speculative_tokens: int = Field(acceptance.SPECULATIVE_TOKENS, ge=1)
    max_new_tokens: int = Field(
        acceptance.MAX_NEW_TOKENS, ge=1, description="the cap per prompt; generation stops at the target's end of turn"
    )
    cost: bool = Field(
        True,
        description="when the gate blocks and the engine runs here, time the target alone, "
        "the draft as configured and the draft with the correct ids on the same prompts (report only)",
    )
    report_dir: str | None = Field(None, description="where report.md, report.json, heatmap.png go")
    registry: str | None = Field(None, description="record the verdict in this registry (local dir or s3://)")
    s3: S3Config = S3Config()
    probe: ProbeOptions = Field(
        default_factory=ProbeOptions,
        description="for a draft directory without a Strata "
        "manifest (trained elsewhere): how its trained layers are inferred",
    )


class SlotCheck(BaseModel):
    slot: int
    trained: CapturePoint
    fed: CapturePoint | None  # what the engine feeds: measured where it ran, else its rule
    fed_by: Literal["measured", "rule"] = "rule"
    predicted: CapturePoint | None = None  # the rule table's prediction for this slot
    errors: dict[str, float]  # boundary label -> relative L2 vs the training values
    best: str
    ok: bool
    message: str
    # an imported draft's tie: every point the slot may have been trained on (``trained`` is the one
    # the feed was checked against: the match, else the probe's best); [] when the slot is settled
    could_be: list[CapturePoint] = []


class Check(BaseModel):
    name: str
    ok: bool
    message: str


class EngineReads(BaseModel):
    """What the engine release's reading rule takes from the draft config, and the points it predicts
    (``rule`` None: no derived rule for the release; the measured feed decides)."""

    model_config = ConfigDict(extra="forbid")

    rule: str | None = None
    source: str | None = None  # where in the engine's released source the rule was derived
    key: str | None = None  # the config key read
    ids: list[int] | None = None
    points: list[str] = []
    labels: list[str] = []
    error: str | None = None  # the rule cannot read this config
    release: str | None = None
    other_runners: list[EngineReads] = []  # the other runners the deployment may use (vLLM)
    no_rule: str | None = None
    note: str | None = None
    replayed_with: str | None = None  # the engine release installed here


class SlotFeed(BaseModel):
    prefill: str | None  # the boundary matched on prefill rows (None: none within tolerance)
    verify: str | None
    prefill_errors: dict[str, float]  # boundary -> rel L2 of the fed rows
    verify_errors: dict[str, float] | None


class Feed(BaseModel):
    """What the engine's draft actually received, per slot on prefill and verify steps, or why it
    was not measured."""

    model_config = ConfigDict(extra="forbid")

    not_measured: str | None = None
    measured_with: str | None = None
    recorded_rows: dict[str, int] = {}
    prefill: list[str] = []
    verify: list[str] | str | None = None  # a string says why no verify-step rows were recorded
    vs_training_rel_l2: list[float | None] = []
    verify_deviations: list[str] = []  # the layer right, its values off: reported, acceptance judges it
    disagreements: list[str] = []  # the rule table against the measurement: a table bug
    slots: list[SlotFeed] = []

    @property
    def measured(self) -> bool:
        return bool(self.prefill)


class VersusHeldout(BaseModel):
    """Acceptance through the engine against training's held-out figure (``acceptance.versus_heldout``)."""

    gated: bool
    why: str | None = None  # reported, not gated: why
    k: int | None = None
    measured: float | None = None
    heldout: float | None = None
    heldout_verify_steps: int | None = None
    verify_steps: int | None = None
    se: float | None = None
    threshold: float | None = None
    low: bool = False


class AcceptanceSection(BaseModel):
    """The report's acceptance: through the serving engine (``served``), Strata's reference decoding
    fed the same points, training's held-out figure and the comparison the gate made -- or why it
    was skipped."""

    model_config = ConfigDict(extra="forbid")

    skipped: str | None = None
    served: acceptance.Acceptance | None = None  # None with replay: hf (the reference is the measurement)
    reference: acceptance.Acceptance | None = None
    note: str | None = None
    predicted_accepted_per_step: float | None = None  # from teacher-forced eval accuracy; reported only
    heldout_at_training: acceptance.HeldoutAcceptance | None = None
    vs_heldout: VersusHeldout | None = None
    lossless_note: str | None = None

    @property
    def measured(self) -> acceptance.Acceptance | None:
        """The measurement the gate judges: the serving engine's, else the reference decoding's."""
        return self.served or self.reference


class CostRow(BaseModel):
    model_config = ConfigDict(extra="forbid")

    configuration: str
    draft_config: str
    skipped: str | None = None  # the engine refused this configuration
    new_tokens: int | None = None
    ended_turn: int | None = None
    decode_tokens_per_s: float | None = None
    decode_tokens_per_s_se: float | None = None
    mean_acceptance_length: float | None = None  # None: no draft
    mean_acceptance_length_se: float | None = None
    verify_steps: int | None = None
    acceptance_per_pos: list[float] | None = None
    decode_ms_per_step: float | None = None
    speedup_vs_no_speculation: float | None = None
    same_output_as_no_speculation: bool | None = None


class Cost(BaseModel):
    """What a blocked configuration would have cost (``pipeline.validate.cost``), or why not measured."""

    model_config = ConfigDict(extra="forbid")

    skipped: str | None = None
    rows: list[CostRow] = []
    prompts: int | None = None
    max_new_tokens: int | None = None
    k: int | None = None
    timing: str | None = None
    measured_by: str | None = None
    note: str | None = None


class ValidationReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    decision: Literal["pass", "block"]
    reasons: list[str]
    artifact_digest: str
    serving_key: str
    serving: dict
    engine_reads: EngineReads
    feed: Feed = Feed()
    slots: list[SlotCheck]
    identity: list[Check]
    acceptance: AcceptanceSection
    tolerances: dict
    calibration: dict  # measured errors at the matched boundaries
    provenance: dict = {}  # where the trained points come from (fingerprints, or inferred by the probe)
    cost: Cost | None = None  # blocked only
    report_dir: str | None = None
