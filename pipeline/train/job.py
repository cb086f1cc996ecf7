"""Driver side of training: check the data, build the draft vocab and the plan, launch
DeepSpeed workers with Ray Train, then export the draft for each serving engine."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from pipeline import conventions, placement
from pipeline.cluster import init_ray, require_resources, stalled
from pipeline.conventions import releases
from pipeline.draft.export import WEIGHTS, ExportError, serving_ids
from pipeline.draft.model import DraftConfig
from pipeline.draft.vocab import build_draft_vocab, count_trained_tokens
from pipeline.fingerprint import Fingerprints
from pipeline.identity import target_config, target_identity
from pipeline.stopwatch import Stopwatch
from pipeline.store.fs import (
    atomic_write_bytes,
    join,
    read_bytes,
    resolve,
)
from pipeline.store.reader import DatasetReader, ProvenanceMismatch, index_samples
from pipeline.train import checkpoint, heldout, stream
from pipeline.train.data import split_eval
from pipeline.train.export import RUN_FILE, export_family, export_run
from pipeline.train.loop import FINAL_METRICS, epoch_plans, train_worker
from pipeline.train.plan import RunPlan
from pipeline.train.trainer import import_deepspeed
from schemas.artifact import ARTIFACT_MANIFEST, DraftArtifactManifest
from schemas.capture import CapturePoint
from schemas.extract import ExtractConfig
from schemas.manifest import MANIFEST_NAME
from schemas.train import TrainConfig

log = logging.getLogger(__name__)


def choose_points(reader: DatasetReader, cfg: TrainConfig) -> tuple[list[CapturePoint], CapturePoint, bool]:
    """(aux slots in ascending order, the final point, whether it still needs the final norm)."""
    n = reader.manifest.target.num_layers
    have = list(reader.manifest.capture_points)
    finals = [p for p in have if p.kind == "final"]
    post = [p for p in finals if p.norm == "post"]
    if post:
        final, needs_norm = post[0], False
    elif finals or any(conventions.boundary(p, n) == n for p in have):
        final, needs_norm = next(p for p in have if conventions.boundary(p, n) == n), True
    else:
        raise ProvenanceMismatch(
            f"dataset {reader.uri} has no final state (final:post_norm or final:pre_norm): the training targets "
            f"come from the target's LM head on it; it holds {[str(p) for p in have]}"
        )
    if cfg.aux is not None:
        aux = list(cfg.aux)
        missing = [str(p) for p in aux if p not in have]
        if missing:
            raise ProvenanceMismatch(
                f"dataset {reader.uri} lacks the configured aux points {missing}; it holds {[str(p) for p in have]}"
            )
    else:
        aux = [p for p in have if p.kind != "final" and conventions.boundary(p, n) != n]
    if not aux:
        raise ProvenanceMismatch(f"dataset {reader.uri} has no residual-stream points to train on")
    ordered = sorted(aux, key=lambda p: conventions.sort_key(p, n))
    return ordered, final, needs_norm


def check_servable(cfg: TrainConfig, aux: list[CapturePoint], n: int, target_cfg: dict) -> None:
    """Before any training: every engine the run exports for can load and feed this draft."""
    for engine in cfg.export.engines:
        family = export_family(cfg, engine, target_cfg)
        release = cfg.export.engine_versions.get(engine, conventions.NEWEST)
        try:
            ids = serving_ids(aux, n, engine, family, release)
        except ExportError as e:
            raise ProvenanceMismatch(
                f"refusing to train a draft that export.engines cannot serve: {e}. Change the "
                "aux points or drop that engine from export.engines"
            ) from None
        log.info(
            "servable by %s %s (%s ids %s); %d-slot drafts load in %s",
            engine,
            release if release != conventions.NEWEST else "(newest known)",
            family,
            ids,
            len(aux),
            ", ".join(releases.servable_by(len(aux))),
        )


def prepare(cfg: TrainConfig, streamed: stream.Streamed | None = None) -> RunPlan:
    """The run plan. A streaming run's ``cfg.dataset`` is its held-out data, and ``streamed``
    holds the samples it trains on."""
    identity = target_identity(cfg.target.path, cfg.target.name, cfg.target.revision)
    reader = DatasetReader(cfg.dataset, cfg.s3, expect_target=identity)
    if reader.manifest.totals.streamed and streamed is None:
        raise ProvenanceMismatch(
            f"dataset {cfg.dataset} is a streaming run's held-out data: the {reader.manifest.totals.streamed} "
            "rows it was trained on were streamed, not stored. Train on it with data.stream (its extraction "
            "config), or extract the source to a dataset"
        )
    log.info("verifying %d shards of %s", len(reader.shards), reader.manifest.dataset_id)
    reader.verify_all()  # missing shard, checksum failure, mixed provenance -> raises, naming the shard
    aux, final, needs_norm = choose_points(reader, cfg)
    reader.points = [str(p) for p in aux] + [str(final)]
    target_cfg = target_config(cfg.target.path)
    check_servable(cfg, aux, identity.num_layers, target_cfg)
    fs, root = resolve(cfg.output, cfg.s3)
    if cfg.init_from:
        ids, d2t, t2d = warm_start_vocab(cfg, identity, aux, target_cfg)
    else:
        masks = streamed.token_masks() if streamed else _token_masks(reader)
        counts = count_trained_tokens(masks, identity.vocab_size)
        ids, d2t, t2d = build_draft_vocab(counts, cfg.draft_vocab_size)
    atomic_write_bytes(fs, join(root, "vocab.safetensors"), st_save({"ids": ids, "d2t": d2t, "t2d": t2d}))
    refs = index_samples(reader)
    probes = frozenset()
    if reader.manifest.fingerprints:  # acceptance prompts are prefixes of these: never train on them
        probes = frozenset(Fingerprints.load(cfg.dataset, cfg.s3, name=reader.manifest.fingerprints["path"]).sample_ids)
    train, held = split_eval(refs, cfg.eval_fraction, probes)
    if streamed is not None:  # everything stored is held out; training reads the stream
        assert not train, "a streaming run's held-out data holds a training sample"
        train = streamed.train_refs()
    draft = DraftConfig.from_target(target_cfg, len(aux), int(ids.numel()))
    resume = checkpoint.latest(cfg.output, cfg.s3) if cfg.resume == "latest" else None
    log.info(
        "draft: %d aux slots %s, final %s%s; vocab %d of %d; %d train / %d eval samples; %s",
        len(aux),
        [str(p) for p in aux],
        final,
        " (+target norm)" if needs_norm else "",
        ids.numel(),
        identity.vocab_size,
        len(train),
        len(held),
        f"resuming from {resume}" if resume else "from scratch",
    )
    plan = RunPlan(
        cfg=cfg.model_dump(mode="json"),
        draft=draft.to_dict(),
        aux=[str(p) for p in aux],
        final=str(final),
        final_needs_norm=needs_norm,
        train_refs=[dataclasses.asdict(r) for r in train],
        eval_refs=[dataclasses.asdict(r) for r in held],
        resume_from=resume,
        extra={
            "dataset_id": reader.manifest.dataset_id,
            "target_key": identity.key,
            "dataset_manifest_sha256": hashlib.sha256(
                read_bytes(reader.fs, join(reader.root, MANIFEST_NAME))
            ).hexdigest(),
            **({"stream": streamed.record(cfg)} if streamed else {}),
        },
    )
    run = {k: v for k, v in dataclasses.asdict(plan).items() if k not in ("train_refs", "eval_refs")}
    atomic_write_bytes(fs, join(root, RUN_FILE), json.dumps(run, indent=1).encode())
    return plan


def warm_start_vocab(cfg: TrainConfig, identity, aux: list[CapturePoint], target_cfg: dict):
    """The starting draft's vocab, after checking it can start this run (else a clear error)."""
    art = Path(cfg.init_from)  # type: ignore[arg-type]
    m = DraftArtifactManifest.model_validate_json((art / ARTIFACT_MANIFEST).read_text())
    why = []
    if m.target.key != identity.key:
        why.append(f"it was trained for target {m.target.describe()}, this run trains for {identity.describe()}")
    if [str(p) for p in m.aux_capture_points] != [str(p) for p in aux]:
        why.append(f"its aux points are {[str(p) for p in m.aux_capture_points]}, this run's {[str(p) for p in aux]}")
    shape = DraftConfig.from_target(target_cfg, len(aux), m.draft_config["draft_vocab_size"]).to_dict()
    if shape != m.draft_config:
        why.append("its draft shape differs from the one this target gives")
    if why:
        raise ValueError(f"init_from {art}: cannot warm-start from this draft: {'; '.join(why)}")
    sd = st_load((art / WEIGHTS).read_bytes())
    t2d = sd["t2d"].bool()
    ids = t2d.nonzero().flatten()
    d2t = sd["d2t"] if "d2t" in sd else torch.zeros(ids.numel(), dtype=torch.long)
    log.info("warm start from %s (%s)", art, m.content_digest[:16])
    return ids, d2t, t2d


