"""Real SGLang (0.5.18, its CPU kernel built by .ci/setup): the engine contract and the gate
through SGLang's own HTTP server, for a Llama target and a DeepSeek-V3-style one (the
incident's family: MLA attention, MoE, SGLang's ``deepseek_v2.py``).

Nothing here stands in for SGLang. Each test module starts one capture server per target
(the replay engine), every served configuration gets a server of its own, and after every test
no SGLang server started by it is left (process group gone, port closed).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import require

from pipeline import conventions
from pipeline.engines.errors import EngineError, EngineUnavailable
from pipeline.engines.sglang import server as sglang_server
from schemas.capture import CapturePoint

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

lo, E = CapturePoint.layer_output, CapturePoint.embedding()
AUX_KEY = conventions.AUX_KEY
RELEASE = "0.5.18"
LAYERS = 8  # with 6 the default ids (2, N//2, N-3) collapse to two and the draft cannot load at all
TRAINED = [lo(1), lo(3), lo(5)]  # r_2, r_4, r_6


# -- pure parts ------------------------------------------------------------------------------
def test_server_arguments_bind_loopback_and_serve_the_draft_as_written(tmp_path):
    args = sglang_server.server_args(tmp_path / "t", 5555, "bfloat16", draft_dir=tmp_path / "d", k=3, cpu=True)
    flag = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--")}
    assert flag["--host"] == "127.0.0.1" and flag["--port"] == "5555"
    assert flag["--speculative-algorithm"] == "EAGLE3" and flag["--speculative-draft-model-path"] == str(tmp_path / "d")
    assert flag["--speculative-num-steps"] == "3" and flag["--speculative-num-draft-tokens"] == "4"
    assert flag["--speculative-eagle-topk"] == "1" and "--disable-radix-cache" in args
    assert flag["--prefill-attention-backend"] == "intel_amx" and flag["--device"] == "cpu"
    plain = sglang_server.server_args(tmp_path / "t", 5555, "bfloat16", cpu=False)
    assert not any(a.startswith("--speculative") for a in plain) and "--device" not in plain


def test_acceptance_counters_that_do_not_reconcile_are_an_error():
    from pipeline.engines.sglang.engine import acceptance_from_meta

    # 1 prefill token + 4 verify steps accepting 0, 1, 2 and 3 drafts = 11 tokens
    good = {
        "spec_verify_ct": 4,
        "spec_num_correct_drafts": 6,
        "completion_tokens": 11,
        "spec_correct_drafts_histogram": [1, 1, 1, 1],
    }
    acc = acceptance_from_meta([good], [list(range(11))], 3)
    assert acc.mean_acceptance_length == pytest.approx(1 + 6 / 4) and acc.acceptance_per_pos == [0.75, 0.5, 0.25]
    # the last step's drafts ran past max_new_tokens: fewer tokens than steps + drafts, by at most k
    capped = acceptance_from_meta([{**good, "completion_tokens": 9}], [list(range(9))], 3)
    assert capped.accepted_per_step == acc.accepted_per_step
    with pytest.raises(EngineError, match="do not reconcile"):
        acceptance_from_meta([good], [list(range(10))], 3)  # tokens emitted != completion_tokens
    with pytest.raises(EngineError, match="do not reconcile"):
        acceptance_from_meta([{**good, "completion_tokens": 7}], [list(range(7))], 3)  # short by more than k
    with pytest.raises(EngineError, match="histogram"):
        acceptance_from_meta([{**good, "spec_correct_drafts_histogram": [2, 1, 0, 1]}], [list(range(11))], 3)
    with pytest.raises(EngineError, match="did not run"):
        acceptance_from_meta([{"completion_tokens": 5}], [list(range(5))], 3)


def test_no_sglang_is_a_clear_error_naming_the_setup(monkeypatch, tiny_target):
    from pipeline.engines.sglang.engine import SGLangEngine

    monkeypatch.setenv(sglang_server.PYTHON_ENV, sys.executable)  # Strata's own env: no SGLang in it
    assert sglang_server.find_install() is None
    with pytest.raises(EngineUnavailable, match="setup-sglang-cpu.sh"):
        SGLangEngine(tiny_target, [lo(1)])


# -- the real server -------------------------------------------------------------------------
def running_servers() -> set[int]:
    """Process groups of every SGLang server on this machine (by their launcher's command line)."""
    out = set()
    for cmd in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmd.read_bytes().split(b"\0")
            if b"sglang.launch_server" in argv:
                out.add(os.getpgid(int(cmd.parent.name)))
        except (OSError, ProcessLookupError):
            continue
    return out


@pytest.fixture(scope="session")
def sglang_install():
    inst = sglang_server.find_install()
    require(
        "SGLang (its own environment)",
        inst is not None,
        "bash infra/sglang/setup-sglang-cpu.sh .venv-sglang ../shared/vendor, as .ci/setup does",
    )
    assert inst.version == RELEASE, f"the SGLang environment has {inst.version}; these tests are for {RELEASE}"
    return inst


def _train_draft(target: Path, root: Path, n_conv: int = 80, release: str = RELEASE) -> Path:
    """HF-extracted fp32 data on TRAINED + final post-norm, a draft trained on it and exported for
    SGLang ``release`` (and vLLM): the SGLang artifact directory."""
    from pipeline.data.stdlib import write_conversations
    from pipeline.extract.job import run_extract
    from pipeline.train.job import run_train
    from schemas.extract import ExtractConfig
    from schemas.train import TrainConfig

    write_conversations(root / "conv.jsonl", n=n_conv)
    run_extract(
        ExtractConfig.model_validate(
            {
                "target": {"path": str(target)},
                "source": {"uri": str(root / "conv.jsonl")},
                "output": {"uri": str(root / "ds")},
                "capture": [*map(str, TRAINED), "final:post_norm"],
                "max_length": 192,
                "engine": {"dtype": "float32", "device": "cpu"},
                "fingerprint": {"probe_samples": 4},
            }
        ),
        progress=False,
        use_ray=False,
    )
    run_train(
        TrainConfig.model_validate(
            {
                "dataset": str(root / "ds"),
                "target": {"path": str(target)},
                "output": str(root / "run"),
                "draft_vocab_size": 1024,
                "ttt_steps": 2,
                "batch_tokens": 1024,
                "epochs": 2,
                "num_workers": 1,
                "eval_fraction": 0.1,
                "optim": {"lr": 3e-3, "warmup_steps": 2},
                "deepspeed": {"zero_stage": 2, "dtype": "float32"},
                "heldout_acceptance": {"prompts": 0},
                "export": {"dtype": "bfloat16", "engines": ["sglang", "vllm"], "engine_versions": {"sglang": release}},
            }
        ),
        use_ray=False,
    )
    return root / "run" / "export" / "sglang"


class Target:
    """A tiny target, a draft trained for it, and one SGLang replay engine for the module."""

    def __init__(self, arch: str, root: Path):
        from pipeline.demo.tiny import make_tiny_target
        from pipeline.validate.replay import open_replay_engine

        self.dir = make_tiny_target(
            root / arch, num_layers=LAYERS, hidden_size=128 if arch == "deepseek_v3" else 64, arch=arch
        )
        self.art = _train_draft(self.dir, root / f"{arch}-draft")
        self.engine, _ = open_replay_engine(self.cfg(), LAYERS)

    def cfg(self, ids: list[int] | None = ..., **extra):  # type: ignore[assignment]
        from schemas.validation import ValidateConfig

        serving = {
            "engine": "sglang",
            "replay": "engine",
            "engine_version": RELEASE,
            "dtype": "bfloat16",
            "target": {"path": str(self.dir)},
        }
        if ids is not ...:
            cfg = json.loads((self.art / "config.json").read_text())
            if ids is None:
                cfg["eagle_config"].pop(AUX_KEY)
            else:
                cfg["eagle_config"][AUX_KEY] = ids
            served = self.art.parent / f"served-{'none' if ids is None else '_'.join(map(str, ids))}.json"
            served.write_text(json.dumps(cfg))
            serving["draft_config"] = str(served)
        return ValidateConfig.model_validate(
            {
                "artifact": str(self.art),
                "serving": serving,
                "cost": False,
                "acceptance_prompts": 2,
                "max_new_tokens": 12,
                **extra,
            }
        )

    def validate(self, ids=...):
        from pipeline.validate.case import load_case
        from pipeline.validate.decide import decide

        return decide(load_case(self.cfg(ids)), self.engine)

    def close(self):
        self.engine.close()


def _close(t: Target) -> None:
    groups = t.engine.process_groups
    t.close()
    assert groups and not any(sglang_server.group_members(g) for g in groups), "an SGLang server outlived its engine"
    assert not set(groups) & running_servers()


@pytest.fixture(scope="module")
def llama(sglang_install, tmp_path_factory):
    t = Target("llama", tmp_path_factory.mktemp("sglang-llama"))
    yield t
    _close(t)


@pytest.fixture(scope="module")
def deepseek(sglang_install, tmp_path_factory):
    t = Target("deepseek_v3", tmp_path_factory.mktemp("sglang-deepseek"))
    yield t
    _close(t)


@pytest.fixture(autouse=True)
def no_server_left_behind(request):
    before = running_servers()
    yield
    targets = [request.getfixturevalue(n) for n in ("llama", "deepseek") if n in request.fixturenames]
    owned = set().union(before, *(t.engine.process_groups for t in targets))
    assert running_servers() <= owned, "a test left an SGLang server running"


def _hf_capture(target: Path, points, seqs):
    from pipeline.engines.hf import HFEngine

    eng = HFEngine(target, points, "bfloat16", "cpu")
    try:
        return eng.capture_tensors(seqs)
    finally:
        eng.close()


@pytest.mark.parametrize("arch", ["llama", "deepseek"])
def test_capture_matches_the_hf_engine_on_the_same_prompts(request, arch):
    """Every boundary SGLang captures, against HF transformers in bf16, within the gate's own match
    tolerance (bf16 rounding at every layer: 0.2-0.7% on the Llama; up to ~3.5% on the MoE target,
    where a near-tie in expert routing can go the other way) -- far below the 30-90% between
    adjacent boundaries."""
    from schemas.validation import Tolerances

    t = request.getfixturevalue(arch)
    seqs = [list(range(5, 45)), list(range(100, 117))]
    got = t.engine.capture_tensors(seqs)
    want = _hf_capture(t.dir, t.engine.points, seqs)
    for p in t.engine.points:
        for g, w in zip(got[str(p)], want[str(p)], strict=True):
            assert g.shape == w.shape
            err = ((g.float() - w.float()).norm() / w.float().norm()).item()
            assert err < Tolerances().match_rel_l2, (arch, str(p), err)
    # and the boundaries are really distinct tensors (a wrong one would fail the check above)
    a, b = got[str(t.engine.points[1])][0].float(), got[str(t.engine.points[2])][0].float()
    assert ((a - b).norm() / b.norm()).item() > 0.1


def _measured(report) -> list[int | None]:
    return [conventions.boundary(s.fed, LAYERS) if s.fed is not None else None for s in report.slots]


def _assert_measured(report, want: list[int]):
    assert all(s.fed_by == "measured" for s in report.slots), report.feed
    assert _measured(report) == want, (report.feed.prefill, report.feed.verify)
    assert report.feed.recorded_rows["prefill"] > 0 and report.feed.recorded_rows["verify"] > 0
    assert report.feed.disagreements == [], report.feed.disagreements


@pytest.fixture(scope="module")
def chapter(llama, tmp_path_factory):
    """``strata demo --sglang``'s chapter, run once on a demo directory holding the llama target and
    its draft: the SGLang export as exported (the correct ids) and the vLLM export's ids copied into
    SGLang's nested key (every id +1 in SGLang's labelling). Its reports serve the tests below."""
    from pipeline.demo.story import _chapter_sglang

    root = tmp_path_factory.mktemp("sglang-chapter")
    (root / "run").mkdir()
    (root / "target").symlink_to(llama.dir)
    (root / "run" / "export").symlink_to(llama.art.parent)
    lines: list[str] = []
    ok, reports = _chapter_sglang(root, root / "registry", lines.append, engine=llama.engine)
    return root, ok, reports, "\n".join(lines)


def test_llama_correct_ids_pass_on_the_measured_feed(llama, chapter):
    from schemas import acceptance as protocol

    cfg = json.loads((llama.art / "config.json").read_text())
    assert cfg["eagle_config"][AUX_KEY] == [1, 3, 5]  # o-labels for SGLang's llama.py: it captures id + 1
    r = chapter[2]["as exported"]
    assert r.decision == "pass", r.reasons
    _assert_measured(r, [2, 4, 6])
    assert max(r.feed.vs_training_rel_l2) < 0.03  # bf16 serving vs the fp32 training values
    # SGLang 0.5.18 on CPU computes its verify-step states without the last k+1 committed tokens
    # (intel_amx_backend.forward_extend passes the committed seq_lens, not + draft tokens): the
    # same layers, ~10% off. Reported, not blocked -- the layer is right, acceptance judges the cost.
    devs = r.feed.verify_deviations
    want = ["o_1 (r_2)", "o_3 (r_4)", "o_5 (r_6)"]
    assert len(devs) == 3 and all(f"{w} again" in d for d, w in zip(devs, want, strict=True)), devs
    # Acceptance from SGLang's counters, reconciled per request with the tokens it emitted (inside
    # acceptance_from_meta, which raises otherwise): the prefill's token, then accepted + 1 per
    # verify step, the last step possibly past max_new_tokens; the histogram adds up.
    acc = r.acceptance.served.model_dump()
    steps, drafts = acc["verify_steps"], round(acc["accepted_per_step"] * acc["verify_steps"])
    prompts, k = acc["prompts"], protocol.SPECULATIVE_TOKENS
    assert prompts == 4  # the probe samples _train_draft's dataset holds (fewer than the protocol's 32)
    assert 0 < acc["emitted_tokens"] <= prompts * protocol.MAX_NEW_TOKENS
    assert 0 <= prompts + steps + drafts - acc["emitted_tokens"] <= prompts * k
    per_pos = acc["acceptance_per_pos"]
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:], strict=False))
    assert sum(per_pos) == pytest.approx(acc["accepted_per_step"])
    assert acc["mean_acceptance_length"] == pytest.approx(1 + acc["accepted_per_step"])
    assert acc["se"] is not None  # per request: SGLang's counters give the standard error over prompts
    assert acc["lossless"] or r.acceptance.lossless_note  # reported; gated only at fp32, which SGLang's CPU path lacks


