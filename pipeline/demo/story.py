"""The embedded default: a tiny target, demo conversations and a config, built locally.

``python jobs/extract.py`` with no ``--config`` uses this, so the main job runs on a
fresh machine with nothing downloaded.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from pipeline import acceptance as accept_def
from pipeline import conventions
from pipeline.acceptance import acceptance_length
from pipeline.data.stdlib import write_conversations
from pipeline.demo.pretrain import RECORD, trained_tiny_target
from pipeline.extract.job import run_extract
from pipeline.identity import target_identity
from pipeline.probe.job import run_probe
from pipeline.regenerate.job import run_regenerate
from pipeline.registry.registry import Registry
from pipeline.store.objects import LocalStore
from pipeline.train.job import run_train
from pipeline.validate.cost import table_lines
from pipeline.validate.job import run_validate, serving_for_channel
from pipeline.validate.report import summary
from schemas.acceptance import HeldoutAcceptance
from schemas.artifact import ARTIFACT_CONFIG, ARTIFACT_MANIFEST, DraftArtifactManifest
from schemas.capture import CapturePoint
from schemas.config import TargetConfig, load_config
from schemas.extract import ExtractConfig
from schemas.probe import ProbeConfig, ProbeReport
from schemas.regenerate import RegenerateConfig, RegenerationRecord
from schemas.train import TrainConfig
from schemas.validation import Cost, ValidateConfig, ValidationReport

log = logging.getLogger(__name__)

DEMO_ROOT = Path("strata-demo")
PROBE_PROMPTS = 300  # of the regenerated conversations: the probe chapter's evidence
DEMO_VERSION = "3"  # bump when the demo's target or configs change: an older demo directory is moved aside


def demo_root(root: Path) -> Path:
    """The demo directory, created; one an older demo built is moved aside, not mixed in."""
    root = root.resolve()
    marker = root / ".strata-demo-version"
    if root.exists() and any(root.iterdir()) and (not marker.exists() or marker.read_text().strip() != DEMO_VERSION):
        aside = root.with_name(f"{root.name}.old-{int(time.time())}")
        log.warning("%s was built by an older demo; moved aside to %s", root, aside)
        root.rename(aside)
    root.mkdir(parents=True, exist_ok=True)
    marker.write_text(DEMO_VERSION + "\n")
    return root


def ensure_demo(root: Path = DEMO_ROOT) -> Path:
    """Build (once) the tiny target, the conversations and ``extract.yaml``; return its path."""
    root = demo_root(root)
    target, conv, cfg_path = root / "target", root / "conversations.jsonl", root / "extract.yaml"
    if not (target / RECORD).exists():
        log.info(
            "building the tiny target (12 layers, hidden 128, BPE tokenizer on stdlib docstrings, pretrained "
            "on the stdlib's sources and docstring conversations; cached) in %s",
            target,
        )
        trained_tiny_target(target)
    layers = target_identity(target).num_layers
    if not conv.exists():
        n = write_conversations(conv)
        log.info("wrote %d demo conversations to %s", n, conv)
    train_path = root / "train.yaml"
    if not train_path.exists():
        train = {
            "dataset": str(root / "dataset"),
            "target": {"path": str(target), "name": "tiny-llama"},
            "output": str(root / "run"),
            # A 2048-token target vocab: the draft keeps all of it.
            "draft_vocab_size": 2048,
            # CPU-sized: 4 TTT steps (the default is 7), small batches, a high learning rate and
            # 8 short epochs; one worker with most of both cores (half a CPU feeds it data).
            "ttt_steps": 4,
            "batch_tokens": 2048,
            "epochs": 8,
            "metrics_every": 10,
            "checkpoint": {"every": 100},
            "optim": {"lr": 1.0e-2, "warmup_steps": 10},
            "deepspeed": {"zero_stage": 2, "dtype": "float32"},
            "num_workers": 1,
            "cpus_per_worker": 1.5,
        }
        train_path.write_text("# Strata training config (embedded default; edit freely)\n" + _yaml(train))
    regen_path = root / "regenerate.yaml"
    if not regen_path.exists():
        regen = {
            "target": {"path": str(target), "name": "tiny-llama"},
            "source": {"uri": str(conv)},
            # The draft is served on the target's own answers: train it on them (greedy, like serving).
            "output": {"uri": str(root / "regenerated"), "rows_per_unit": 400},
            "engine": {"name": "vllm" if _has_vllm() else "hf", "dtype": "float32", "max_model_len": 1024},
            "max_new_tokens": 256,
            "max_length": 512,
            "ray": {"num_actors": 1, "cpus_per_actor": 1},
        }
        regen_path.write_text("# Strata regeneration config (embedded default; edit freely)\n" + _yaml(regen))
    if not cfg_path.exists():
        cfg = {
            "target": {"path": str(target), "name": "tiny-llama"},
            "source": {"uri": str(root / "regenerated" / "conversations.jsonl")},
            "output": {"uri": str(root / "dataset"), "rows_per_shard": 128},
            # EAGLE-3's aux layers for this depth (r_2, r_{N/2}, r_{N-3}) + what the LM head reads.
            "capture": [str(p) for p in conventions.default_aux_points("vllm", layers)] + ["final:post_norm"],
            "max_length": 512,
            # float32: CPUs without AVX512-BF16 run bf16 matmuls several times slower.
            "engine": {"name": "hf", "dtype": "float32", "device": "auto", "batch_tokens": 8192},
            "ray": {"num_actors": 1, "cpus_per_actor": 1},
        }
        cfg_path.write_text("# Strata extraction config (embedded default; edit freely)\n" + _yaml(cfg))
    return cfg_path


def _has_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _yaml(obj: dict) -> str:
    import yaml

    return yaml.safe_dump(json.loads(json.dumps(obj)), sort_keys=False)


@contextmanager
def _quiet(log_path: Path):
    """Everything the process and its children print (Ray, DeepSpeed, vLLM, progress bars)
    goes to ``log_path``; the returned stream still reaches the terminal."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    story = os.fdopen(os.dup(1), "w", buffering=1)
    streams = sys.stdout, sys.stderr
    with open(log_path, "a", buffering=1) as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        sys.stdout = sys.stderr = f  # also where Python-level writers go if sys.stdout was replaced
        try:
            yield story
        finally:
            _close_engines()  # their shutdown logs land in the log, not after "done"
            sys.stdout, sys.stderr = streams
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            _retarget_handlers(f, log_path)
            for fd in saved:
                os.close(fd)
            story.close()


