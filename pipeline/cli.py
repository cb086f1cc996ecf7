"""The ``strata`` command line.

Exit codes (the same for every command and for ``jobs/*.py``):

    0   done: extracted, trained, passed, promoted, or nothing new to do
    1   an unexpected failure (a bug or a broken environment); ``-v`` shows the traceback
    2   unusable input: a config, path, name or target that cannot be used as given -- an
        unknown model type, an id list no reading rule maps, a file that does not exist
    3   a verdict against: validation blocked, promotion refused, verification failed
    4   inconclusive: ``strata probe`` cannot tell which layers a draft was trained on
    75  another scheduler holds the retrain lease; try later (EX_TEMPFAIL)

With ``--json`` stdout carries exactly one JSON document (on failure ``{"error": ...,
"exit_code": ...}``); logs, progress bars and the engines' own output (vLLM, Ray, DeepSpeed,
including their child processes) go to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import get_args

from pipeline.demo.tiny import ARCHS
from pipeline.errors import UnusableInput
from pipeline.store.objects import StoreUnavailable
from schemas.capture import CapturePointError
from schemas.config import ConfigError, S3Config
from schemas.provenance import DType
from schemas.registry import InvalidName

log = logging.getLogger("strata")

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_BLOCKED = 3
EXIT_INCONCLUSIVE = 4
EXIT_LEASE_HELD = 75  # EX_TEMPFAIL: another scheduler is running; try later

_json_doc: list[str] | None = None  # the document a --json command produced (see json_stdout)


@contextmanager
def json_stdout() -> Iterator[None]:
    """For ``--json``: fd 1 points at stderr while the command runs, so whatever this process
    and the processes it starts write there (vLLM's logger, Ray's worker logs) cannot land in
    the JSON; the document ``print_json`` was given is written once fd 1 is stdout again."""
    global _json_doc
    sys.stdout.flush()
    real_stream, saved_fd = sys.stdout, os.dup(1)
    os.dup2(2, 1)
    sys.stdout, _json_doc = sys.stderr, []
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved_fd, 1)
        os.close(saved_fd)
        sys.stdout, docs, _json_doc = real_stream, _json_doc, None
        for doc in docs:
            sys.stdout.write(doc + "\n")
        sys.stdout.flush()


def print_json(doc: str | dict | list) -> None:
    text = doc if isinstance(doc, str) else json.dumps(doc, indent=1, default=str)
    if _json_doc is not None:
        _json_doc.append(text)
    else:
        print(text)


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


def cmd_make_tiny_target(args: argparse.Namespace) -> int:
    import json

    from pipeline.data.stdlib import write_conversations
    from pipeline.demo.pretrain import RECORD, PretrainRecipe, trained_tiny_target
    from pipeline.demo.tiny import make_tiny_target

    if args.random:
        out = make_tiny_target(
            args.dir, num_layers=args.layers or 6, hidden_size=args.hidden or 256, seed=args.seed, arch=args.arch
        )
        print(f"random-init tiny target ({args.arch}) written to {out}")
    else:
        given = {"num_layers": args.layers, "hidden_size": args.hidden, "steps": args.steps}
        recipe = PretrainRecipe(seed=args.seed, arch=args.arch, **{k: v for k, v in given.items() if v is not None})
        out = trained_tiny_target(args.dir, recipe)
        rec = json.loads((out / RECORD).read_text())
        print(
            f"trained tiny target written to {out}: held-out perplexity {rec['heldout_perplexity']:.1f} "
            f"(unigram {rec['unigram_perplexity']:.1f}), next-token accuracy "
            f"{rec['heldout_next_token_accuracy']:.2f}; training record in {out / RECORD}"
        )
    if args.conversations:
        n = write_conversations(args.conversations, n=args.num_conversations)
        print(f"{n} conversations written to {args.conversations}")
    return 0


def cmd_make_conversations(args: argparse.Namespace) -> int:
    from pipeline.data.stdlib import write_conversations

    n = write_conversations(args.path, n=args.n, shape=args.shape)
    print(f"{n} conversations ({args.shape}) written to {args.path}")
    return 0


def cmd_regenerate(args: argparse.Namespace) -> int:
    from pipeline.regenerate.job import output_uri, run_regenerate
    from schemas.config import load_config
    from schemas.regenerate import RegenerateConfig

    cfg = load_config(args.config, RegenerateConfig)
    rec = run_regenerate(cfg, progress=not args.no_progress, use_ray=not args.no_ray)
    t = rec.totals
    print(
        f"regenerated {output_uri(cfg)}: input rows {t['rows']} = written {t['written']} + quarantined "
        f"{t['quarantined']}; {t['turns']} assistant turns by {rec.engine['name']} {rec.engine['version']} "
        f"({'greedy' if rec.sampling.temperature == 0 else f'sampled, T={rec.sampling.temperature:g}'}), "
        f"{t['cut_turns']} cut at max_new_tokens, {t['dropped_turns']} dropped\n"
        f"extract from it: source: {{uri: {output_uri(cfg)}}}"
    )
    return 0


def cmd_extract(args: argparse.Namespace) -> int:
    from pipeline.extract.job import run_extract
    from schemas.config import load_config
    from schemas.extract import ExtractConfig

    if args.config:
        cfg = load_config(args.config, ExtractConfig)
    else:
        from pipeline.demo.story import DEMO_ROOT, ensure_demo, regenerate_demo

        path = ensure_demo(DEMO_ROOT)
        print(
            f"no --config: using the embedded default {path} (its source: the target's own answers, regenerated first)"
        )
        regenerate_demo(path.parent)
        cfg = load_config(path, ExtractConfig)
    m = run_extract(cfg, progress=not args.no_progress, use_ray=not args.no_ray)
    t = m.totals
    print(
        f"dataset {m.dataset_id} at {cfg.output.uri}: input rows {t.input_rows} = written {t.rows} + "
        f"quarantined {t.quarantined}; {t.shards} shards, {t.tokens} tokens, {t.bytes / 1e6:.1f} MB\n"
        f"inspect it with: strata inspect {cfg.output.uri}"
    )
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from schemas.config import load_config
    from schemas.train import TrainConfig

    if args.config:
        cfg = load_config(args.config, TrainConfig)
    else:
        from pipeline.demo.story import DEMO_ROOT, ensure_demo

        ensure_demo(DEMO_ROOT)
        path = DEMO_ROOT.resolve() / "train.yaml"
        print(f"no --config: using the embedded default {path}")
        cfg = load_config(path, TrainConfig)
    if not args.no_ray:  # Ray starts while the training stack imports (the line below: seconds)
        from pipeline.cluster import start_ray_meanwhile

        start_ray_meanwhile(cfg.ray_address, dashboard=cfg.num_workers > 1)
    from pipeline.train.job import run_train

    out = run_train(cfg, use_ray=not args.no_ray, progress=not args.no_progress)
    m = out["metrics"]
    ev = m.get("eval") or {}
    print(
        f"trained {m['steps']} steps; eval acc per position {[round(a, 3) for a in ev.get('acc_per_pos', [])]}, "
        f"simulated acceptance length {ev.get('sim_accept_len', float('nan')):.3f}"
    )
    for e in out["exports"]:
        print(
            f"exported {e['serving_engine']}: aux ids {e['aux_layer_ids']} ({e['aux_layer_ids_convention']}), "
            f"digest {e['content_digest'][:16]}"
        )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from pipeline.draft.export import ExportError
    from pipeline.train.export import export_run

    try:
        out = export_run(
            args.run, engines=args.engine or None, dest_uri=args.out, engine_family=args.engine_family, dtype=args.dtype
        )
    except ExportError as e:
        print(f"strata: cannot export: {e}", file=sys.stderr)
        return EXIT_USAGE
    for e in out:
        print(
            f"{e['serving_engine']}: aux ids {e['aux_layer_ids']} ({e['aux_layer_ids_convention']}) "
            f"for {[c['kind'] + (':' + str(c['layer']) if c['layer'] is not None else '') for c in e['aux_capture_points']]}"
        )
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from pipeline.validate.case import ValidationInputError
    from pipeline.validate.job import run_validate
    from schemas.config import load_config
    from schemas.validation import ValidateConfig

    cfg = load_config(args.config, ValidateConfig)
    if args.report_dir:
        cfg.report_dir = args.report_dir
    if args.registry:
        cfg.registry = args.registry
    if args.no_cost:
        cfg.cost = False
    try:
        r = run_validate(cfg)
    except ValidationInputError as e:
        return _fail(f"strata: cannot validate: {e}", EXIT_USAGE, args.json)
    if args.json:
        print_json(r.model_dump_json(indent=1))
    else:
        from pipeline.validate.report import summary

        print("\n".join(summary(r)))
    return 0 if r.decision == "pass" else EXIT_BLOCKED


def _probe_config(args: argparse.Namespace):
    from schemas.config import load_config
    from schemas.probe import ProbeConfig

    if args.config:
        cfg = load_config(args.config, ProbeConfig)
        over = {
            k: v
            for k, v in (
                ("draft", args.draft),
                ("conversations", args.conversations),
                ("prompts", args.prompts),
                ("trained_on", _points(args.trained_on)),
            )
            if v is not None
        }
        if args.target:
            over["target"] = {"path": args.target}
        return ProbeConfig.model_validate({**cfg.model_dump(mode="json", exclude_none=True), **over})
    if not (args.draft and args.target):
        raise ConfigError("give --draft and --target (or --config with a serving section)")
    return ProbeConfig.model_validate(
        {
            "draft": args.draft,
            "target": {"path": args.target},
            **({"conversations": args.conversations} if args.conversations else {}),
            **({"prompts": args.prompts} if args.prompts else {}),
            **({"trained_on": _points(args.trained_on)} if args.trained_on else {}),
        }
    )


def _points(text: str | None) -> list[str] | None:
    return [t.strip() for t in text.split(",")] if text else None


def cmd_probe(args: argparse.Namespace) -> int:
    from pipeline.probe.job import run_probe
    from pipeline.probe.report import summary
    from pipeline.validate.foreign import compare_with_serving

    cfg = _probe_config(args)
    probe = run_probe(cfg, progress=not args.json)
    if cfg.serving is not None:
        compare_with_serving(probe)
    r = probe.report
    if args.json:
        print_json(r.model_dump_json(indent=1))
    else:
        print("\n".join(summary(r)))
    return {"inferred": 0, "declared": 0, "pass": 0, "block": EXIT_BLOCKED, "inconclusive": EXIT_INCONCLUSIVE}[
        r.verdict
    ]


def cmd_import(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    from pipeline.probe.adopt import adopt
    from pipeline.probe.job import run_probe

    args.draft = args.draft or args.dir
    cfg = _probe_config(args)
    args.registry = args.registry or cfg.registry
    probe = run_probe(cfg, progress=not args.json)
    if probe.admissible is None:
        return _fail(f"strata: not imported: {probe.report.summary}", EXIT_INCONCLUSIVE, args.json)
    reg = _registry(args)
    with tempfile.TemporaryDirectory(prefix="strata-import-") as tmp:
        manifest = adopt(probe, Path(tmp) / "draft")
        digest = reg.add_artifact(Path(tmp) / "draft").content_digest
    out = {
        "imported": digest,
        "registry": reg.store.uri,
        "trained_points": [str(p) for p in manifest.aux_capture_points],
        "open_slots": {str(j): [str(p) for p in alts] for j, alts in enumerate(manifest.aux_alternatives) if alts},
        "provenance": manifest.provenance,
        "probe": probe.report.summary,
    }
    if args.json:
        print_json(out)
    else:
        print(f"imported {args.draft} as {digest} into {reg.store.uri}: {probe.report.summary}")
    return 0


def _registry(args: argparse.Namespace):
    import os

    from pipeline.registry.registry import Registry
    from pipeline.store.objects import open_store

    uri = args.registry or os.environ.get("STRATA_REGISTRY") or "strata-registry"
    return Registry(open_store(uri, S3Config()))


def cmd_promote(args: argparse.Namespace) -> int:
    from pipeline.registry.registry import PromotionRefused

    reg = _registry(args)
    try:
        ptr = reg.promote(args.artifact, args.channel)
    except PromotionRefused as e:
        print(f"promotion of {args.artifact[:16]} to {args.channel} refused:", file=sys.stderr)
        for r in e.reasons:
            print(f"  - {r}", file=sys.stderr)
        if args.json:
            print_json({"promoted": False, "channel": args.channel, "artifact": args.artifact, "reasons": e.reasons})
        return EXIT_BLOCKED
    if args.json:
        print_json({"promoted": True, **ptr.model_dump(mode="json")})
    else:
        print(f"{args.channel} -> {ptr.artifact_digest} (record {ptr.record_id}; was {ptr.previous_digest})")
    return 0


def cmd_retrain(args: argparse.Namespace) -> int:
    from pipeline.retrain.job import parse_every, run_forever, run_retrain
    from pipeline.store.lease import LeaseHeld
    from schemas.config import load_config
    from schemas.retrain import RetrainConfig

    cfg = load_config(args.config, RetrainConfig)
    if args.no_ray:
        cfg = cfg.model_copy(update={"use_ray": False})
    if args.every:
        if args.json:
            return _fail("strata: error: --json prints one pass's record; it cannot go with --every", EXIT_USAGE, True)
        return run_forever(cfg, parse_every(args.every), progress=not args.no_progress)
    try:
        rec = run_retrain(cfg, progress=not args.no_progress)
    except LeaseHeld as e:
        print(f"strata retrain: not running: {e}", file=sys.stderr)
        return EXIT_LEASE_HELD
    if args.json:
        print_json(rec.model_dump_json(indent=1))
    else:
        print(f"retrain {rec.run_id}: {rec.outcome}: {rec.message}")
        for r in rec.reasons:
            print(f"  - {r}")
    return EXIT_BLOCKED if rec.outcome in ("blocked", "refused") else 0


def cmd_registry(args: argparse.Namespace) -> int:
    reg = _registry(args)
    if args.action == "create-channel":
        from pipeline.validate.job import serving_for_channel

        spec = reg.create_channel(args.target, serving_for_channel(args.validate_config))
        doc: object = spec.model_dump(mode="json")
        text = [
            f"channel {spec.channel}: serving key {spec.serving.key} ({spec.serving.engine} "
            f"{spec.serving.engine_version}, {spec.serving.dtype}, TP {spec.serving.tp_size})"
        ]
    elif args.action == "add":
        m = reg.add_artifact(args.target)
        doc, text = (
            m.model_dump(mode="json"),
            [f"artifact {m.content_digest} ({m.serving_engine}, aux ids {m.aux_layer_ids})"],
        )
    elif args.action == "ls":
        arts = {d: reg.artifact(d) for d in reg.artifacts()}
        pointers = {c: reg.pointer(c)[0] for c in reg.channels()}
        doc = {
            "artifacts": [m.model_dump(mode="json") for m in arts.values()],
            "channels": {c: p.artifact_digest if p else None for c, p in pointers.items()},
        }
        text = [
            f"{d[:16]}  {m.serving_engine:<7} {m.target.model_name:<20} aux {m.aux_layer_ids}  dataset {m.dataset_id}"
            for d, m in arts.items()
        ]
        text += [f"channel {c:<12} -> {p.artifact_digest[:16] if p else '(empty)'}" for c, p in pointers.items()]
    elif args.action == "show":
        m = reg.artifact(args.target)
        if m is None:
            return _fail(f"strata: no artifact {args.target} in {reg.store.uri}", EXIT_USAGE, args.json)
        records = reg.records(args.target)
        doc = {"artifact": m.model_dump(mode="json"), "records": [r.model_dump(mode="json") for r in records]}
        text = [m.model_dump_json(indent=1)] + [
            f"record {r.record_id}: {r.decision} for serving {r.serving.key} ({r.serving.engine}) {r.reasons}"
            for r in records
        ]
    else:
        events = reg.history(args.target)
        doc = [e.model_dump(mode="json") for e in events]
        text = [
            f"{e.at}  {e.action:<14} {e.decision:<8} {e.channel or '-':<12} {(e.artifact_digest or '-')[:16]}  "
            f"{'; '.join(e.reasons)}  by {e.actor}"
            for e in events
        ]
    if args.json:
        print_json(doc)
    else:
        print("\n".join(text))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from pipeline.demo.story import DEMO_ROOT, run_demo

    return run_demo(DEMO_ROOT, sglang=args.sglang)


def verify_dataset(uri: str) -> str | None:
    """None when every shard is there, intact, holds its unit's rows and ids once, and the
    counts add up; else what is wrong, in one line."""
    from pipeline.store.reader import DatasetReader, ProvenanceMismatch, ShardCorrupt

    try:
        DatasetReader(uri).verify_all()  # the reader's one verification, as training runs it
    except (ShardCorrupt, ProvenanceMismatch, ValueError, OSError) as e:
        return str(e)
    return None


def cmd_inspect(args: argparse.Namespace) -> int:
    from pipeline.store.reader import load_manifest

    m = load_manifest(args.dataset)
    problem = verify_dataset(args.dataset) if args.verify else None
    if problem:
        print(f"strata inspect: {args.dataset} FAILED verification: {problem}", file=sys.stderr)
    if args.json:
        doc = m.model_dump(mode="json")  # the manifest, as stored
        if args.verify:
            doc["verification"] = {"ok": problem is None, "problem": problem}
        print_json(doc)
        return EXIT_BLOCKED if problem else 0
    t = m.totals
    print(f"dataset   {m.dataset_id}  (format v{m.format_version}, created {m.created_at})")
    print(f"target    {m.target.describe()}  arch {m.target.architecture}")
    print(
        f"          weights {m.target.weights_sha256[:16]}  config {m.target.config_sha256[:16]}  "
        f"tokenizer {m.target.tokenizer_sha256[:16]}  template {(m.target.chat_template_sha256 or '-')[:16]}"
    )
    print(f"source    {m.source.uri}  ({m.source.format}, {m.source.rows} rows, sha256 {m.source.sha256[:16]})")
    print("columns:")
    print(f"  {'capture point':<18} {'boundary':<11} {'dtype':<9} {'H':>6}  {'engine':<20} native id")
    for c in m.columns:
        e = c.engine
        print(
            f"  {str(c.capture_point):<18} {c.boundary:<11} {c.dtype:<9} {c.hidden_size:>6}  "
            f"{e.name + ' ' + e.version:<20} {e.native_id} ({e.native_id_convention})"
        )
    print("shards:")
    print(f"  {'unit':>5} {'source rows':>13} {'rows':>6} {'quar':>5} {'tokens':>9} {'bytes':>12}  sha256")
    for s in m.shards:
        print(
            f"  {s.unit:>5} {f'{s.source_rows[0]}-{s.source_rows[1]}':>13} {s.rows:>6} {s.quarantined:>5} "
            f"{s.tokens:>9} {s.bytes:>12}  {(s.sha256 or '-')[:16]}"
        )
    print(
        f"totals    input {t.input_rows} = written {t.rows} + quarantined {t.quarantined}; "
        f"{t.shards} shards, {t.tokens} tokens ({t.loss_tokens} trained on), {t.bytes / 1e6:.2f} MB"
    )
    if not args.verify:
        print("verified  no: this lists the manifest only; --verify checks checksums, row counts and sample ids")
        return 0
    print(
        f"verified  {'FAILED: ' + problem if problem else 'yes: every shard present and intact, rows and ids once, counts add up'}"
    )
    return EXIT_BLOCKED if problem else 0


def build_parser() -> argparse.ArgumentParser:
    """The commands, in three groups; their declarations repeat in shape (one ``add_parser`` block
    per command) because that is argparse's form, not shared logic."""
    p = argparse.ArgumentParser(prog="strata", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)
    _add_data_commands(sub)
    _add_job_commands(sub)
    _add_probe_commands(sub)
    _add_registry_commands(sub)
    return p


