"""The command line as other programs use it: ``--json`` prints exactly one JSON document on
stdout (vLLM, Ray and progress output go to stderr), and exit codes mean the same thing for
every command (0 done, 1 failure, 2 unusable input, 3 verdict against, 75 lease held)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.cli import main as strata

REPO = Path(__file__).resolve().parents[1]


def validate_config(tmp_path: Path, art: Path, target: Path, replay: str = "hf", **serving) -> Path:
    p = tmp_path / f"validate-{len(list(tmp_path.iterdir()))}.yaml"
    p.write_text(
        json.dumps(
            {
                "artifact": str(art),
                "acceptance_prompts": 2,
                "max_new_tokens": 8,
                "serving": {
                    "engine": "vllm",
                    "replay": replay,
                    "dtype": "float32",
                    "max_model_len": 512,
                    "target": {"path": str(target)},
                    **serving,
                },
            }
        )
    )
    return p


@pytest.mark.vllm
def test_validate_json_through_vllm_is_one_document_on_stdout(vllm_engine, trained_run, tiny_target, tmp_path):
    """vLLM really starts (replay and EAGLE-3 serving) in a separate process and logs plenty."""
    cfg = validate_config(tmp_path, trained_run / "export" / "vllm", tiny_target, replay="engine")
    run = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "validate", "--config", str(cfg), "--json", "--no-cost"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)  # the whole of stdout: one JSON document
    assert report["decision"] == "pass" and report["acceptance"]["served"]["measured_by"].startswith("vllm")
    assert "vllm" in run.stderr.lower()  # vLLM's own logs were there, on stderr


def test_inspect_and_registry_json(trained_run, tmp_path, capsys):
    ds = trained_run.parent / "ds"
    assert strata(["inspect", str(ds), "--verify", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verification"] == {"ok": True, "problem": None} and doc["totals"]["rows"] > 0

    reg, art = str(tmp_path / "registry"), trained_run / "export" / "vllm"
    assert strata(["registry", "add", str(art), "--registry", reg, "--json"]) == 0
    digest = json.loads(capsys.readouterr().out)["content_digest"]
    assert strata(["registry", "ls", "--registry", reg, "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [a["content_digest"] for a in listing["artifacts"]] == [digest] and listing["channels"] == {}
    assert strata(["registry", "show", digest, "--registry", reg, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["records"] == []
    assert strata(["registry", "show", "0" * 64, "--registry", reg, "--json"]) == 2
    err = json.loads(capsys.readouterr().out)
    assert err["exit_code"] == 2 and "no artifact" in err["error"]
    assert strata(["registry", "history", "production", "--registry", reg, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_unusable_inputs_exit_2_not_1(trained_run, tiny_target, tmp_path, capsys):
    """An architecture no rule covers, an id list no reading rule maps, a missing file: input to fix
    (2), with a JSON error document under --json."""
    mamba = shutil.copytree(tiny_target, tmp_path / "mamba")
    cfg = json.loads((mamba / "config.json").read_text())
    (mamba / "config.json").write_text(
        json.dumps({**cfg, "model_type": "mamba", "architectures": ["MambaForCausalLM"]})
    )
    art = trained_run / "export" / "vllm"
    assert strata(["validate", "--config", str(validate_config(tmp_path, art, mamba)), "--json"]) == 2
    out = capsys.readouterr()
    assert (
        json.loads(out.out)["exit_code"] == 2 and "no vllm rule is known for architecture MambaForCausalLM" in out.err
    )

    unmappable = tmp_path / "ids.json"
    unmappable.write_text(
        json.dumps({**json.loads((art / "config.json").read_text()), "eagle_aux_hidden_state_layer_ids": [1, 2, 40]})
    )
    code = strata(
        ["validate", "--config", str(validate_config(tmp_path, art, tiny_target, draft_config=str(unmappable)))]
    )
    # A verdict on the configuration (the engine would not start with it), naming the tensor.
    assert code == 3 and "r_40 (no such boundary: the target has 6 layers)" in capsys.readouterr().out

    extract_cfg = tmp_path / "extract.yaml"
    extract_cfg.write_text(
        json.dumps(
            {
                "target": {"path": str(mamba)},
                "source": {"uri": str(tmp_path / "none.jsonl")},
                "output": {"uri": str(tmp_path / "ds")},
                "capture": ["layer_output:1"],
                "engine": {"name": "vllm"},
            }
        )
    )
    assert strata(["extract", "--config", str(extract_cfg)]) == 2
    assert "no vllm rule is known for architecture MambaForCausalLM" in capsys.readouterr().err
    assert strata(["inspect", str(tmp_path / "nowhere"), "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["exit_code"] == 2