def _close_engines() -> None:
    """Shut down the engines this process still holds (vLLM's pool closes at exit otherwise)."""
    if "pipeline.engines.vllm.engine" in sys.modules:
        sys.modules["pipeline.engines.vllm.engine"].close_all()


def _retarget_handlers(closed, log_path: Path) -> None:
    """Logging handlers created while output went to the log (vLLM binds its handler to the
    sys.stdout of its import) keep writing there, not to the closed file object."""
    late = None
    loggers = [
        logging.getLogger(),
        *(x for x in logging.Logger.manager.loggerDict.values() if isinstance(x, logging.Logger)),
    ]
    for lg in loggers:
        for h in lg.handlers:
            if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) is closed:
                late = late or open(log_path, "a", buffering=1)  # noqa: SIM115 - lives until exit
                h.setStream(late)


def run_demo(root: Path = DEMO_ROOT, sglang: bool = False) -> int:
    """extract -> train -> validate -> promote on the embedded default, then the original bug
    (ids shifted, embedding inserted), blocked, with what it would have cost; with ``sglang``,
    the incident on SGLang too."""
    root = demo_root(root)
    log_path = root / "demo.log"
    print(f"Strata demo in {root}; Ray, DeepSpeed and vLLM logs go to {log_path}")
    t0 = time.perf_counter()
    with _quiet(log_path) as story:
        try:
            ok = _story(root, lambda *a: print(*a, file=story), sglang)
        except Exception:
            log.exception("demo failed")
            print(f"demo failed: the traceback is at the end of {log_path}", file=story)
            return 1
        print(f"\ndone in {time.perf_counter() - t0:.0f} s; full log {log_path}", file=story)
    return 0 if ok else 1