def _add_data_commands(sub) -> None:
    """Local inputs (tiny target, conversations), the demo, and dataset inspection."""
    s = sub.add_parser(
        "make-tiny-target",
        help="build a tiny Llama + tokenizer locally, pretrained for a few minutes "
        "on the Python stdlib (deterministic, cached by content); --random skips the training",
    )
    s.add_argument("dir")
    s.add_argument("--random", action="store_true", help="random-init weights (fast unit tests), no pretraining")
    s.add_argument("--steps", type=int, default=None, help="pretraining steps (default: the demo recipe's)")
    s.add_argument("--layers", type=int, default=None, help="default: 12 trained, 6 random")
    s.add_argument("--hidden", type=int, default=None, help="default: 128 trained, 256 random")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument(
        "--arch",
        choices=ARCHS,
        default="llama",
        help="llama, or deepseek_v3: MLA attention, MoE layers, yarn rope (the incident's family)",
    )
    s.add_argument("--conversations", help="also write a conversations JSONL here")
    s.add_argument("--num-conversations", type=int, default=None)
    s.set_defaults(func=cmd_make_tiny_target)

    s = sub.add_parser("make-conversations", help="write Q&A conversations built from stdlib docstrings")
    s.add_argument("path")
    s.add_argument("-n", type=int, default=None)
    s.add_argument("--shape", choices=["messages", "sharegpt"], default="messages")
    s.set_defaults(func=cmd_make_conversations)

    s = sub.add_parser(
        "demo", help="extract -> train -> validate -> promote on the embedded default, then a blocked misconfiguration"
    )
    s.add_argument(
        "--sglang",
        action="store_true",
        help="then the incident on SGLang 0.5.18, served by its own server (~3 min more; needs .venv-sglang)",
    )
    s.set_defaults(func=cmd_demo)

    s = sub.add_parser("inspect", help="show a dataset's provenance, shards and totals")
    s.add_argument("dataset")
    s.add_argument("--json", action="store_true")
    s.add_argument(
        "--verify",
        action="store_true",
        help="read every shard: checksums, source rows, unique ids, totals (exit 3 when anything is off)",
    )
    s.set_defaults(func=cmd_inspect)


