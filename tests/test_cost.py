"""On the trained tiny target: held-out acceptance recorded at training, and the cost table a
blocked configuration gets -- measured through vLLM itself, never for a passing one, and
nothing it measures moves a channel or stays loaded."""

from __future__ import annotations

import json

import pytest

from pipeline.fingerprint import Fingerprints
from pipeline.validate.job import run_validate
from schemas.artifact import ARTIFACT_MANIFEST, DraftArtifactManifest
from schemas.validation import ValidateConfig

AUX_KEY = "eagle_aux_hidden_state_layer_ids"


def test_heldout_acceptance_is_recorded_on_prompts_never_trained_on(pretrained_run, tmp_path):
    from pipeline.store.reader import load_manifest
    from pipeline.train.job import prepare
    from schemas.train import TrainConfig

    ds = pretrained_run.parent / "ds"
    final = json.loads((pretrained_run / "final_metrics.json").read_text())
    held = final["heldout_acceptance"]
    fp = Fingerprints.load(str(ds), name=load_manifest(str(ds)).fingerprints["path"])
    # The prompts are prefixes of the probe samples ...
    assert held["prompt_sample_ids"] == fp.sample_ids[: held["prompts"]] and held["prompts"] == 8
    assert fp.prompts(8) == [fp.tokens(i)[: len(p)] for i, p in enumerate(fp.prompts(8))]
    # ... which training's plan holds out, even where the eval fraction alone would not.
    run_cfg = json.loads((pretrained_run / "run.json").read_text())["cfg"]
    for fraction in (0.05, 0.0):
        plan = prepare(
            TrainConfig.model_validate(
                {**run_cfg, "output": str(tmp_path / f"plan-{fraction}"), "eval_fraction": fraction}
            )
        )
        trained_on = {r["sample_id"] for r in plan.train_refs}
        assert trained_on and not trained_on & set(fp.sample_ids)
        assert set(fp.sample_ids) <= {r["sample_id"] for r in plan.eval_refs}
    # Per position, next to the training accuracy's prediction; lossless greedy decoding.
    assert held["k"] == 3 and held["lossless"]
    per_pos = held["acceptance_per_pos"]
    assert len(per_pos) == 3 and per_pos == sorted(per_pos, reverse=True)  # a chain: j only after j-1
    assert held["mean_acceptance_length"] == pytest.approx(1 + held["accepted_per_step"])
    assert held["predicted_accepted_per_step"] > 0
    # In metrics.jsonl, and carried by the exported artifact.
    lines = [json.loads(x) for x in (pretrained_run / "metrics.jsonl").read_text().splitlines()]
    assert [x for x in lines if x.get("kind") == "heldout_acceptance"] == [held]
    manifest = DraftArtifactManifest.model_validate_json(
        (pretrained_run / "export" / "vllm" / ARTIFACT_MANIFEST).read_text()
    )
    assert manifest.metrics["heldout_acceptance"] == held
    # The draft learned the trained target: it accepts more than an untrained draft's ~1.0.
    assert held["mean_acceptance_length"] > 1.2, held


def test_cost_rows_count_the_turns_that_ended():
    """A generation ended its turn when its last token is a stop id (not when one occurs inside
    it); tokens/s counts every token after each prompt's first."""
    from pipeline.engines.base import DecodeTiming
    from pipeline.validate.cost import _row

    base = DecodeTiming(outputs=[[5, 4], [4, 2, 3], [7]], prefill_s=[0.1] * 3, total_s=[0.2, 0.3, 0.1], acceptance=None)
    row = _row("no speculation", "-", base, None, frozenset({4, 9}))
    assert (row.new_tokens, row.ended_turn) == (6, 1)
    assert row.decode_tokens_per_s == pytest.approx((1 + 2 + 0) / (0.1 + 0.2 + 1e-9), rel=1e-3)
    other = DecodeTiming(outputs=[[5, 4], [4, 2, 9], [7]], prefill_s=[0.1] * 3, total_s=[0.2] * 3, acceptance=None)
    again = _row("draft", "ids [1]", other, base, frozenset({4, 9}))
    assert again.ended_turn == 2 and again.same_output_as_no_speculation is False


