"""SGLang engine: capture, greedy decoding and EAGLE-3 serving through SGLang's own HTTP server.

Every SGLang server is a separate process group started from SGLang's environment
(:mod:`pipeline.engines.sglang.server`); nothing here imports SGLang.

Capture: SGLang captures aux states only for an EAGLE-3 draft, at the ids its nested
``eagle_config.eagle_aux_hidden_state_layer_ids`` names, read by the model file's own rule
(llama/qwen: o-labels; deepseek_v2: +1 only when the first id is 1; gpt-oss: boundaries when
the list reaches N). Strata serves a stub draft whose config carries exactly the ids for the
wanted points (written by ``conventions`` through the draft export) and records, with its
recorder draft class (``models``), the aux rows SGLang hands that draft on each prompt's
prefill: ``[T, n_ids * H]``, slot-major in ascending layer order. It is the same path that
measures a served draft's feed, so capture and the gate's measurement cannot disagree on what
SGLang hands over.

Without a rule for the installed release (or the target's architecture) no id list is known to
make SGLang capture a given boundary, so capture goes to a ``reference`` engine (HF transformers
on the same weights) and SGLang only serves: the measured feed is then matched against the
reference's boundaries, within the same bf16 tolerance the capture test holds SGLang to.

Serving: one server per draft configuration, with the recorder; acceptance from SGLang's
per-request ``meta_info`` (``spec_verify_ct``, ``spec_num_correct_drafts``, the histogram of
accepted drafts per verify step), reconciled with the tokens it emitted.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from pipeline import conventions
from pipeline.acceptance import PromptCounts, from_prompts, summary
from pipeline.draft.export import export_draft
from pipeline.draft.model import DraftConfig, Eagle3Draft
from pipeline.engines.base import ServeResult, TargetEngine
from pipeline.engines.errors import EngineError
from pipeline.engines.feed_files import FeedCall, take_calls
from pipeline.engines.packing import pack_by_tokens
from pipeline.engines.refs import sglang_engine_ref, sglang_release
from pipeline.engines.sglang.server import SGLangServer, require_install
from pipeline.identity import target_config, target_identity
from schemas.acceptance import Acceptance
from schemas.capture import CapturePoint
from schemas.provenance import EngineRef


def can_capture(point: CapturePoint, num_layers: int, family: str, version: str = conventions.NEWEST) -> bool:
    return conventions.native_id(point, "sglang", num_layers, family, sglang_release(version)) is not None


def acceptance_from_meta(meta_infos: list[dict], outputs: list[list[int]], k: int) -> Acceptance:
    """SGLang's per-request speculative counters, summed and reconciled with the emitted tokens.

    Measured on SGLang 0.5.18: the prefill emits one token, then each verify step emits the drafts
    it accepted plus one target token, so per request ``completion_tokens = 1 + spec_verify_ct +
    spec_num_correct_drafts`` -- less when the last step's accepted drafts ran past
    ``max_new_tokens`` or the end of the turn (by at most k). SGLang's own ``spec_accept_length``
    is completion_tokens / spec_verify_ct, which counts the prefill's token too; the mean
    acceptance length here is 1 + accepted / steps, as vLLM's counters give it. Counters that do
    not reconcile are an error, not a number.
    """
    counts: list[PromptCounts | None] = []
    for i, (m, out) in enumerate(zip(meta_infos, outputs, strict=True)):
        v, a, c = int(m.get("spec_verify_ct", 0)), int(m.get("spec_num_correct_drafts", 0)), int(m["completion_tokens"])
        if v == 0:
            raise EngineError(f"SGLang reported spec_verify_ct = 0 for request {i}: speculative decoding did not run")
        if c != len(out) or not 0 <= 1 + v + a - c <= k:
            raise EngineError(
                f"SGLang's counters for request {i} do not reconcile: {len(out)} tokens emitted, "
                f"completion_tokens {c}, 1 + spec_verify_ct {v} + spec_num_correct_drafts {a}"
            )
        h = m.get("spec_correct_drafts_histogram") or m.get("spec_accept_histogram")
        if h is not None and (sum(h) != v or sum(j * x for j, x in enumerate(h)) != a or len(h) > k + 1):
            raise EngineError(
                f"SGLang's histogram of accepted drafts for request {i} ({h}) does not add up to "
                f"{v} verify steps and {a} accepted drafts"
            )
        # accepted at position j (0-based): the steps that accepted more than j drafts
        counts.append(PromptCounts(v, tuple(sum(h[j + 1 :]) for j in range(k))) if h is not None else None)
    reported = [float(m["spec_accept_length"]) for m in meta_infos if "spec_accept_length" in m]
    extra = {
        "emitted_tokens": sum(map(len, outputs)),
        "sglang_spec_accept_length": sum(reported) / len(reported) if reported else None,
    }
    by = "sglang meta_info (spec_verify_ct, spec_num_correct_drafts, histogram)"
    if all(c is not None for c in counts):
        return from_prompts(by, k, counts, **extra)
    steps = sum(int(m["spec_verify_ct"]) for m in meta_infos)
    return summary(by, k, steps, None, accepted=sum(int(m["spec_num_correct_drafts"]) for m in meta_infos), **extra)


def _sorted_rows(calls: list[FeedCall], length: int, width: int) -> torch.Tensor:
    """The prefill's aux rows for positions 0..length-1, from the recorder's calls."""
    rows: dict[int, torch.Tensor] = {}
    for c in calls:
        for j, p in enumerate(c.positions.tolist()):
            if p < length and p not in rows:
                rows[p] = c.aux[j]
    if len(rows) != length or any(r.numel() != width for r in rows.values()):
        raise EngineError(
            f"SGLang handed the capture draft {len(rows)} prefill rows of the {length} submitted "
            f"(width {next(iter(rows.values())).numel() if rows else 0}, expected {width})"
        )
    return torch.stack([rows[p] for p in range(length)])


class SGLangEngine(TargetEngine):
    """The target in SGLang servers: one with a capture draft for the configured points (started
    here; none when a ``reference`` engine captures), one target-only for greedy references
    (started on first use), and one per served draft configuration (started and stopped by
    ``serve_draft``)."""

    name = "sglang"

    def __init__(
        self,
        model_dir: str | Path,
        points: list[CapturePoint],
        dtype: str = "bfloat16",
        tp_size: int = 1,
        family: str | None = None,
        batch_tokens: int = 16384,
        max_model_len: int = 2048,
        reference: TargetEngine | None = None,
    ):
        self.version = require_install().version
        self.reference = reference
        self.model_dir = str(model_dir)
        self.dtype, self.tp_size, self.batch_tokens, self.max_model_len = dtype, tp_size, batch_tokens, max_model_len
        ident = target_identity(model_dir)
        self.num_layers, self.hidden_size = ident.num_layers, ident.hidden_size
        self._dir = Path(tempfile.mkdtemp(prefix="strata-sglang-"))
        self._plain: SGLangServer | None = None
        self._capture: SGLangServer | None = None
        if reference is not None:  # no rule: the reference captures, SGLang serves
            self.family = family or "unknown"
            self.points = list(reference.points)
            return
        tcfg = target_config(model_dir)
        self.family = conventions.engine_family("sglang", tcfg, family)
        self.points = [p.validate_for(self.num_layers) for p in points]
        release = sglang_release(self.version)
        cannot = [str(p) for p in self.points if not can_capture(p, self.num_layers, self.family, release)]
        if cannot:
            raise EngineError(f"SGLang {self.version} ({self.family}) cannot capture {', '.join(cannot)}")
        self.order = sorted(self.points, key=lambda p: conventions.sort_key(p, self.num_layers))
        stub = Eagle3Draft(DraftConfig.from_target(tcfg, len(self.order), tcfg.get("vocab_size", 32000)))
        export_draft(
            stub,
            self._dir / "capture-draft",
            "sglang",
            self.order,
            ident,
            family=self.family,
            dtype="bfloat16",
            release=release,
        )
        try:
            self._capture = SGLangServer(
                model_dir,
                dtype,
                tp_size,
                draft_dir=self._dir / "capture-draft",
                k=1,
                feed_dir=self._dir / "capture-feed",
                max_model_len=max_model_len,
            ).start()
        except BaseException:
            self.close()
            raise

    @property
    def process_groups(self) -> list[int]:
        """The process groups of the servers this engine keeps running (capture, greedy)."""
        return [s.proc.pid for s in (self._capture, self._plain) if s is not None and s.proc is not None]

    def engine_ref(self, point: CapturePoint) -> EngineRef:
        if self.reference is not None:
            return self.reference.engine_ref(point)
        return sglang_engine_ref(point, self.num_layers, self.family, self.version, self.tp_size)

    def plan_batches(self, lengths: list[int]) -> list[list[int]]:
        return pack_by_tokens(lengths, self.batch_tokens)

    def _check_lengths(self, sequences: list[list[int]], new: int) -> None:
        too_long = [len(s) for s in sequences if len(s) + new > self.max_model_len]
        if too_long:
            raise EngineError(
                f"sequence of {max(too_long)} tokens (+{new} generated) exceeds SGLang's context "
                f"length {self.max_model_len}; raise engine.max_model_len"
            )

    def capture_tensors(self, sequences: list[list[int]]) -> dict[str, list[torch.Tensor]]:
        """Per point, one [T, H] tensor per sequence, in input order: the rows SGLang handed the
        capture draft on each sequence's prefill (one request at a time, so rows cannot mix); the
        reference engine's capture where there is one."""
        if self.reference is not None:
            return self.reference.capture_tensors(sequences)
        self._check_lengths(sequences, 1)
        per_point: dict[str, list[torch.Tensor]] = {str(p): [] for p in self.points}
        width = len(self.order) * self.hidden_size
        take_calls(self._capture.feed_dir)  # nothing left from an earlier request
        for seq in sequences:
            self._capture.generate([seq], 1)
            states = _sorted_rows(take_calls(self._capture.feed_dir), len(seq), width)
            states = states.view(len(seq), len(self.order), self.hidden_size)
            for slot, p in enumerate(self.order):
                per_point[str(p)].append(states[:, slot].to(torch.bfloat16))
        return per_point

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        self._check_lengths(prompts, max_new_tokens)
        if self._plain is None:
            self._plain = SGLangServer(
                self.model_dir, self.dtype, self.tp_size, max_model_len=self.max_model_len
            ).start()
        return [list(o["output_ids"]) for o in self._plain.generate(prompts, max_new_tokens)]

    def serve_draft(self, draft_dir, prompts, max_new_tokens, k, feed_points=None) -> ServeResult:
        """SGLang's EAGLE-3 with the draft's config exactly as written (``feed_points`` is ignored:
        SGLang reads the config by its own rules), one prompt at a time, with the draft's fc input
        recorded per prompt."""
        self._check_lengths(prompts, max_new_tokens)
        feed_dir = Path(tempfile.mkdtemp(prefix="feed-", dir=self._dir))
        outs, calls = [], []
        try:
            with SGLangServer(
                self.model_dir,
                self.dtype,
                self.tp_size,
                draft_dir=draft_dir,
                k=k,
                feed_dir=feed_dir,
                max_model_len=self.max_model_len,
            ) as server:
                for p in prompts:
                    outs += server.generate([p], max_new_tokens)
                    calls.append(take_calls(feed_dir))
        finally:
            shutil.rmtree(feed_dir, ignore_errors=True)
        tokens = [list(o["output_ids"]) for o in outs]
        return ServeResult(tokens, acceptance_from_meta([o["meta_info"] for o in outs], tokens, k), calls)

    def close(self) -> None:
        for server in (getattr(self, "_capture", None), getattr(self, "_plain", None)):
            if server is not None:
                server.close()
        self._capture = self._plain = None
        if getattr(self, "reference", None) is not None:
            self.reference.close()
        shutil.rmtree(self._dir, ignore_errors=True)
