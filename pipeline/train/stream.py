"""Streaming mode: capture actors feed training batches through Ray's object store, so the
hidden states are never stored.

The driver tokenizes the source (token counts decide the batch plan, as an offline run's
dataset index does), stores the held-out samples -- evaluation and fingerprint probes -- as a
regular dataset in the run's ``data/``, whose manifest also counts every streamed row. Each
training worker then keeps its next ``in_flight`` batches being captured on the capture actors
(:class:`FeedStream`) and takes them in plan order. A streamed batch is what the offline
reader decodes from Parquet, bit for bit: the same samples in the same order, the values
rounded to the same stored dtype, the same layout (packed or padded). Capture actors that die
are restarted by Ray and their batch captured again (capture is deterministic); a trainer that
dies resumes from its checkpoint, and its stream starts from that step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import accumulate, pairwise

import numpy as np
import torch
import yaml
from tqdm import tqdm

from pipeline import conventions
from pipeline.cluster import stalled
from pipeline.data.source import scan_source
from pipeline.engines import engine_ref
from pipeline.extract import layout
from pipeline.extract.job import build_schema, check_plan, run_extract
from pipeline.extract.pool import CaptureActor, CapturePool
from pipeline.extract.worker import tokenize_unit
from pipeline.fingerprint import probe_ids
from pipeline.identity import target_identity
from pipeline.store.encoding import bits_to_torch, join_planes
from pipeline.store.reader import ProvenanceMismatch
from pipeline.store.writer import SampleMeta
from pipeline.train import stream_cache
from pipeline.train.data import Batch, BatchArrays, split_eval, to_batch
from schemas.config import ConfigError, validate_config
from schemas.extract import ExtractConfig
from schemas.manifest import DatasetManifest
from schemas.train import TrainConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamSample:
    """A training sample of a streaming run, as the batch plan needs it (its position in the plan's
    list is its position among the run's training samples, source order)."""

    tokens: int
    sample_id: str


def extract_config(cfg: TrainConfig) -> ExtractConfig:
    """The extraction config ``data.stream`` names, writing its held-out data to the run's ``data/``."""
    assert cfg.data is not None
    try:
        with open(cfg.data.stream) as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"data.stream: extraction config {cfg.data.stream} does not exist") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"data.stream: {cfg.data.stream} is not a mapping of extraction settings")
    given = (raw.get("output") or {}).get("uri")
    if given and given != cfg.stream_data:
        log.info(
            "%s: output.uri %s is not used: a streaming run stores its held-out data in %s",
            cfg.data.stream,
            given,
            cfg.stream_data,
        )
    raw = {
        **raw,
        "output": {**(raw.get("output") or {}), "uri": cfg.stream_data},
        "s3": raw.get("s3") or cfg.s3.model_dump(),
    }
    return validate_config(raw, ExtractConfig, where=f"data.stream ({cfg.data.stream})")


class StreamCaptureActor(CaptureActor):
    """A capture actor that also captures training batches for the workers' :class:`FeedStream`."""

    def capture_batch(
        self,
        ids: list[np.ndarray],
        masks: list[np.ndarray],
        sample_ids: list[str],
        aux: list[str],
        final: str,
        packed: bool,
        keep: dict | None = None,
    ) -> dict:
        """The batch ``train.data.load_batch`` decodes from Parquet, for these samples: values
        rounded to the stored dtype, laid out the same. ``keep`` (a first-epoch batch of a run with
        ``data.cache``): the cache, the shard to write and the samples' source records."""
        worker = self.worker
        engine = worker.writer().engine
        dtype = worker.cfg.engine.dtype
        lengths = [len(x) for x in ids]
        out = BatchArrays(lengths, packed)
        kept: list = [None] * len(ids)
        for group in engine.plan_batches(lengths):
            cb = engine.capture([ids[i].tolist() for i in group])
            spans = pairwise(accumulate(cb.lengths, initial=0))  # each sample's tokens in the packed row
            for i, (lo, hi) in zip(group, spans, strict=True):
                vals = {
                    p: bits_to_torch(join_planes(list(cb.planes[p][:, lo:hi])), dtype).float().numpy()
                    for p in [*aux, final]
                }
                out.put(i, ids[i], masks[i], np.concatenate([vals[p] for p in aux], axis=-1), vals[final])
                if keep is not None:
                    kept[i] = {p: v[:, lo:hi] for p, v in cb.planes.items()}
        if keep is not None:
            metas = [
                SampleMeta(sid, keep["source_uri"], row, sha, x.tolist(), m.astype(np.uint8).tolist())
                for sid, row, sha, x, m in zip(sample_ids, keep["source_rows"], keep["sha256"], ids, masks, strict=True)
            ]
            samples = list(zip(metas, kept, strict=True))
            stream_cache.write_shard(keep["uri"], keep["s3"], keep["path"], worker.schema, samples)
        return {**out.d, "sample_ids": list(sample_ids)}