def _agree(a: dict, b: dict, z: float = 3.0) -> None:
    """Two measurements of one mean acceptance length agree within z combined standard errors --
    exactly, where every prompt accepted alike (no noise: a draft that predicts the target's short
    answers perfectly has a standard error of 0)."""
    se = (a["se"] ** 2 + b["se"] ** 2) ** 0.5
    diff = abs(a["mean_acceptance_length"] - b["mean_acceptance_length"])
    what = [(m.get("measured_by"), m["mean_acceptance_length"], m["se"], m.get("verify_steps")) for m in (a, b)]
    assert diff <= z * se if se > 0 else diff == 0, what


def validate(run, target, tmp_path, ids=None, **kw):
    art = run / "export" / "vllm"
    cfg = json.loads((art / "config.json").read_text())
    if ids is not None:
        cfg[AUX_KEY] = ids
    p = tmp_path / f"config-{len(list(tmp_path.iterdir()))}.json"
    p.write_text(json.dumps(cfg))
    return run_validate(
        ValidateConfig.model_validate(
            {
                "artifact": str(art),
                "serving": {
                    "engine": "vllm",
                    "replay": "engine",
                    "dtype": "float32",
                    "max_model_len": 512,
                    "target": {"path": str(target)},
                    "draft_config": str(p),
                },
                **kw,
            }
        )
    )


@pytest.mark.vllm
def test_cost_table_for_a_blocked_config_only(vllm_engine, pretrained_run, pretrained_target, tmp_path):
    from pipeline.registry.registry import Registry
    from pipeline.store.objects import LocalStore
    from pipeline.validate.job import serving_for_channel

    registry = tmp_path / "registry"
    ok = validate(pretrained_run, pretrained_target, tmp_path, registry=str(registry))
    assert ok.decision == "pass", ok.reasons
    assert ok.cost is None  # never for a passing configuration
    # One definition of acceptance (pipeline.acceptance), one protocol (schemas.acceptance): vLLM's
    # counters, the reference decoding and training's held-out measurement of this draft and this
    # (correct) configuration agree within their noise.
    served, ref = ok.acceptance.served.model_dump(), ok.acceptance.reference.model_dump()
    held = json.loads((pretrained_run / "final_metrics.json").read_text())["heldout_acceptance"]
    assert served["prompts"] == ref["prompts"] == held["prompts"] == 8 and held["max_new_tokens"] == 32
    for other in (ref, held):
        _agree(served, other)
    assert ref["verify_steps"] == held["verify_steps"]  # the same decoding, at training and here
    reg = Registry(LocalStore(registry))
    # The channel deploys the passing configuration; promote, then validate the incident's config.
    good_cfg = tmp_path / "validate-good.yaml"
    good_cfg.write_text(
        json.dumps(
            {
                "artifact": str(pretrained_run / "export" / "vllm"),
                "serving": {
                    "engine": "vllm",
                    "dtype": "float32",
                    "max_model_len": 512,
                    "target": {"path": str(pretrained_target)},
                    "draft_config": str(tmp_path / "config-0.json"),
                },
            }
        )
    )
    reg.create_channel("production", serving_for_channel(str(good_cfg)))
    before = reg.promote(ok.artifact_digest, "production")
    history = len(reg.history("production"))

    # The incident: the embedding inserted first, the last trained layer dropped. Its table reuses
    # the engine validation served it with and the passing configuration's: it starts the target alone.
    starts = vllm_engine._starts
    bad = validate(pretrained_run, pretrained_target, tmp_path, ids=[0, 2, 6], registry=str(registry))
    assert vllm_engine._starts - starts == 2, "EAGLE-3 as written, then the target alone"
    assert bad.decision == "block"
    rows = {r.configuration: r.model_dump() for r in bad.cost.rows}
    base, written, fixed = rows["no speculation"], rows["draft, config as written"], rows["draft, correct ids"]
    assert written["draft_config"] == "ids [0, 2, 6]" and fixed["draft_config"] == "ids [2, 6, 9]"
    assert base["mean_acceptance_length"] is None and base["decode_tokens_per_s"] > 0
    for r in (written, fixed):
        assert r["decode_tokens_per_s"] > 0 and r["acceptance_per_pos"] == sorted(r["acceptance_per_pos"], reverse=True)
        # vLLM's accepted-tokens and per-position counters agree (the table rounds each to 3 places).
        assert r["mean_acceptance_length"] == pytest.approx(1 + sum(r["acceptance_per_pos"]), abs=2.5e-3)
        assert r["same_output_as_no_speculation"]  # speculation is lossless either way (fp32)
        assert r["speedup_vs_no_speculation"] == pytest.approx(
            r["decode_tokens_per_s"] / base["decode_tokens_per_s"], rel=1e-2
        )
    for r in (written, fixed):
        assert 1.0 <= r["mean_acceptance_length"] <= 4.0 and r["mean_acceptance_length_se"] is not None
        assert r["decode_tokens_per_s_se"] > 0
    # Each generation stops at the end of its turn or at the cap of 32 tokens, nothing else, and the
    # draft changes neither. (How many of the 8 end inside 32 tokens is the trained target's doing,
    # ~1 in 5 here, and may be none: test_cost_rows_count_the_turns_that_ended counts them.)
    for r in (written, fixed):
        assert (r["new_tokens"], r["ended_turn"]) == (base["new_tokens"], base["ended_turn"])
    assert 0 <= base["ended_turn"] <= 8 and base["new_tokens"] <= 8 * 32
    assert base["ended_turn"] > 0 or base["new_tokens"] == 8 * 32, base
    # The correct-ids row is the passing configuration: the same measurement as validation's.
    _agree(
        served, {"mean_acceptance_length": fixed["mean_acceptance_length"], "se": fixed["mean_acceptance_length_se"]}
    )
    assert bad.cost.note.startswith("measured for this report only")
    # Nothing moved the channel, and no draft loaded for the table is still being served.
    assert reg.pointer("production")[0] == before and len(reg.history("production")) == history
    loaded = [k[1] for k in vllm_engine.running("eagle3")]
    assert not [k for k in loaded if "strata-cost-" in k or "strata-served-draft-" in k], loaded

    # The text report carries the table, and one line per acceptance measurement; the Markdown
    # report one table row per measurement (cost: false leaving the table out is
    # test_vllm_engine's wrong-config case).
    from pipeline.validate.report import acceptance_table, summary

    text = "\n".join(summary(bad))
    assert "what this configuration would cost" in text and "draft, correct ids" in text
    lines = [x for x in summary(ok) if x.lstrip().startswith("acceptance, ")]
    assert len(lines) == 3 and all("mean acceptance length" in x and " +- " in x for x in lines), lines
    table = acceptance_table(ok.acceptance)
    assert table[0].startswith("| configuration | measured by | prompts | verify steps | mean length +- SE")
    assert [r.split(" | ")[0] for r in table[2:5]] == [
        "| served as configured",
        "| reference decoding, the points the engine feeds",
        "| at training, held-out prompts",
    ]