def _add_job_commands(sub) -> None:
    """The pipeline's jobs: regenerate, extract, train, export, validate."""
    s = sub.add_parser(
        "regenerate",
        help="replace the conversations' assistant turns with the target's own "
        "responses, to train the draft on what it will be asked to predict (runs on Ray)",
    )
    s.add_argument("--config", required=True, help="regeneration YAML (schemas/regenerate.py)")
    s.add_argument("--no-progress", action="store_true")
    s.add_argument("--no-ray", action="store_true", help="one engine in this process")
    s.set_defaults(func=cmd_regenerate)

    s = sub.add_parser("extract", help="capture hidden states into a Parquet dataset (runs on Ray)")
    s.add_argument("--config", help="extraction YAML; default: the embedded demo (tiny target, local Ray)")
    s.add_argument("--no-progress", action="store_true")
    s.add_argument(
        "--no-ray",
        action="store_true",
        help="one engine in this process (no Ray start, no actors: a single machine's quickest path)",
    )
    s.set_defaults(func=cmd_extract)

    s = sub.add_parser("train", help="train an EAGLE-3 draft with DeepSpeed on Ray Train, then export it")
    s.add_argument("--config", help="training YAML; default: the embedded demo (after `strata extract`)")
    s.add_argument("--no-ray", action="store_true", help="one worker in this process (no Ray)")
    s.add_argument("--no-progress", action="store_true", help="no progress bars for a streaming run's capture")
    s.set_defaults(func=cmd_train)

    s = sub.add_parser("export", help="export a training run's latest checkpoint for SGLang and/or vLLM")
    s.add_argument("run", help="training run directory (the train config's output)")
    s.add_argument(
        "--engine", action="append", choices=["sglang", "vllm"], help="repeatable; default: the run's config"
    )
    s.add_argument("--out", help="destination (default: <run>/export)")
    s.add_argument(
        "--engine-family",
        "--sglang-family",
        dest="engine_family",
        default=None,
        help="force the SGLang capture rule: an architecture or model file such as deepseek_v2 "
        "(default: the target's config.json architectures)",
    )
    s.add_argument("--dtype", choices=list(get_args(DType)), default=None)
    s.set_defaults(func=cmd_export)

    s = sub.add_parser(
        "validate", help="replay the probe set as the serving engine will; exit 0 pass, 3 block, 2 bad input"
    )
    s.add_argument("--config", required=True)
    s.add_argument("--json", action="store_true", help="print the machine-readable verdict")
    s.add_argument("--report-dir", help="write report.md, report.json and heatmap.png here")
    s.add_argument("--registry", help="record the verdict in this registry")
    s.add_argument(
        "--no-cost",
        action="store_true",
        help="when blocked, skip timing what the configuration would cost (no speculation / as written / fixed)",
    )
    s.set_defaults(func=cmd_validate)