def _story(root: Path, say, sglang: bool = False) -> bool:
    """The five chapters (six with ``sglang``); True when the correct draft passed, the incident
    was blocked and production did not move (and, on SGLang, the same held)."""
    cfg_path = _chapter_target(root, say)
    _chapter_extract(cfg_path, say)
    art = _chapter_train(root, say)
    serving = {"engine": "vllm", "dtype": "float32", "target": {"path": str(root / "target")}}
    reg, registry = Registry(LocalStore(root / "registry")), root / "registry"
    good = _chapter_validate(root, art, serving, reg, say)
    say("\n== 4/5 promote to channel 'production' (needs the passing record just written)")
    if good.decision == "pass":
        ptr = reg.promote(good.artifact_digest, "production")
        say(f"   production -> {ptr.artifact_digest[:16]} (record {ptr.record_id})")
    before = reg.pointer("production")[0]
    bad = _chapter_incident(root, art, serving, registry, say)
    unmoved = reg.pointer("production")[0] == before
    say("\n== what the misconfiguration would have cost, measured through vLLM on held-out prompts")
    for line in table_lines(bad.cost or Cost(skipped="not measured")):
        say("   " + line)
    say(
        f"   the gate blocked it before it was served: {bad.decision.upper()}; production "
        f"{'still points at the passing draft' if unmoved else 'CHANGED'}"
        + (f" ({before.artifact_digest[:16]})" if before else "")
    )
    fed = [s.fed for s in bad.slots if s.fed]
    chapter_probe(
        root,
        art,
        root / "misconfigured-config.json",
        fed,
        say,
        root / "regenerated" / "conversations.jsonl",
        # 32 prompts leave every slot of this draft open between two or three boundaries; 300 settle more
        options={"prompts": PROBE_PROMPTS},
    )
    ok = good.decision == "pass" and bad.decision == "block" and unmoved
    if sglang:
        ok = _chapter_sglang(root, registry, say)[0] and ok
    say(f"\nregistry {registry}: `strata registry history production --registry {registry}`")
    return ok


def _chapter_target(root: Path, say) -> Path:
    t = time.perf_counter()
    say(
        "\n== 0/5 target: a tiny Llama (12 layers, hidden 128), pretrained on the Python standard library "
        "(about two minutes once, then cached)"
    )
    cfg_path = ensure_demo(root)
    rec = json.loads((root / "target" / RECORD).read_text())
    say(
        f"   held-out perplexity {rec['heldout_perplexity']:.1f} (a unigram model: {rec['unigram_perplexity']:.0f}), "
        f"next-token accuracy {rec['heldout_next_token_accuracy']:.2f}  [{time.perf_counter() - t:.0f} s]"
    )
    return cfg_path


def regenerate_demo(root: Path) -> RegenerationRecord:
    """The embedded default's first step: the target's own answers to the demo conversations."""
    return run_regenerate(load_config(root / "regenerate.yaml", RegenerateConfig))