def _token_masks(reader: DatasetReader):
    """(input_ids, loss_mask) of every sample, without decoding hidden states."""
    import pyarrow.parquet as pq

    for shard in reader.shards:
        with reader.fs.open_input_file(join(reader.root, shard.path)) as f:
            t = pq.read_table(f, columns=["input_ids", "loss_mask"])
        for ids, mask in zip(t["input_ids"], t["loss_mask"], strict=True):
            yield (
                torch.from_numpy(ids.values.to_numpy().astype("int64")),
                torch.from_numpy(mask.values.to_numpy().astype(bool)),
            )


def run_train(cfg: TrainConfig, use_ray: bool = True, progress: bool = True) -> dict:
    """Train, measure held-out acceptance, export; ``seconds`` says where the wall time went
    (also written to ``timing.json`` in the run directory and logged)."""
    clock = Stopwatch()
    xcfg = stream.extract_config(cfg) if cfg.data is not None else None
    if xcfg is not None and not use_ray:
        raise ValueError("data.stream: a streaming run captures on Ray actors; run it without --no-ray")
    if use_ray:  # before anything is written
        with clock("ray_start"):
            # Ray Train's cleanup polls the dashboard's state API; a one-worker run uses no Ray Train
            init_ray(cfg.ray_address, dashboard=cfg.num_workers > 1)
            check_resources(cfg, xcfg)
    streamed = worker = stream_source = None
    try:
        if use_ray and cfg.num_workers == 1:  # its process starts while the driver prepares
            worker = OneWorker.start(cfg)
        if xcfg is not None:
            with clock("stream_start"):  # tokenize the source, capture actors, store the held-out samples
                streamed = stream.start(cfg, xcfg, progress)
            cfg = cfg.model_copy(update={"dataset": cfg.stream_data})
        with clock("prepare"):  # verify shards, draft vocab, plan
            plan = prepare(cfg, streamed)
        plan.use_ray_data = use_ray and cfg.data_loading == "ray_data"
        plan_json = json.dumps(dataclasses.asdict(plan))
        if streamed is not None:
            stream_source = stream.source_of(streamed, plan, cfg, epoch_plans(plan, cfg, cfg.num_workers)[0][0])
        with clock("fit"):  # workers start, DeepSpeed init, the steps, checkpoints, eval
            if not use_ray:
                result = _fit_in_process(plan_json)
            elif worker is not None:
                result = worker.fit(plan_json, stream_source)
            else:
                result = _fit_on_ray(cfg, plan_json, stream_source)
        if streamed is not None:  # the capture actors' CPUs/GPUs go back before the held-out measurement
            streamed.close()
            streamed = None
        with clock("heldout_acceptance"):
            heldout.measure_and_record(cfg, plan.aux, result, use_ray, on=worker.heldout if worker else None)
    finally:
        if worker is not None:
            worker.stop()
        if streamed is not None:
            streamed.close(graceful=False)
    with clock("export"):
        manifests = export_run(cfg.output, cfg.s3)
    stages = clock.totals()
    parts = {k: v for k, v in (result.get("seconds") or {}).items() if k != "total"}  # how rank 0 spent fit
    seconds = {**stages, "fit_parts": parts}
    fs, root = resolve(cfg.output, cfg.s3)
    atomic_write_bytes(fs, join(root, TIMING_FILE), json.dumps(seconds, indent=1).encode())
    log.info(
        "where the time went: %s (fit: %s)",
        ", ".join(f"{k} {v:.1f}s" for k, v in stages.items()),
        ", ".join(f"{k} {v:.1f}s" for k, v in parts.items()),
    )
    return {"metrics": result, "exports": manifests, "seconds": seconds}