@pytest.mark.parametrize(
    "name, ids, fed",
    [  # every id +1: the demo chapter's copied ids (below)
        ("every id -1", [0, 2, 4], [1, 3, 5]),
        ("the nested key missing: SGLang's default loop indices (2, N//2, N-3)", None, [2, 4, 5]),
    ],
)
def test_llama_misconfigurations_are_blocked_by_the_measurement_with_the_fix(llama, name, ids, fed):
    r = llama.validate(ids)
    assert r.decision == "block", name
    _assert_measured(r, fed)
    wrong = [s for s in r.slots if not s.ok]
    assert wrong and all("is fed" in s.message for s in wrong), [s.message for s in wrong]
    assert any("eagle_config.eagle_aux_hidden_state_layer_ids" in x and "[1, 3, 5]" in x for x in r.reasons), r.reasons


def test_without_a_rule_for_the_installed_release_the_measurement_decides(llama, monkeypatch):
    """A rule table that knows no SGLang release SGLang runs here: no id list is known to make it
    capture a boundary, so HF transformers captures the reference boundaries and SGLang only
    serves. The correct ids pass and every id +1 is blocked, both on the measured feed alone,
    with one note saying how to derive the rule."""
    from pipeline.conventions import releases
    from pipeline.engines.hf import HFEngine
    from pipeline.validate.case import load_case
    from pipeline.validate.decide import decide
    from pipeline.validate.replay import open_replay_engine

    monkeypatch.setattr(
        releases, "RULES", tuple(x for x in releases.RULES if not (x.engine == "sglang" and x.covers(RELEASE)))
    )
    engine, owned = open_replay_engine(llama.cfg(), LAYERS)
    try:
        assert owned and isinstance(engine.reference, HFEngine) and engine.process_groups == []
        assert len(engine.points) == LAYERS + 1  # r_0..r_N, whatever SGLang itself could capture
        ok = decide(load_case(llama.cfg([1, 3, 5])), engine)
        assert ok.decision == "pass", ok.reasons
        _assert_measured(ok, [2, 4, 6])
        assert ok.engine_reads.rule is None and "derive --engine sglang --release 0.5.18" in ok.engine_reads.note
        wrong = decide(load_case(llama.cfg([2, 4, 6])), engine)
        assert wrong.decision == "block"
        _assert_measured(wrong, [3, 5, 7])
        assert any("no derived rule for sglang 0.5.18" in x for x in wrong.reasons), wrong.reasons
    finally:
        engine.close()