def _chapter_extract(cfg_path: Path, say) -> None:
    t = time.perf_counter()
    say(
        "\n== 1/5 regenerate + extract: the target's own answers (what the draft will be asked to predict), then "
        "hidden states with per-tensor provenance -> Parquet (Ray actors, local Ray)"
    )
    rec = regenerate_demo(cfg_path.parent)
    tt = rec.totals
    say(
        f"   regenerated {tt['written']} conversations ({tt['turns']} answers, {tt['generated_tokens']} tokens) with "
        f"{rec.engine['name']} {rec.engine['version']}, greedy  [{time.perf_counter() - t:.0f} s]"
    )
    t = time.perf_counter()
    m = run_extract(load_config(cfg_path, ExtractConfig))
    say(
        f"   dataset {m.dataset_id}: {m.totals.rows} samples, {m.totals.tokens} tokens, "
        f"{m.fingerprints['probe_samples'] if m.fingerprints else 0} probe samples held out  "
        f"[{time.perf_counter() - t:.0f} s]"
    )


def _chapter_train(root: Path, say) -> Path:
    t = time.perf_counter()
    say("\n== 2/5 train: EAGLE-3 draft, DeepSpeed ZeRO-2 on Ray Train; export for SGLang + vLLM")
    out = run_train(load_config(root / "train.yaml", TrainConfig))
    ev, held = out["metrics"].get("eval") or {}, out["metrics"].get("heldout_acceptance") or {}
    say(f"   eval accuracy per TTT position {[round(a, 2) for a in ev.get('acc_per_pos', [])]}")
    if "mean_acceptance_length" in held:
        predicted = acceptance_length(held["predicted_accepted_per_step"] or 0)
        say(f"   held-out prompts: {accept_def.line(HeldoutAcceptance.model_validate(held))}")
        say(f"   (teacher-forced accuracy predicts {predicted:.2f})  [{time.perf_counter() - t:.0f} s]")
    return root / "run" / "export" / "vllm"


def _chapter_validate(root: Path, art: Path, serving: dict, reg: Registry, say) -> ValidationReport:
    good = root / "validate.yaml"
    good.write_text(_yaml({"artifact": str(art), "report_dir": str(root / "reports" / "correct"), "serving": serving}))
    t = time.perf_counter()
    say(
        "\n== 3/5 validate through vLLM itself: replay the probe samples, serve the draft with EAGLE-3, "
        "measure what reaches the draft's input and vLLM's acceptance"
    )
    if reg.channel_spec("production") is None:
        reg.create_channel("production", serving_for_channel(str(good)))
    r = run_validate(load_config(good, ValidateConfig).model_copy(update={"registry": str(root / "registry")}))
    _say_verdict(say, r)
    say(f"   [{time.perf_counter() - t:.0f} s]")
    return r


def _chapter_incident(root: Path, art: Path, serving: dict, registry: Path, say) -> ValidationReport:
    """The incident: the engine fed the embedding first and every trained point one slot on."""
    t = time.perf_counter()
    good_cfg = json.loads((art / ARTIFACT_CONFIG).read_text())
    trained = trained_points(art)
    layers = target_identity(root / "target").num_layers
    bad_cfg = conventions.draft_config_feeding(good_cfg, [CapturePoint.embedding(), *trained[:-1]], "vllm", layers)
    say(
        f"\n== 5/5 the incident: embedding inserted first, last slot dropped (ids {bad_cfg[conventions.AUX_KEY]} "
        f"for a draft trained on {good_cfg[conventions.AUX_KEY]})"
    )
    (root / "misconfigured-config.json").write_text(json.dumps(bad_cfg, indent=1))
    bad = root / "validate-misconfigured.yaml"
    bad.write_text(
        _yaml(
            {
                "artifact": str(art),
                "report_dir": str(root / "reports" / "misconfigured"),
                "serving": {**serving, "draft_config": str(root / "misconfigured-config.json")},
            }
        )
    )
    r = run_validate(load_config(bad, ValidateConfig).model_copy(update={"registry": str(registry)}))
    _say_verdict(say, r)
    say(f"   [{time.perf_counter() - t:.0f} s]")
    return r