@dataclass
class Streamed:
    """What the driver prepared before training: the held-out dataset, the training samples and
    the capture actors that will stream them."""

    xcfg: ExtractConfig
    manifest: DatasetManifest
    samples: list[SampleMeta]  # every tokenized sample, source order
    train: list[SampleMeta]
    pool: CapturePool

    def train_refs(self) -> list[StreamSample]:
        return [StreamSample(len(s.input_ids), s.sample_id) for s in self.train]

    def token_masks(self) -> Iterator[tuple]:
        """(input_ids, loss_mask) of every sample, as the draft vocabulary counts them."""
        for s in self.samples:
            yield torch.tensor(s.input_ids, dtype=torch.long), torch.tensor(s.loss_mask, dtype=torch.bool)

    def record(self, cfg: TrainConfig) -> dict:
        """What the run's ``run.json`` says about the stream."""
        t = self.manifest.totals
        return {
            "config": cfg.data.stream,  # type: ignore[union-attr]
            "in_flight": cfg.data.in_flight,  # type: ignore[union-attr]
            "extraction": self.manifest.extraction,
            "data": cfg.stream_data,
            "dataset_id": self.manifest.dataset_id,
            "rows": {"input": t.input_rows, "streamed": t.streamed, "stored": t.rows, "quarantined": t.quarantined},
            "streamed_tokens": t.streamed_tokens,
            "cache": cfg.data.cache,  # type: ignore[union-attr]
        }

    def close(self, graceful: bool = True) -> None:
        self.pool.close(graceful)


def check_final(cfg: TrainConfig, xcfg: ExtractConfig, n: int) -> None:
    """A stream must capture a final state its engine can capture: training's targets are the
    target's LM head on it. (Before any actor starts: offline, a dataset without one is refused
    only when training reads it.)"""
    finals = [p for p in xcfg.capture if p.kind == "final" or conventions.boundary(p, n) == n]
    if any(xcfg.engine.name == "hf" or engine_ref(xcfg, p, n).native_id is not None for p in finals):
        return
    why = (
        f"engine {xcfg.engine.name} cannot capture {', '.join(map(str, finals))}"
        if finals
        else "its capture list has no final:post_norm or final:pre_norm"
    )
    fix = (
        "; SGLang's capture ends at the last layer's input, so stream with engine hf or vllm"
        if xcfg.engine.name == "sglang"
        else "; add final:post_norm (or final:pre_norm) to its capture list"
    )
    raise ConfigError(
        f"data.stream {cfg.data.stream}: a streaming run needs the target's final state, whose LM-head "  # type: ignore[union-attr]
        f"distribution is what the draft learns, but {why}{fix}"
    )