def test_a_served_copy_is_one_directory_per_config_and_weights_until_released(tmp_path):
    """Validation's serving and its cost table load the same copy (one engine); another config or
    rewritten weights get another, and releasing unloads and removes it."""
    from pipeline.validate.acceptance import release_served, served_draft_dir

    art = tmp_path / "art"
    art.mkdir()
    (art / "config.json").write_text(json.dumps({AUX_KEY: [1, 2, 3]}))
    (art / "model.safetensors").write_bytes(b"w" * 8)
    same = tmp_path / "same.json"
    same.write_text(json.dumps({AUX_KEY: [1, 2, 3]}))
    assert served_draft_dir(art, same) == (art, False)  # the artifact's own config: no copy
    other = tmp_path / "other.json"
    other.write_text(json.dumps({AUX_KEY: [0, 2, 6]}))
    d, copied = served_draft_dir(art, other)
    assert copied and json.loads((d / "config.json").read_text()) == {AUX_KEY: [0, 2, 6]}
    assert (d / "model.safetensors").read_bytes() == b"w" * 8 and served_draft_dir(art, other)[0] == d
    (art / "model.safetensors").write_bytes(b"v" * 9)  # retrained in place
    d2 = served_draft_dir(art, other)[0]
    assert d2 != d and (d2 / "model.safetensors").read_bytes() == b"v" * 9

    class Engine:
        released: list = []

        def release_draft(self, path):
            self.released.append(path)

    release_served(Engine(), art, other)
    assert Engine.released == [d2] and not d2.exists()
    release_served(Engine(), art, other)  # nothing left: nothing to do
    assert Engine.released == [d2]


def test_no_cost_flag_parses():
    from pipeline.cli import build_parser

    assert build_parser().parse_args(["validate", "--config", "v.yaml", "--no-cost"]).no_cost
    assert not build_parser().parse_args(["validate", "--config", "v.yaml"]).no_cost