def chapter_probe(
    root: Path,
    art: Path,
    config: Path,
    fed: list[CapturePoint],
    say,
    conversations: Path | None = None,
    options: dict | None = None,
) -> ProbeReport:
    """The incident's draft as a team would receive it from elsewhere: Strata's files removed, the
    misconfigured ids in its config. The probe asks the draft itself, on ``conversations`` (the team's
    own; default the stdlib ones), which layers it reads best, how much worse it fits ``fed`` (what
    the engine feeds under that config) and, in a tie, whether ``fed`` is among what the tie leaves
    open. ``options``: more of the probe's options (``ProbeOptions``)."""
    t = time.perf_counter()
    trained = trained_points(art)
    foreign = root / "foreign-draft"
    shutil.rmtree(foreign, ignore_errors=True)
    shutil.copytree(art, foreign, ignore=shutil.ignore_patterns("strata_*"))
    shutil.copyfile(config, foreign / ARTIFACT_CONFIG)
    target = root / "target"
    on = f" --conversations {conversations}" if conversations else ""
    on += "".join(f" --{k.replace('_', '-')} {v}" for k, v in (options or {}).items() if k in ("prompts", "steps"))
    say(f"\n== the same draft without Strata's files: strata probe --draft {foreign} --target {target}{on}")
    cfg = ProbeConfig(
        draft=str(foreign),
        target=TargetConfig(path=str(target)),
        conversations=str(conversations) if conversations else None,
        **(options or {}),
    )
    r = run_probe(cfg, progress=False).report
    say(f"   probe: {r.summary}")
    say(f"   {against_training(r, trained)}")
    for c in r.claimed_readings if r.admissible is not None else ():  # an unfit draft's preferences mean nothing
        if c["fit"] is not None and c["points"] == [str(p) for p in fed]:
            say(
                f"   what the engine feeds under that config (measured above), {', '.join(c['boundaries'])}: "
                f"{r.best.pooled_fit - c['fit']:.3f} nats per token worse than the best set"
            )
            break
    if r.verdict == "inconclusive" and r.admissible is not None:  # a tie: what it settles still judges the feed
        n = r.num_layers
        off = [
            f"slot {j} {conventions.boundary_label(p, n)} is none of {', '.join(ks)}"
            for j, (p, ks) in enumerate(zip(fed, r.admissible, strict=False))
            if conventions.boundary_label(p, n) not in ks
        ]
        say(
            "   the tie still settles enough to judge that config: "
            + (
                f"{'; '.join(off)} -- strata validate on this directory blocks it"
                if off
                else "it feeds what the draft may have been trained on"
            )
        )
    say(f"   [{time.perf_counter() - t:.0f} s]")
    return r


def trained_points(art: Path) -> list[CapturePoint]:
    """What a Strata artifact was trained on, from its manifest (the file the probe chapter removes)."""
    return DraftArtifactManifest.model_validate_json((art / ARTIFACT_MANIFEST).read_text()).aux_capture_points


def against_training(r: ProbeReport, trained: list[CapturePoint]) -> str:
    """The probe's answer next to what the draft was trained on (the manifest the probe never saw)."""
    n = r.num_layers
    labels = [conventions.boundary_label(p, n) for p in trained]
    known = f"trained on {', '.join(labels)} (Strata's manifest, removed from this copy)"
    named = [conventions.boundary_label(p, n) for p in r.best.points]
    if r.verdict == "inferred":
        return f"{known}: {'the probe named exactly that' if named == labels else 'the probe named ANOTHER SET'}"
    if r.admissible is None:
        return f"{known}: the probe settled nothing (the draft does not fit this target)"
    exact = [f"slot {j} {k}" for j, (k, ks) in enumerate(zip(labels, r.admissible, strict=True)) if ks == [k]]
    open_ = [
        f"slot {j} {k} among {' or '.join(ks)}"
        for j, (k, ks) in enumerate(zip(labels, r.admissible, strict=True))
        if len(ks) > 1 and k in ks
    ]
    missed = [
        f"slot {j} {k} is none of {', '.join(ks)}"
        for j, (k, ks) in enumerate(zip(labels, r.admissible, strict=True))
        if k not in ks
    ]
    parts = [f"named {', '.join(exact)} exactly"] if exact else []
    if open_:
        parts.append(f"left {'; '.join(open_)} (boundaries the draft reads about equally well)")
    if missed:
        parts.append(f"MISSED {'; '.join(missed)}")
    return f"{known}: the probe {', and '.join(parts)}"


