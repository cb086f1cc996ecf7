import json
import os
import shutil

import pytest

from pipeline.identity import file_sha256, target_identity
from schemas.config import ConfigError, load_config
from schemas.extract import ExtractConfig


def test_identity_digests_and_key(tiny_target, tmp_path):
    a = target_identity(tiny_target)
    assert a.num_layers == 6 and a.hidden_size == 64 and a.architecture == "LlamaForCausalLM"
    assert [w.name for w in a.weights] == ["model.safetensors"]
    assert a.chat_template_sha256 and a.tokenizer_sha256 and a.config_sha256
    copy = shutil.copytree(tiny_target, tmp_path / "copy")
    b = target_identity(copy, name="renamed")
    assert a.key == b.key and a.differences(b) == []  # content decides, not path or name
    (copy / "chat_template.jinja").write_text("{{ messages }}")
    c = target_identity(copy)
    assert c.key != a.key and [d.split(":")[0] for d in a.differences(c)] == ["chat_template"]


def test_a_multimodal_wrapper_is_read_through_its_text_config(tiny_target, tmp_path):
    """Kimi-K2.5-style wrappers put the text model (a DeepSeek-V3 here) under ``text_config``:
    its layer count, width and model type decide, not the wrapper's top level."""
    import json

    from pipeline import conventions
    from pipeline.draft.model import DraftConfig
    from pipeline.identity import target_config

    wrapped = shutil.copytree(tiny_target, tmp_path / "wrapped")
    text = {**json.loads((tiny_target / "config.json").read_text()), "model_type": "deepseek_v3"}
    (wrapped / "config.json").write_text(
        json.dumps(
            {"model_type": "some_vlm_wrapper", "num_hidden_layers": 27, "hidden_size": 1152, "text_config": text}
        )
    )
    ident = target_identity(wrapped)
    assert (ident.num_layers, ident.hidden_size, ident.vocab_size) == (6, 64, text["vocab_size"])
    cfg = target_config(wrapped)
    assert conventions.engine_family("sglang", cfg) == conventions.engine_family("vllm", cfg) == "DeepseekV3ForCausalLM"
    draft = DraftConfig.from_target(cfg, 3, 256)
    assert draft.hidden_size == draft.target_hidden_size == 64


def test_weight_digest_is_cached_by_path_size_mtime(tmp_path):
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"a" * 1000)
    st = f.stat()
    d1 = file_sha256(f)
    f.write_bytes(b"b" * 1000)  # same size...
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # ...same mtime: served from the cache
    assert file_sha256(f) == d1
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert file_sha256(f) != d1  # changed mtime: hashed again
    # Files that are gone leave the cache at its next write, so it does not grow run after run.
    from pipeline.identity import _cache_path

    gone = tmp_path / "gone.safetensors"
    gone.write_bytes(b"c")
    file_sha256(gone)
    gone.unlink()
    other = tmp_path / "other.safetensors"
    other.write_bytes(b"d")
    file_sha256(other)
    keys = json.loads(_cache_path().read_text())
    assert not any(k.startswith(str(gone.resolve()) + "|") for k in keys)
    assert any(k.startswith(str(other.resolve()) + "|") for k in keys)


def test_missing_model_dir_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        target_identity(tmp_path)


def write(tmp_path, text):
    p = tmp_path / "extract.yaml"
    p.write_text(text)
    return p


def test_config_errors_name_the_field(tmp_path):
    base = "target: {path: /m}\nsource: {uri: c.jsonl}\noutput: {uri: /o}\n"
    with pytest.raises(ConfigError, match=r"engine\.dtype: .*'fp8'"):
        load_config(write(tmp_path, base + "engine: {dtype: fp8}\n"), ExtractConfig)
    with pytest.raises(ConfigError, match=r"capture: .*item 0: unknown capture point 'layer3'"):
        load_config(write(tmp_path, base + "capture: [layer3]\n"), ExtractConfig)
    with pytest.raises(ConfigError, match=r"capture: .*listed twice"):
        load_config(write(tmp_path, base + "capture: [embedding, embedding]\n"), ExtractConfig)
    with pytest.raises(ConfigError, match=r"output\.rows_per_shard"):
        load_config(write(tmp_path, base.replace("{uri: /o}", "{uri: /o, rows_per_shard: 0}")), ExtractConfig)
    with pytest.raises(ConfigError, match=r"target: Field required"):
        load_config(write(tmp_path, "source: {uri: c.jsonl}\noutput: {uri: /o}\n"), ExtractConfig)
    with pytest.raises(ConfigError, match=r"typo_key: Extra inputs are not permitted"):
        load_config(write(tmp_path, base + "typo_key: 1\n"), ExtractConfig)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml", ExtractConfig)
    cfg = load_config(
        write(tmp_path, base + "capture: [embedding, 'layer_output:3', 'final:post_norm']\n"), ExtractConfig
    )
    assert [str(p) for p in cfg.capture] == ["embedding", "layer_output:3", "final:post_norm"]


def test_a_retired_key_is_dropped_with_a_warning_a_typo_still_fails(tmp_path):
    """ray.cpus_per_tokenize_task never changed the data and capture actors now tokenize: an old
    config keeps running and says to remove it; a misspelt key is still an error."""
    base = "target: {path: /m}\nsource: {uri: c.jsonl}\noutput: {uri: /o}\n"
    with pytest.warns(FutureWarning, match="ray.cpus_per_tokenize_task is ignored"):
        cfg = load_config(
            write(tmp_path, base + "ray: {cpus_per_actor: 2, cpus_per_tokenize_task: 0.5}\n"), ExtractConfig
        )
    assert cfg.ray.cpus_per_actor == 2 and "cpus_per_tokenize_task" not in cfg.ray.model_dump()
    with pytest.raises(ConfigError, match=r"ray\.cpus_per_tokenise_task: Extra inputs are not permitted"):
        load_config(write(tmp_path, base + "ray: {cpus_per_tokenise_task: 0.5}\n"), ExtractConfig)


def test_tiny_target_is_deterministic(tiny_target, tmp_path):
    from pipeline.demo.tiny import make_tiny_target

    again = make_tiny_target(tmp_path / "again", num_layers=6, hidden_size=64)
    a, b = target_identity(tiny_target), target_identity(again)
    assert a.key == b.key and a.weights_sha256 == b.weights_sha256 and a.tokenizer_sha256 == b.tokenizer_sha256
    other = target_identity(make_tiny_target(tmp_path / "seed1", num_layers=6, hidden_size=64, seed=1))
    assert other.weights_sha256 != a.weights_sha256 and other.tokenizer_sha256 == a.tokenizer_sha256