def test_a_draft_trained_elsewhere_is_gated_on_what_sglang_feeds_it(llama, tmp_path):
    """The draft as SpecForge's released exporter writes it (tests/foreign_drafts.py), Strata's files
    gone: its trained points declared (this random-init target's draft barely depends on which layers
    it reads, so the probe reports its evidence beside them rather than inferring them), the feed
    measured through SGLang itself: ids one too high are blocked with the ids to write (the ids
    SpecForge writes pass through vLLM in test_probe.py; on SGLang, the chapter's as-exported run)."""
    from foreign_drafts import specforge_export

    from pipeline.validate.case import load_case
    from pipeline.validate.decide import decide

    d = specforge_export(llama.art, tmp_path / "specforge", [2, 4, 6], tmp_path / "wheels")
    assert not list(d.glob("strata_*"))
    cfg = llama.cfg().model_copy(update={"artifact": str(d)})
    cfg.probe = cfg.probe.model_copy(update={"trained_on": TRAINED, "prompts": 8})
    r = decide(load_case(cfg), llama.engine)
    assert r.decision == "block", r.reasons
    _assert_measured(r, [3, 5, 7])
    assert r.provenance["trained_points"].startswith("declared by whoever trained"), r.provenance
    assert all("not available for an imported draft" in c.message for c in r.identity)
    assert any(f"eagle_config.{AUX_KEY}" in x and "[1, 3, 5]" in x for x in r.reasons), r.reasons