def init_single_process() -> None:
    """A distributed world of one, without a launcher: torch.distributed on an in-memory store (no
    port to pick, so none another process can take first) and the variables DeepSpeed reads."""
    import torch.distributed as dist

    for k, v in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "0",
    }.items():
        os.environ.setdefault(k, v)
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _fit_in_process(plan_json: str) -> dict:
    """Single worker, no Ray (benchmarks on a GPU box without Ray)."""
    init_single_process()
    return train_worker(plan_json, 0, 1)


def _not_placed(cfg: TrainConfig) -> Exception:
    """The workers Ray could not place within ``stall_timeout_s`` (the one actor or Ray Train's group)."""
    return stalled(
        f"train: the worker group ({cfg.num_workers} x {cfg.cpus_per_worker:g} CPU"
        f"{' + 1 GPU' if cfg.use_gpu else ''}) was not placed",
        cfg.stall_timeout_s,
        "another job may hold the CPUs; free them, lower cpus_per_worker or num_workers, or raise stall_timeout_s",
    )


def _worker_threads(cpus: float, use_gpu: bool) -> None:
    """One torch thread per CPU a CPU worker holds (Ray's OMP default counts whole CPUs)."""
    if not use_gpu:
        torch.set_num_threads(max(1, round(cpus)))