def start(cfg: TrainConfig, xcfg: ExtractConfig, progress: bool = True) -> Streamed:
    """Tokenize the source, start the capture actors and store the held-out samples with them."""
    identity = target_identity(xcfg.target.path, xcfg.target.name, xcfg.target.revision)
    trained = target_identity(cfg.target.path, cfg.target.name, cfg.target.revision)
    diff = trained.differences(identity)
    if diff:
        raise ProvenanceMismatch(
            f"data.stream {cfg.data.stream} captures {identity.describe()}, but the run trains for "  # type: ignore[union-attr]
            f"{trained.describe()}; differs in: {'; '.join(diff)}"
        )
    check_final(cfg, xcfg, identity.num_layers)
    check_plan(xcfg, identity)
    scan = scan_source(xcfg.source.uri, xcfg.source.format, xcfg.s3)
    if not scan.rows:
        raise ConfigError(f"data.stream: source.uri {xcfg.source.uri} has no rows: nothing to train on")
    units = layout.plan_units(len(scan.rows), xcfg.output.rows_per_shard)
    samples: list[SampleMeta] = []
    for u in tqdm(units, desc="tokenize", unit="unit", disable=not progress):
        samples += tokenize_unit(xcfg, u.unit, u.start, [r.data for r in scan.rows[u.start : u.end]]).samples
    probes = frozenset(probe_ids([s.sample_id for s in samples], xcfg.fingerprint.probe_samples))
    train, held = split_eval(samples, cfg.eval_fraction, probes)  # type: ignore[arg-type]
    log.info(
        "stream: %d source rows, %d samples: %d to stream into training, %d held out (stored in %s)",
        len(scan.rows),
        len(samples),
        len(train),
        len(held),
        cfg.stream_data,
    )
    schema, _ = build_schema(xcfg, identity)
    pool = CapturePool(xcfg, schema, xcfg.ray.num_actors, True, actor_cls=StreamCaptureActor)
    try:
        manifest = run_extract(xcfg, progress, True, keep={s.source_row for s in held}, pool=pool)
    except BaseException:
        pool.close(graceful=False)
        raise
    if manifest.totals.streamed != len(train):
        pool.close(graceful=False)
        raise RuntimeError(
            f"{cfg.stream_data}: its manifest counts {manifest.totals.streamed} streamed rows, the driver "
            f"planned {len(train)}: it was written for another split (delete it to write it again)"
        )
    return Streamed(xcfg, manifest, samples, train, pool)  # type: ignore[arg-type]


@dataclass
class StreamSource:
    """What a training worker needs to stream its batches: the capture actors, and every training
    sample's tokens in the object store (one copy per node, read in place by the workers)."""

    actors: list
    # ObjectRef of {"ids": int32[sum T], "mask": bool[sum T], "offsets": int64[N + 1], "sample_ids", ...}
    tokens: object
    aux: list[str]
    final: str
    in_flight: int
    packed: bool
    cache: stream_cache.CacheSpec | None = None


def source_of(streamed: Streamed, plan, cfg: TrainConfig, epoch0: list[list[list[int]]]) -> StreamSource:
    """The workers' stream; with ``data.cache``, the cache checked (or marked) as this stream's
    for the first epoch's batches ``epoch0`` (steps x workers x sample indices)."""
    import ray

    lengths = [len(s.input_ids) for s in streamed.train]
    tokens = {
        "ids": np.concatenate([np.asarray(s.input_ids, np.int32) for s in streamed.train]),
        "mask": np.concatenate([np.asarray(s.loss_mask, np.bool_) for s in streamed.train]),
        "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        "sample_ids": [s.sample_id for s in streamed.train],
        "source_uri": streamed.xcfg.source.uri,  # what a cached shard records of each sample
        "source_rows": [s.source_row for s in streamed.train],
        "sha256": [s.content_sha256 for s in streamed.train],
    }
    assert cfg.data is not None
    cache = None
    if cfg.data.cache:
        ids = tokens["sample_ids"]
        cache = stream_cache.claim(
            cfg.data.cache, cfg.s3, streamed.manifest, [[[ids[i] for i in idx] for idx in step] for step in epoch0]
        )
    return StreamSource(
        streamed.pool.actors, ray.put(tokens), plan.aux, plan.final, cfg.data.in_flight, cfg.packing, cache
    )