def test_llama_embedding_inserted_cannot_even_be_served_by_0_5_18(llama):
    """Id -1 (the embedding) in SGLang 0.5.18's llama.py: the rule table says it cannot be captured
    before 0.5.22, so the config is refused before anything is served -- and served anyway, SGLang
    fails, which the measurement confirms."""
    r = llama.validate([-1, 1, 3])
    assert r.decision == "block"
    assert any("cannot capture" in x and "embedding" in x for x in r.reasons), r.reasons
    from pipeline.validate.acceptance import draft_dir_with

    cfg = json.loads((llama.art / "config.json").read_text())
    cfg["eagle_config"][AUX_KEY] = [-1, 1, 3]
    d = draft_dir_with(llama.art, cfg, llama.art.parent / "embedding-inserted")
    with pytest.raises(EngineError):
        llama.engine.serve_draft(d, [list(range(5, 25))], 4, 3)


def test_deepseek_first_id_rule_settled_on_the_real_engine(deepseek):
    """SGLang 0.5.18's deepseek_v2.py adds 1 only when the first id is 1: Strata's export [1, 3, 5]
    is fed r_2, r_4, r_6 and passes; a list starting at 0 is read as loop indices, so slot 0 gets
    the embedding. (A loop-index list such as [2, 4, 6] takes that second branch too:
    test_conventions covers it; each served configuration here costs ~45 s of CI.)"""
    cfg = json.loads((deepseek.art / "config.json").read_text())
    assert cfg["eagle_config"][AUX_KEY] == [1, 3, 5]
    r = deepseek.validate([1, 3, 5])
    assert r.decision == "pass", r.reasons
    _assert_measured(r, [2, 4, 6])
    r = deepseek.validate([0, 2, 4])  # every id -1: the embedding inserted, the last slot dropped
    assert r.decision == "block"
    _assert_measured(r, [0, 2, 4])
    assert any("slot 0 is fed embedding (r_0)" in x and "trained on o_1 (r_2)" in x for x in r.reasons), r.reasons