class _WorkerProcess:
    """The Ray actor a one-worker run trains in, then measures held-out acceptance in."""

    def __init__(self, cpus: float, use_gpu: bool):
        _worker_threads(cpus, use_gpu)

    def warm(self) -> bool:
        """Import the training stack and set up the one-process world while the driver prepares."""
        import_deepspeed()
        init_single_process()
        return True

    def fit(self, plan_json: str, stream_source=None) -> dict:
        init_single_process()
        return train_worker(plan_json, 0, 1, stream_source=stream_source)

    def heldout(self, cfg: TrainConfig, aux: list[str], eval_acc: list[float]) -> dict:
        return heldout.measure(cfg, aux, eval_acc)


class OneWorker:
    """A one-worker run on Ray: one actor holding the worker's CPUs (and GPU), for training and
    then the held-out measurement. Ray Train's controller and worker group add ~15 s on two cores
    (bench_train_job.py) and give one worker nothing: no rendezvous, no gang to place, and
    Strata's own checkpoints already make a rerun resume (``max_failures`` is 0 either way)."""

    def __init__(self, actor, warm, cfg: TrainConfig):
        self.actor, self._warm, self.cfg = actor, warm, cfg

    @classmethod
    def start(cls, cfg: TrainConfig) -> OneWorker:
        """Ask for the worker's process without waiting for it: it starts and imports its training
        stack (~4 s on two cores) while the driver verifies the data and builds the plan."""
        import ray

        actor = (
            ray.remote(_WorkerProcess)
            .options(num_cpus=cfg.cpus_per_worker, num_gpus=1 if cfg.use_gpu else 0, max_restarts=0)
            .remote(cfg.cpus_per_worker, cfg.use_gpu)
        )
        return cls(actor, actor.warm.remote(), cfg)

    def _placed(self) -> None:
        """Wait for the worker (``stall_timeout_s``): an actor Ray cannot place waits forever otherwise."""
        import ray

        if self._warm is None:
            return
        ready, _ = ray.wait([self._warm], timeout=self.cfg.stall_timeout_s or None)
        if not ready:
            ray.kill(self.actor)
            raise _not_placed(self.cfg)
        self._get(self._warm, "starting")
        self._warm = None

    def _get(self, ref, doing: str):
        import ray

        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as e:
            raise e.cause from e  # the worker's own error (a bad input names itself), remote traceback chained
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(
                f"the training worker died while {doing} ({str(e).splitlines()[0]}); rerun with resume: latest "
                "to continue from its last checkpoint"
            ) from None

    def fit(self, plan_json: str, stream_source=None) -> dict:
        self._placed()
        return self._get(self.actor.fit.remote(plan_json, stream_source), "training")

    def heldout(self, cfg: TrainConfig, aux: list[str], eval_acc: list[float]) -> dict:
        return self._get(self.actor.heldout.remote(cfg, aux, eval_acc), "measuring held-out acceptance")

    def stop(self) -> None:
        import ray

        ray.kill(self.actor)


