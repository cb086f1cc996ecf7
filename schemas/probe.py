"""The probe's contract: which layers a draft was trained on, inferred from its own predictions."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.capture import CapturePoint
from schemas.config import TargetConfig
from schemas.validation import ProbeOptions, ServingConfig


class ProbeConfig(ProbeOptions):
    model_config = ConfigDict(extra="forbid")

    draft: str = Field(description="the draft directory: SpecForge/SGLang/vLLM (eagle3), speculators or Strata layout")
    target: TargetConfig | None = Field(
        None, description="the target the draft speculates for; default: serving.target"
    )
    serving: ServingConfig | None = Field(
        None,
        description="also say what this deployment feeds the draft and "
        "block when it differs from the inferred training set",
    )
    registry: str | None = Field(None, description="strata import: the registry to add the draft to")

    @model_validator(mode="after")
    def _target(self) -> ProbeConfig:
        if self.target is None:
            if self.serving is None:
                raise ValueError("give the target (target.path) or a serving section naming it")
            self.target = self.serving.target
        return self


class Candidate(BaseModel):
    points: list[CapturePoint]
    boundaries: list[str]  # r_k labels
    agreement: list[float]  # per TTT step: the draft's greedy token is the target's, on assistant tokens
    fit: list[float]  # per TTT step: minus the draft's soft cross-entropy against the target (nats per token)
    pooled_fit: float  # the same over every step's positions together: what candidates are ranked by
    why: list[str]  # how it became a candidate (a tool's reading, a shift, the search)


class ProbeReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    verdict: Literal["inferred", "inconclusive", "declared", "pass", "block"]
    summary: str
    draft: str
    layout: str
    target: str
    num_layers: int
    prompts: int
    positions: int
    claimed: dict[str, list[int]]  # config key -> ids, as written
    declared: list[CapturePoint] | None = None  # trained_on, as given
    provenance: Literal["inferred", "declared"] | None = None  # where the trained points come from; None: unknown
    best: Candidate
    runner_up: Candidate
    margin: float  # pooled fit difference, best - runner-up (nats per token)
    margin_se: float  # bootstrap standard error over prompts
    z: float
    min_margin: float  # nats per token a conclusion needs beyond z standard errors
    spread: float  # best fit minus the median candidate's (layer dependence)
    # the best set's fit minus that of the target's token frequencies: at or under 0 (z SE), the draft
    # did not learn this target and nothing is inferred
    over_frequencies: float = 0.0
    over_frequencies_se: float = 0.0
    slots: list[dict] = []  # per slot, the others held at the best set: its boundary, next best, margin
    # per slot, the boundaries the draft may have been trained on (several where a tie leaves the slot
    # open): what a deployment may feed it; None within the noise
    admissible: list[list[str]] | None = None
    evaluated: int  # candidate sets scored
    claimed_readings: list[dict]  # who reads the config how, and the draft's fit fed that
    serving: dict | None = None  # what the deployment feeds (measured or by rule) and the fix
    reasons: list[str] = []
    notes: list[str] = []