def test_deepseek_missing_nested_key_falls_back_to_the_default_and_is_blocked(deepseek):
    r = deepseek.validate(None)
    assert r.decision == "block"
    _assert_measured(r, [2, 4, 5])
    assert any("silently uses its default" in x for x in r.reasons), r.reasons


def test_regeneration_through_sglang_writes_the_targets_greedy_answers(
    sglang_install, tiny_target, conversations, tmp_path
):
    """``strata regenerate`` with ``engine.name: sglang`` (a plain SGLang server for the target,
    gone when the job ends: the autouse check): the release in the record, the counts HF's run
    has. Every token SGLang picks is HF fp32's argmax or within bf16 rounding of it (teacher-forced
    logits); a random-init target has near-ties, so whole answers may differ where one flips."""
    from transformers import AutoModelForCausalLM

    from pipeline.data.chat import ChatEncoder
    from pipeline.data.conversations import parse_row
    from pipeline.engines.generation import SGLangGenerator
    from pipeline.regenerate.job import run_regenerate
    from schemas.regenerate import GenerateEngineConfig, RegenerateConfig, SamplingConfig

    def regenerate(name: str, engine: dict):
        return run_regenerate(
            RegenerateConfig.model_validate(
                {
                    "target": {"path": str(tiny_target)},
                    "source": {"uri": str(conversations)},
                    "output": {"uri": str(tmp_path / name), "rows_per_unit": 8},
                    "engine": engine,
                    "max_new_tokens": 12,
                    "max_length": 512,
                }
            ),
            progress=False,
            use_ray=False,
        )

    got = regenerate("sglang", {"name": "sglang", "dtype": "bfloat16", "max_model_len": 1024})
    ref = regenerate("hf", {"name": "hf", "dtype": "float32", "device": "cpu"})
    assert got.engine["name"] == "sglang" and got.engine["version"] == RELEASE and got.engine["dtype"] == "bfloat16"
    assert got.totals == ref.totals and got.totals["written"] + got.totals["quarantined"] == got.totals["rows"] == 40
    a = (tmp_path / "sglang" / "conversations.jsonl").read_text().splitlines()
    b = (tmp_path / "hf" / "conversations.jsonl").read_text().splitlines()
    assert sum(x == y for x, y in zip(a, b, strict=True)) >= len(b) // 2

    enc = ChatEncoder(tiny_target, 1 << 30)
    prompts = []
    for line in conversations.read_text().splitlines():
        m = parse_row(line.encode()).messages
        prompts.append(enc.encode_prompt(m[: next(j for j, x in enumerate(m) if x["role"] == "assistant")]))
    gen = SGLangGenerator(tiny_target, GenerateEngineConfig(name="sglang", dtype="bfloat16", max_model_len=1024))
    try:
        outs = gen.generate(prompts, 12, SamplingConfig(), [0] * len(prompts))
    finally:
        gen.close()
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    gaps = []
    for p, o in zip(prompts, outs, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([p + o])).logits[0, len(p) - 1 : -1]
        gaps += (logits.max(-1).values - logits.gather(1, torch.tensor(o)[:, None])[:, 0]).tolist()
    # measured: 10 of 480 tokens not the argmax, at most 0.10 below it (logits' std ~4)
    assert len(gaps) >= len(prompts) and max(gaps) < 0.3 and sum(g > 0 for g in gaps) <= 0.05 * len(gaps), sorted(gaps)[
        -12:
    ]


