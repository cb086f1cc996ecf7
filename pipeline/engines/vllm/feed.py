"""Record what vLLM really feeds an EAGLE-3 draft: the concatenated aux states entering its ``fc``.

vLLM's model runner hands the drafter, at every step, the target's aux hidden states for the
tokens it just ran (``propose(target_token_ids, target_positions, target_hidden_states, ...)``);
the EAGLE-3 drafter passes ``target_hidden_states`` straight to ``combine_hidden_states``, i.e.
its ``fc``. :class:`FeedRecorder` is a vLLM worker extension (``worker_extension_cls``) that
wraps the drafter's ``propose`` and writes those three tensors, per call, to a directory:
prefill steps (the prompt's tokens) and later verify steps (the last token plus the drafts
being verified, accepted or not) alike. Which boundary each slot carries is then decided from
the values (:mod:`pipeline.validate.feed`), not from any rule.

Loaded by vLLM inside its worker process (so only strings cross the RPC boundary); the
rest of Strata never imports vLLM through this module.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from pipeline.engines.feed_files import write_call

EXTENSION = "pipeline.engines.vllm.feed.FeedRecorder"


class FeedRecorder:
    """Mixed into vLLM's worker class; methods are called through ``LLM.collective_rpc``."""

    def strata_record_feed(self, out_dir: str) -> bool:
        """Start writing every ``propose`` call's draft input to ``out_dir`` (rank 0 only)."""
        drafter = getattr(self.model_runner, "drafter", None)  # type: ignore[attr-defined]
        if drafter is None:
            raise RuntimeError("this vLLM engine serves no draft: nothing to record")
        if getattr(self, "_strata_feed_dir", None) is not None:
            self._strata_feed_dir = out_dir
            return True
        self._strata_feed_dir = out_dir
        self._strata_feed_calls = itertools.count()
        original = drafter.propose
        worker = self

        def propose(*args, **kwargs):
            if worker._strata_feed_dir and _is_rank_zero(worker):
                _write_call(Path(worker._strata_feed_dir), next(worker._strata_feed_calls), kwargs)
            return original(*args, **kwargs)

        drafter.propose = propose
        return True

    def strata_feed_sync(self) -> bool:
        """Runs after every step already queued: the files of a finished request are complete."""
        return True


def _is_rank_zero(worker) -> bool:
    return getattr(worker, "rank", 0) == 0


def _write_call(out: Path, index: int, kwargs: dict) -> None:
    try:
        ids, pos, hs = kwargs["target_token_ids"], kwargs["target_positions"], kwargs["target_hidden_states"]
    except KeyError as e:
        raise RuntimeError(
            f"vLLM's drafter.propose no longer takes {e}; update pipeline/engines/vllm/feed.py"
        ) from None
    write_call(out, index, ids, pos, hs, token_offset=0)
