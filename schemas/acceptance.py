"""How acceptance is measured (``pipeline.acceptance`` defines the quantity): the defaults that
training's held-out check, validation and the cost table share, so that for one draft and one
configuration their figures are the same measurement and agree within their noise."""

PROMPTS = 32  # held-out probe samples, each cut at the start of its first assistant turn (short
# answers give few verify steps per prompt: the noise is over prompts)
MAX_NEW_TOKENS = 32  # the cap; generation stops earlier at the target's end of turn
SPECULATIVE_TOKENS = 3
