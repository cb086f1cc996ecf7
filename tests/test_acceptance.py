"""The one definition of acceptance (pipeline.acceptance): token-weighted chain acceptance over
prompts, and a standard error that treats prompts (not verify steps) as the independent units."""

import random

import pytest

from pipeline.acceptance import PromptCounts, from_prompts, line, standard_error
from pipeline.validate.acceptance import step_variance


def _prompt(rng: random.Random, rate: float, k: int = 3) -> PromptCounts:
    """A generation of 3-30 verify steps; each step accepts a chain of positions with ``rate``."""
    steps = rng.randint(3, 30)
    per_pos = [0] * k
    for _ in range(steps):
        j = 0
        while j < k and rng.random() < rate:
            per_pos[j] += 1
            j += 1
    return PromptCounts(steps, tuple(per_pos))


def test_counts_are_token_weighted_over_prompts():
    a, b = PromptCounts(4, (3, 2, 1)), PromptCounts(6, (0, 0, 0))
    acc = from_prompts("test", 3, [a, b])
    assert acc.verify_steps == 10 and acc.prompts == 2
    assert acc.acceptance_per_pos == [0.3, 0.2, 0.1]  # summed counts over summed steps, not a mean of rates
    assert acc.mean_acceptance_length == pytest.approx(1.6) and acc.accepted_per_step == pytest.approx(0.6)


def test_the_standard_error_is_the_spread_over_prompts():
    """On prompts whose acceptance differs (easy and hard ones), the SE matches the bootstrap's
    spread over prompts -- and is far above what counting steps as independent would claim."""
    rng = random.Random(0)
    prompts = [_prompt(rng, rng.choice([0.2, 0.8])) for _ in range(60)]
    se = standard_error(prompts)
    boot = []
    for _ in range(2000):
        sample = [rng.choice(prompts) for _ in prompts]
        boot.append(sum(c.accepted for c in sample) / sum(c.verify_steps for c in sample))
    mean = sum(boot) / len(boot)
    sd = (sum((x - mean) ** 2 for x in boot) / (len(boot) - 1)) ** 0.5
    assert se == pytest.approx(sd, rel=0.15)
    acc = from_prompts("test", 3, prompts)
    naive = (step_variance(acc.acceptance_per_pos, acc.verify_steps) / acc.verify_steps) ** 0.5
    assert se > 1.5 * naive  # steps taken as independent would understate it


def test_no_standard_error_from_a_single_prompt_and_zero_for_identical_ones():
    assert standard_error([PromptCounts(5, (2, 1, 0))]) is None
    assert standard_error([PromptCounts(5, (2, 1, 0)), PromptCounts(0, (0, 0, 0))]) is None  # one ran
    assert standard_error([PromptCounts(5, (2, 1, 0))] * 3) == 0.0
    acc = from_prompts("vllm x", 3, [PromptCounts(5, (2, 1, 0))])
    assert acc.se is None and "+-" not in line(acc) and line(acc).startswith("mean acceptance length 1.60 (k=3")