def _add_probe_commands(sub) -> None:
    """Drafts trained elsewhere: which layers they were trained on, and adding them to a registry."""
    for name, text in (
        (
            "probe",
            "infer from its predictions which layers a draft was trained on; exit 0 inferred/pass, "
            "3 the deployment feeds other layers, 4 inconclusive, 2 bad input",
        ),
        ("import", "probe a draft trained elsewhere and add it to a registry with inferred provenance"),
    ):
        s = sub.add_parser(name, help=text)
        if name == "import":
            s.add_argument("dir", nargs="?", help="the draft directory")
            s.add_argument(
                "--registry", help="local dir or s3://bucket/prefix (default: $STRATA_REGISTRY or ./strata-registry)"
            )
        s.add_argument("--draft", help="the draft directory (SGLang/SpecForge, vLLM, speculators or Strata layout)")
        s.add_argument("--target", help="the target model directory")
        s.add_argument("--config", help="probe YAML (draft, target, conversations, serving: as for validate)")
        s.add_argument("--conversations", help="JSONL/Parquet conversations to probe with (default: built-in)")
        s.add_argument("--prompts", type=int, help="how many conversations (default 32)")
        s.add_argument(
            "--trained-on",
            help="the trained points as declared by whoever trained it, comma-separated "
            "(embedding,layer_output:3,layer_output:7); the probe's evidence is reported beside them",
        )
        s.add_argument("--json", action="store_true")
        s.set_defaults(func=cmd_probe if name == "probe" else cmd_import)


