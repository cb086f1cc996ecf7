"""One EAGLE-3 engine's own spec-decode counters, fed through vLLM's stat-logger interface.

vLLM's Prometheus registry is one per process and every engine started replaces the previous
one's metrics there, so an older engine read through ``LLM.get_metrics()`` looks as if it had
accepted nothing. A logger attached to the engine itself sees exactly that engine's scheduler
stats, whatever starts after it; validation and the cost table then never restart an engine to
read it. Where a vLLM release has no such hook, :func:`attach` says so and the caller falls back
to the process-wide metrics (and their one-engine limit).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

# The names vLLM's metrics carry: the counts below are reported under them (pipeline.engines.vllm.engine).
NUM_DRAFTS = "vllm:spec_decode_num_drafts"
NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
NUM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def _logger_class():
    from vllm.v1.metrics.loggers import AggregateStatLoggerBase

    class SpecCounters(AggregateStatLoggerBase):
        """Running totals of the spec-decode stats the scheduler reports with each step."""

        def __init__(self, vllm_config=None, engine_indexes: list[int] | None = None, k: int = 0):
            self.totals = {NUM_DRAFTS: 0, NUM_DRAFT_TOKENS: 0, NUM_ACCEPTED: 0}
            self.per_pos = [0] * k

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            s = getattr(scheduler_stats, "spec_decoding_stats", None)
            if s is None:
                return
            self.totals[NUM_DRAFTS] += s.num_drafts
            self.totals[NUM_DRAFT_TOKENS] += s.num_draft_tokens
            self.totals[NUM_ACCEPTED] += s.num_accepted_tokens
            for pos, n in enumerate(s.num_accepted_tokens_per_pos):
                self.per_pos[pos] += n

        def log_engine_initialized(self) -> None:
            pass

        def snapshot(self) -> dict[str, list[int] | int]:
            return {**self.totals, ACCEPTED_PER_POS: list(self.per_pos)}

    return SpecCounters


def attach(llm, k: int):
    """A counter fed by this ``LLM``'s own stats, or None where this vLLM has no logger list to join."""
    loggers = getattr(getattr(getattr(llm, "llm_engine", None), "logger_manager", None), "stat_loggers", None)
    if not isinstance(loggers, list):
        log.warning(
            "this vLLM release takes no per-engine stat logger: its spec-decode counters are read from the "
            "process-wide metrics, which only the newest engine in a process keeps"
        )
        return None
    counters = _logger_class()(k=k)
    loggers.append(counters)
    return counters