def test_fp32_on_cpu_is_refused_with_what_to_set(llama):
    with pytest.raises(EngineError, match="bfloat16"):
        sglang_server.SGLangServer(llama.dir, dtype="float32")


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="CUDA SGLang with CUDA graphs: run `pytest -m gpu` on a GPU cluster with sglang installed",
)
def test_gpu_sglang_with_cuda_graphs_measures_the_feed_and_says_how_many_verify_rows(tmp_path):
    """On a GPU, draft steps replayed from CUDA graphs run no Python: the recorder sees prefill and
    eager steps only, and the report says how many verify rows it recorded."""
    from pipeline.demo.tiny import make_tiny_target
    from pipeline.validate.job import run_validate
    from schemas.validation import ValidateConfig

    inst = sglang_server.find_install()
    require("SGLang", inst is not None, f"install sglang or set ${sglang_server.PYTHON_ENV}")
    target = make_tiny_target(tmp_path / "t", num_layers=LAYERS, hidden_size=128)
    art = _train_draft(target, tmp_path / "d", release=inst.version)
    r = run_validate(
        ValidateConfig.model_validate(
            {
                "artifact": str(art),
                "acceptance_prompts": 4,
                "cost": False,
                "serving": {
                    "engine": "sglang",
                    "replay": "engine",
                    "dtype": "bfloat16",
                    "target": {"path": str(target)},
                },
            }
        )
    )
    print("SGLang recorded draft-input rows:", r.feed.recorded_rows)
    assert r.decision == "pass", r.reasons
    assert all(s.fed_by == "measured" for s in r.slots) and r.feed.disagreements == [], r.feed