def _add_registry_commands(sub) -> None:
    """Promotion, scheduled retraining and the registry."""
    s = sub.add_parser("promote", help="move a channel to an artifact (needs a passing validation record)")
    s.add_argument("artifact", help="artifact content digest")
    s.add_argument("--channel", required=True)
    s.add_argument(
        "--registry", help="local dir or s3://bucket/prefix (default: $STRATA_REGISTRY or ./strata-registry)"
    )
    s.add_argument("--json", action="store_true", help="print the new pointer (or the refusal) as JSON")
    s.set_defaults(func=cmd_promote)

    s = sub.add_parser(
        "retrain",
        help="one pass: extract new rows, train, validate, promote through the gate; "
        "exit 0 promoted/nothing new, 3 blocked/refused, 75 another scheduler holds the lease",
    )
    s.add_argument("--config", required=True)
    s.add_argument("--every", help="repeat every interval (e.g. 6h) until SIGTERM")
    s.add_argument("--no-ray", action="store_true", help="extract and train in this process")
    s.add_argument("--no-progress", action="store_true")
    s.add_argument("--json", action="store_true", help="print the pass's run record as JSON")
    s.set_defaults(func=cmd_retrain)

    s = sub.add_parser("registry", help="artifacts, channels and the audit log")
    s.add_argument("action", choices=["add", "ls", "show", "history", "create-channel"])
    s.add_argument("target", nargs="?", help="add: exported draft dir; show: digest; history/create-channel: channel")
    s.add_argument(
        "--validate-config", help="create-channel: the validation config whose serving spec the channel deploys"
    )
    s.add_argument(
        "--registry", help="local dir or s3://bucket/prefix (default: $STRATA_REGISTRY or ./strata-registry)"
    )
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_registry)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    as_json = getattr(args, "json", False)
    with json_stdout() if as_json else nullcontext():
        try:
            return args.func(args)
        except (ConfigError, UnusableInput, CapturePointError, FileNotFoundError, InvalidName, StoreUnavailable) as e:
            return _fail(f"strata: error: {e}", EXIT_USAGE, as_json)
        except Exception as e:  # one readable line, details with -v
            if args.verbose:
                raise
            return _fail(f"strata: {type(e).__name__}: {e}", EXIT_ERROR, as_json)


def _fail(message: str, code: int, as_json: bool) -> int:
    print(message, file=sys.stderr)
    if as_json:
        print_json({"error": message.removeprefix("strata: "), "exit_code": code})
    return code


if __name__ == "__main__":
    sys.exit(main())