class FeedStream:
    """A training worker's batches for global steps ``[start, end)``: it keeps its next
    ``source.in_flight`` steps queued -- on the capture actors, or read from the cache when a run
    keeps one -- never more, the bound that keeps memory flat however large the source, and takes
    them in plan order. The worker owns what it asks for, so a batch leaves the object store as
    soon as it is copied out (Ray frees a borrowed object only about a second after its last reader
    lets go: dozens of batches at the tiny sizes CI trains). Each batch is checked to hold exactly
    the samples the plan gives its step."""

    def __init__(
        self,
        source: StreamSource,
        rank: int,
        start: int,
        end: int,
        plan_step,
        stall_timeout_s: float | None,
        epoch0: list[list[list[int]]] | None = None,
    ):
        self.source, self.rank, self.start, self.end = source, rank, start, end
        self.plan_step, self.timeout = plan_step, stall_timeout_s or None
        self.cache = None
        if source.cache is not None:
            assert epoch0 is not None, "a cached stream needs the first epoch's plan (where each sample is kept)"
            self.cache = stream_cache.CacheReader(source.cache, epoch0, [*source.aux, source.final])
        self.wait_s = 0.0
        self.captured = self.from_cache = 0  # batches of each kind taken

    def _submit(self, tokens: dict, step: int, reads: ThreadPoolExecutor) -> tuple[str, object]:
        idx = self.plan_step(step)
        off = tokens["offsets"]
        sample_ids = [tokens["sample_ids"][i] for i in idx]
        if self.cache is not None and self.cache.has(idx):
            lengths = [int(off[i + 1] - off[i]) for i in idx]
            src = self.source
            return "cache", reads.submit(self.cache.read, idx, lengths, sample_ids, src.aux, src.final, src.packed)
        keep = None
        if self.cache is not None and step < self.source.cache.steps:  # type: ignore[union-attr]
            keep = {  # where to write it (not the manifest: the actor writes the schema it captures with)
                "uri": self.source.cache.uri,  # type: ignore[union-attr]
                "s3": self.source.cache.s3,  # type: ignore[union-attr]
                "path": stream_cache.shard_path(step, self.rank),
                "source_uri": tokens["source_uri"],
                "source_rows": [tokens["source_rows"][i] for i in idx],
                "sha256": [tokens["sha256"][i] for i in idx],
            }
        actors = self.source.actors
        actor = actors[(step + self.rank) % len(actors)]  # consecutive steps, and ranks at one step, differ
        ref = actor.capture_batch.remote(
            [tokens["ids"][off[i] : off[i + 1]] for i in idx],
            [tokens["mask"][off[i] : off[i + 1]] for i in idx],
            sample_ids,
            self.source.aux,
            self.source.final,
            self.source.packed,
            keep,
        )
        return "capture", ref

    def _take(self, step: int, kind: str, pending) -> dict:
        import ray

        if kind == "cache":
            self.from_cache += 1
            return pending.result()
        try:
            d = ray.get(pending, timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            raise stalled(
                f"train: rank {self.rank}'s streamed batch for step {step}",
                self.timeout,
                "the capture actors may have lost their CPUs/GPUs; free them or raise stall_timeout_s, then "
                "rerun with resume: latest",
            ) from None
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(
                f"a capture actor streaming step {step} is gone ({str(e).splitlines()[0]}; Ray restarts one "
                "that dies a few times); rerun with resume: latest to continue from the last checkpoint"
            ) from None
        self.captured += 1
        return d

    def __iter__(self) -> Iterator[tuple[int, Batch]]:
        import ray

        tokens = ray.get(self.source.tokens)
        queued: dict[int, tuple[str, object]] = {}
        with ThreadPoolExecutor(1, thread_name_prefix="stream-cache") as reads:
            for step in range(self.start, self.end):
                t0 = time.perf_counter()
                for s in range(step, min(step + self.source.in_flight, self.end)):
                    if s not in queued:
                        queued[s] = self._submit(tokens, s, reads)
                d = self._take(step, *queued.pop(step))
                want = [tokens["sample_ids"][i] for i in self.plan_step(step)]
                if d["sample_ids"] != want:
                    raise RuntimeError(
                        f"streamed batch for step {step} on rank {self.rank} holds samples {d['sample_ids'][:3]}..., "
                        f"the plan gives {want[:3]}...: refusing to train a sample twice or skip one"
                    )
                batch = to_batch({k: np.array(d[k]) for k in Batch.FIELDS})
                del d  # out of the object store now
                self.wait_s += time.perf_counter() - t0
                yield step, batch