def test_the_demo_chapter_blocks_the_incident_on_sglang(llama, chapter):
    """The SGLang export passes; the vLLM export's ids copied into SGLang's nested key -- every id
    +1 in SGLang's labelling -- are blocked by the measured feed, with the fix; both verdicts land
    in the registry."""
    from pipeline.registry.registry import Registry
    from pipeline.store.objects import LocalStore

    root, ok, reports, text = chapter
    assert ok, text
    assert "PASS" in text and "BLOCK" in text and "shifted by +1" in text, text
    copied = json.loads((root / "misconfigured-sglang-config.json").read_text())["eagle_config"][AUX_KEY]
    assert copied == json.loads((llama.art.parent / "vllm" / "config.json").read_text())[AUX_KEY] == [2, 4, 6]
    bad = reports["vllm ids copied"]
    assert bad.decision == "block"
    _assert_measured(bad, [3, 5, 7])
    wrong = [s for s in bad.slots if not s.ok]
    assert wrong and all("is fed" in s.message for s in wrong), [s.message for s in wrong]
    assert any("eagle_config.eagle_aux_hidden_state_layer_ids" in x and "[1, 3, 5]" in x for x in bad.reasons)
    digest = json.loads((llama.art / "strata_artifact.json").read_text())["content_digest"]
    records = [r for r, _ in Registry(LocalStore(root / "registry")).all_records(digest)]
    assert sorted(r.decision for r in records) == ["block", "pass"]


def test_extraction_through_sglang_carries_its_native_ids_and_matches_hf(deepseek, tmp_path):
    """The extraction job with ``engine.name: sglang`` (in-process, no Ray): SGLang's own capture
    of the incident's family, each column's provenance naming SGLang 0.5.18 and its native id
    for the point, values equal to the HF engine's within the match tolerance."""
    from pipeline.data.stdlib import write_conversations
    from pipeline.extract.job import run_extract
    from pipeline.store.reader import DatasetReader
    from schemas.extract import ExtractConfig
    from schemas.validation import Tolerances

    write_conversations(tmp_path / "conv.jsonl", n=6)

    def extract(engine: str) -> DatasetReader:
        run_extract(
            ExtractConfig.model_validate(
                {
                    "target": {"path": str(deepseek.dir)},
                    "source": {"uri": str(tmp_path / "conv.jsonl")},
                    "output": {"uri": str(tmp_path / engine)},
                    "capture": ["layer_output:1", "layer_output:4"],
                    "max_length": 128,
                    "engine": {"name": engine, "dtype": "bfloat16", "device": "cpu"},
                    "fingerprint": {"probe_samples": 0},
                }
            ),
            progress=False,
            use_ray=False,
        )
        return DatasetReader(str(tmp_path / engine))

    sr, hr = extract("sglang"), extract("hf")
    prov = {str(p): sr.provenance(p) for p in sr.points}
    assert {k: (v.engine.name, v.engine.version, v.boundary) for k, v in prov.items()} == {
        "layer_output:1": ("sglang", RELEASE, "r_2"),
        "layer_output:4": ("sglang", RELEASE, "r_5"),
    }
    for k, p in (("layer_output:1", lo(1)), ("layer_output:4", lo(4))):  # each id, read alone, names its point
        assert conventions.points_read_from(
            [prov[k].engine.native_id], "sglang", LAYERS, "deepseek_v2", release=RELEASE
        ) == [p]
    hf = {s.sample_id: s for s in hr.iter_samples()}
    n = 0
    for s in sr.iter_samples():
        h = hf.pop(s.sample_id)
        for p in ("layer_output:1", "layer_output:4"):
            a, b = s.tensors[p].float(), h.tensors[p].float()
            assert ((a - b).norm() / b.norm()).item() < Tolerances().match_rel_l2, (s.sample_id, p)
        n += 1
    assert n == 6 and not hf