def _ray_worker(config: dict) -> None:
    import ray.train

    _worker_threads(config["cpus_per_worker"], config["use_gpu"])
    ctx = ray.train.get_context()
    train_worker(
        config["plan_json"],
        ctx.get_world_rank(),
        ctx.get_world_size(),
        report=lambda m: ray.train.report(m),
        stream_source=config.get("stream_source"),
    )


TIMING_FILE = "timing.json"
WORKER_GROUP_START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"  # Ray Train 2.x's own setting
DECODE_TASK_CPUS = 0.25  # each Ray Data decode task feeding the workers (train.data.BatchStream)


def check_resources(cfg: TrainConfig, xcfg: ExtractConfig | None = None) -> None:
    """The workers (and with ray_data loading, at least one decode task; streaming, the capture
    actors, which run alongside them) must fit the cluster -- one plan, checked before anything
    starts."""
    worker = {"CPU": cfg.cpus_per_worker, **({"GPU": 1.0} if cfg.use_gpu else {})}
    decode = cfg.data_loading == "ray_data" and xcfg is None
    plan = f"train: {cfg.num_workers} workers x cpus_per_worker {cfg.cpus_per_worker:g}" + (
        f" + {DECODE_TASK_CPUS} CPU for the data decode tasks" if decode else ""
    )
    bundles = [worker] * cfg.num_workers + ([{"CPU": DECODE_TASK_CPUS}] if decode else [])
    fix = "lower cpus_per_worker or num_workers"
    if xcfg is not None:
        r = xcfg.ray
        plan += f" + {r.num_actors} capture actors x cpus_per_actor {r.cpus_per_actor:g}" + (
            f" x gpus_per_actor {r.gpus_per_actor:g}" if r.gpus_per_actor else ""
        )
        bundles += placement.plan_bundles(r)
        fix += f", or the stream's ray.num_actors / cpus_per_actor ({cfg.data.stream})"  # type: ignore[union-attr]
    require_resources(plan, bundles, fix, max(cfg.resource_wait_s, xcfg.ray.resource_wait_s if xcfg else 0))
    if xcfg is not None:
        placement.check_nodes(xcfg.ray)


def _fit_on_ray(cfg: TrainConfig, plan_json: str, stream_source=None) -> dict:
    from ray.train import ControllerError, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    init_ray(cfg.ray_address)
    storage = tempfile.mkdtemp(prefix="strata-raytrain-")  # Ray Train's run state; Strata's is in cfg.output
    # Ray Train waits for the worker group's placement group (60 s by default), then retries
    # forever (CPUs taken by another job after check_resources passed): wait stall_timeout_s once,
    # then fail. The variable is read here and passed on to Ray Train's controller.
    env_before = os.environ.get(WORKER_GROUP_START_TIMEOUT_ENV)
    if cfg.stall_timeout_s:
        os.environ[WORKER_GROUP_START_TIMEOUT_ENV] = str(cfg.stall_timeout_s)
    trainer = TorchTrainer(
        _ray_worker,
        train_loop_config={
            "plan_json": plan_json,
            "cpus_per_worker": cfg.cpus_per_worker,
            "use_gpu": cfg.use_gpu,
            "stream_source": stream_source,
        },
        torch_config=TorchConfig(backend="nccl" if cfg.use_gpu else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=cfg.num_workers, use_gpu=cfg.use_gpu, resources_per_worker={"CPU": cfg.cpus_per_worker}
        ),
        run_config=RunConfig(
            storage_path=storage,
            name="strata-train",
            failure_config=FailureConfig(max_failures=0, controller_failure_limit=0 if cfg.stall_timeout_s else -1),
        ),
    )
    try:
        trainer.fit()
    except ControllerError as e:
        if type(e.controller_failure).__name__ != "WorkerGroupStartupTimeoutError":
            raise
        raise _not_placed(cfg) from None
    finally:
        shutil.rmtree(storage, ignore_errors=True)
        if env_before is None:
            os.environ.pop(WORKER_GROUP_START_TIMEOUT_ENV, None)
        else:
            os.environ[WORKER_GROUP_START_TIMEOUT_ENV] = env_before
    fs, root = resolve(cfg.output, cfg.s3)
    return json.loads(read_bytes(fs, join(root, FINAL_METRICS)))
