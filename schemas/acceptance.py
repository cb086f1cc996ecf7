"""How acceptance is measured (``pipeline.acceptance`` defines the quantity): the defaults that
training's held-out check, validation and the cost table share, so that for one draft and one
configuration their figures are the same measurement and agree within their noise."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

PROMPTS = 32  # held-out probe samples, each cut at the start of its first assistant turn (short
# answers give few verify steps per prompt: the noise is over prompts)
MAX_NEW_TOKENS = 32  # the cap; generation stops earlier at the target's end of turn
SPECULATIVE_TOKENS = 3


class Acceptance(BaseModel):
    """One acceptance measurement, as every engine and Strata's reference decoding report it."""

    model_config = ConfigDict(extra="forbid")

    measured_by: str
    k: int  # draft tokens per verify step
    verify_steps: int
    prompts: int | None = None  # None: the engine exposes totals only (no standard error)
    accepted_per_step: float
    mean_acceptance_length: float  # 1 + accepted_per_step: tokens one verify step emits
    se: float | None = None  # over prompts
    acceptance_per_pos: list[float] | None = None
    lossless: bool | None = None  # the output equals the same engine's target-only greedy decoding
    emitted_tokens: int | None = None  # SGLang's counters, reconciled with the tokens it emitted
    sglang_spec_accept_length: float | None = None
    draft_tokens: int | None = None  # vLLM's counters


class HeldoutAcceptance(Acceptance):
    """Training's measurement on held-out prompts (``final_metrics.json``, carried into the artifact).
    Fields later releases add are ignored when an older record is read, and the reverse."""

    model_config = ConfigDict(extra="ignore")

    kind: Literal["heldout_acceptance"] = "heldout_acceptance"
    prompt_sample_ids: list[str] = []
    max_new_tokens: int | None = None
    predicted_accepted_per_step: float | None = None
    step: int | None = None