def _chapter_sglang(root: Path, registry: Path, say, engine=None) -> tuple[bool, dict[str, ValidationReport]]:
    """The incident's engine: the same draft served by SGLang, first as exported, then with the
    vLLM export's ids copied into SGLang's nested key -- one list, two tools, other tensors.
    ``engine``: an SGLang replay engine already open for the target (kept open). Returns whether
    the export passed and the copy was blocked, and both reports."""
    from pipeline.engines.sglang.server import find_install
    from pipeline.validate.replay import open_replay_engine

    t = time.perf_counter()
    inst = find_install()
    say(
        "\n== +1 (--sglang) the incident on SGLang, the engine it happened on: served by SGLang's own server, "
        "the feed measured at the draft's fc"
    )
    if inst is None:
        say("   SGLang is not installed: `bash infra/sglang/setup-sglang-cpu.sh .venv-sglang ../shared/vendor`")
        return False, {}
    art, vllm_art = root / "run" / "export" / "sglang", root / "run" / "export" / "vllm"
    cfg = json.loads((art / ARTIFACT_CONFIG).read_text())
    copied = json.loads((vllm_art / ARTIFACT_CONFIG).read_text())[conventions.AUX_KEY]
    bad_cfg = {**cfg, "eagle_config": {**cfg["eagle_config"], conventions.AUX_KEY: copied}}
    (root / "misconfigured-sglang-config.json").write_text(json.dumps(bad_cfg, indent=1))
    serving = {
        "engine": "sglang",
        "replay": "engine",
        "engine_version": inst.version.split("+")[0],
        "dtype": "bfloat16",
        "target": {"path": str(root / "target")},
    }
    cfgs = {}
    for name, extra in (
        ("sglang", {}),
        ("sglang-misconfigured", {"draft_config": str(root / "misconfigured-sglang-config.json")}),
    ):
        path = root / f"validate-{name}.yaml"
        path.write_text(
            _yaml(
                {
                    "artifact": str(art),
                    "report_dir": str(root / "reports" / name),
                    "cost": False,
                    "serving": {**serving, **extra},
                }
            )
        )
        cfgs[name] = load_config(path, ValidateConfig).model_copy(update={"registry": str(registry)})
    owned = engine is None
    if owned:
        engine, _ = open_replay_engine(cfgs["sglang"], target_identity(root / "target").num_layers)
    try:
        say(
            f"   SGLang {inst.version}, as exported (ids {cfg['eagle_config'][conventions.AUX_KEY]} in "
            "eagle_config, SGLang's own labelling):"
        )
        good = run_validate(cfgs["sglang"], engine)
        _say_verdict(say, good)
        say(
            f"   the vLLM export's ids {copied} copied into SGLang's eagle_config (vLLM counts from the embedding, "
            "SGLang from the first layer's output):"
        )
        bad = run_validate(cfgs["sglang-misconfigured"], engine)
        _say_verdict(say, bad)
    finally:
        if owned:
            engine.close()
    say(f"   [{time.perf_counter() - t:.0f} s]")
    return good.decision == "pass" and bad.decision == "block", {"as exported": good, "vllm ids copied": bad}


def _say_verdict(say, r) -> None:
    lines = summary(r)
    keep = [lines[0]] + [
        x
        for x in lines[1:]
        if x.lstrip().startswith(("ok ", "BAD", "acceptance", "- for", "report", "note ", "measured feed"))
    ]
    for line in keep:
        say("   " + line)
