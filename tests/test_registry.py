"""Registry on local disk and on a real S3 server: conditional channel updates, records
bound to artifact digest and serving configuration, append-only audit."""

import threading
import uuid

import pytest

from pipeline.draft.export import export_draft
from pipeline.draft.model import DraftConfig, Eagle3Draft, init_weights
from pipeline.registry.registry import PromotionRefused, Registry
from pipeline.store.objects import LocalStore, S3Store
from schemas.capture import CapturePoint as C
from schemas.config import S3Config
from schemas.identity import TargetIdentity
from schemas.registry import Deployment, ValidationRecord

TARGET = TargetIdentity(
    model_name="fake",
    model_path="/nowhere",
    architecture="LlamaForCausalLM",
    num_layers=6,
    hidden_size=16,
    vocab_size=40,
    weights=[],
    weights_sha256="w",
    config_sha256="c",
    tokenizer=[],
    tokenizer_sha256="t",
    chat_template_sha256="x",
)
SERVING = Deployment(
    engine="vllm", engine_version="0.32.0", dtype="bfloat16", draft_config_sha256="cfg", target_key=TARGET.key
)


def artifact(tmp_path, seed: int):
    cfg = DraftConfig(
        hidden_size=16,
        target_hidden_size=16,
        num_aux=3,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        vocab_size=40,
        draft_vocab_size=20,
    )
    m = Eagle3Draft(cfg)
    init_weights(m, seed=seed)
    d = tmp_path / f"draft-{seed}"
    return d, export_draft(
        m, d, "vllm", [C.layer_output(1), C.layer_output(2), C.layer_output(3)], TARGET
    ).content_digest


def record(digest, serving=SERVING, decision="pass", reasons=()):
    return ValidationRecord(
        record_id=uuid.uuid4().hex[:12],
        artifact_digest=digest,
        serving=serving,
        decision=decision,
        reasons=list(reasons),
    )


@pytest.fixture(params=["local", "s3"])
def registry(request, tmp_path):
    if request.param == "local":
        return Registry(LocalStore(tmp_path / "registry"))
    s3 = request.getfixturevalue("s3_server")
    return Registry(
        S3Store(f"s3://{s3['bucket']}/registry-{uuid.uuid4().hex[:8]}", S3Config(endpoint_url=s3["endpoint"]))
    )


def test_promotion_requires_a_passing_record_for_the_channel_deployment(registry, tmp_path):
    d, digest = artifact(tmp_path, 1)
    registry.add_artifact(d)
    registry.create_channel("production", SERVING)
    with pytest.raises(PromotionRefused, match="no validation record"):
        registry.promote(digest, "production")
    other = SERVING.model_copy(update={"dtype": "float32"})
    registry.add_record(record(digest, serving=other))  # passing, but for another serving config
    with pytest.raises(PromotionRefused, match=f"records exist for \\['{other.key}'\\]"):
        registry.promote(digest, "production")
    registry.add_record(record(digest, decision="block", reasons=["slot 0 carries o_2, trained on o_1"]))
    with pytest.raises(PromotionRefused, match="blocked it: slot 0 carries o_2"):
        registry.promote(digest, "production")
    d2, digest2 = artifact(tmp_path, 2)
    registry.add_artifact(d2)
    registry.add_record(record(digest2))  # a pass for ANOTHER artifact
    with pytest.raises(PromotionRefused):
        registry.promote(digest, "production")
    assert registry.pointer("production")[0] is None
    ptr = registry.promote(digest2, "production")
    assert ptr.artifact_digest == digest2 and registry.pointer("production")[0].artifact_digest == digest2
    hist = registry.history("production")
    assert [(e.decision, e.artifact_digest[:8]) for e in hist if e.action == "promote"] == [
        ("refused", digest[:8]),
        ("refused", digest[:8]),
        ("refused", digest[:8]),
        ("refused", digest[:8]),
        ("accepted", digest2[:8]),
    ]


def test_concurrent_promotions_have_exactly_one_winner(registry, tmp_path, monkeypatch):
    n = 6
    registry.create_channel("production", SERVING)
    digests = []
    for i in range(n):
        d, digest = artifact(tmp_path, 10 + i)
        registry.add_artifact(d)
        registry.add_record(record(digest))
        digests.append(digest)
    # Every promoter reads the channel before any of them writes: a true race.
    barrier = threading.Barrier(n)
    real_pointer = registry.pointer

    def racing_pointer(channel):
        got = real_pointer(channel)
        barrier.wait(timeout=30)
        return got

    monkeypatch.setattr(registry, "pointer", racing_pointer)
    results: dict[str, str] = {}

    def go(digest):
        try:
            registry.promote(digest, "production")
            results[digest] = "won"
        except PromotionRefused as e:
            results[digest] = str(e)

    threads = [threading.Thread(target=go, args=(d,)) for d in digests]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    monkeypatch.setattr(registry, "pointer", real_pointer)
    winners = [d for d, r in results.items() if r == "won"]
    assert len(results) == n and len(winners) == 1
    assert all("updated concurrently" in r for d, r in results.items() if d not in winners)
    assert registry.pointer("production")[0].artifact_digest == winners[0]
    promos = [e for e in registry.history("production") if e.action == "promote"]
    assert sorted(e.decision for e in promos) == ["accepted"] + ["refused"] * (n - 1)
    assert [e.artifact_digest for e in promos if e.decision == "accepted"] == winners


def test_artifacts_are_content_addressed_and_checked(registry, tmp_path):
    d, digest = artifact(tmp_path, 3)
    assert registry.add_artifact(d).content_digest == digest
    assert registry.add_artifact(d).content_digest == digest  # idempotent
    assert registry.artifacts() == [digest]
    blob = bytearray((d / "model.safetensors").read_bytes())
    blob[-5] ^= 0xFF
    (d / "model.safetensors").write_bytes(bytes(blob))
    with pytest.raises(ValueError, match="does not match its manifest"):
        registry.add_artifact(d)
    with pytest.raises(ValueError, match="another serving configuration"):
        registry.create_channel("staging", SERVING)
        registry.create_channel("staging", SERVING.model_copy(update={"tp_size": 2}))
    with pytest.raises(ValueError, match="add it before"):
        registry.add_record(record("0" * 64))


@pytest.mark.s3
def test_no_credentials_in_registry_objects(s3_server, tmp_path):
    reg = Registry(S3Store(f"s3://{s3_server['bucket']}/registry-creds", S3Config(endpoint_url=s3_server["endpoint"])))
    d, digest = artifact(tmp_path, 4)
    reg.add_artifact(d)
    reg.create_channel("production", SERVING)
    reg.add_record(record(digest))
    reg.promote(digest, "production")
    c = s3_server["client"]
    for o in c.list_objects_v2(Bucket=s3_server["bucket"], Prefix="registry-creds/")["Contents"]:
        body = c.get_object(Bucket=s3_server["bucket"], Key=o["Key"])["Body"].read()
        assert b"strata-test-secret" not in body and b"strata-test" not in body.replace(b"strata-test-secret", b""), o[
            "Key"
        ]


def test_promote_cli_exit_codes(tmp_path, capsys):
    from pipeline.cli import main as strata

    reg_dir = tmp_path / "reg"
    reg = Registry(LocalStore(reg_dir))
    d, digest = artifact(tmp_path, 5)
    assert strata(["registry", "add", str(d), "--registry", str(reg_dir)]) == 0
    reg.create_channel("production", SERVING)
    assert strata(["promote", digest, "--channel", "production", "--registry", str(reg_dir)]) == 3
    assert "no validation record" in capsys.readouterr().err
    reg.add_record(record(digest))
    assert strata(["promote", digest, "--channel", "production", "--registry", str(reg_dir)]) == 0
    assert strata(["registry", "history", "production", "--registry", str(reg_dir)]) == 0
    out = capsys.readouterr().out
    assert "refused" in out and "accepted" in out
    assert strata(["registry", "ls", "--registry", str(reg_dir)]) == 0
    assert f"channel production   -> {digest[:16]}" in capsys.readouterr().out


# -- a gate no one can walk around ---------------------------------------------------------------
def two_artifacts(registry, tmp_path):
    (da, a), (db, b) = artifact(tmp_path, 21), artifact(tmp_path, 22)
    registry.add_artifact(da)
    registry.add_artifact(db)
    registry.create_channel("production", SERVING)
    return a, b


def test_a_record_copied_to_another_artifact_does_not_promote_it(registry, tmp_path):
    a, b = two_artifacts(registry, tmp_path)
    key_a = registry.add_record(record(a))
    body = registry.store.get(key_a)[0]
    registry.store.put(key_a.replace(f"records/{a}/", f"records/{b}/"), body)  # A's pass under B's folder
    with pytest.raises(PromotionRefused, match=f"is a record of artifact {a[:16]}, not {b[:16]}"):
        registry.promote(b, "production")
    assert registry.pointer("production")[0] is None


def test_an_edited_record_does_not_count(registry, tmp_path):
    a, _ = two_artifacts(registry, tmp_path)
    key = registry.add_record(record(a, decision="block", reasons=["slot 0 is fed o_2"]))
    edited = ValidationRecord.model_validate_json(registry.store.get(key)[0]).model_copy(
        update={"decision": "pass", "reasons": []}
    )
    registry.store.put(key, edited.model_dump_json().encode())  # block -> pass in place
    with pytest.raises(PromotionRefused, match="edited after it was written"):
        registry.promote(a, "production")
    assert registry.pointer("production")[0] is None


def test_a_record_dated_in_the_future_does_not_count(registry, tmp_path):
    a, _ = two_artifacts(registry, tmp_path)
    registry.add_record(record(a, decision="block", reasons=["acceptance far below"]))
    future = record(a).model_copy(update={"created_at": "2999-01-01T00:00:00+00:00"})
    registry.add_record(future)  # would sort after the block and win
    with pytest.raises(PromotionRefused, match="blocked it: acceptance far below"):
        registry.promote(a, "production")


def test_with_a_signing_key_only_key_holders_can_vouch(registry, tmp_path):
    a, b = two_artifacts(registry, tmp_path)
    keyed = Registry(registry.store, signing_key="team-secret")
    forger = Registry(registry.store)  # can write the store, has no key
    forger.add_record(record(a))
    with pytest.raises(PromotionRefused, match="not signed: only a writer holding STRATA_REGISTRY_KEY"):
        keyed.promote(a, "production")
    Registry(registry.store, signing_key="another-secret").add_record(record(a))
    with pytest.raises(PromotionRefused, match="signed with another key"):
        keyed.promote(a, "production")
    keyed.add_record(record(b))
    ptr = keyed.promote(b, "production")
    assert ptr.artifact_digest == b and ptr.record_digest == keyed.records(b, SERVING)[-1].digest
    key = f"records/{b}/{SERVING.key}/{ptr.record_digest}.json"
    assert registry.store.get(key) is not None  # the pointer names the record


@pytest.mark.parametrize("channel", ["../x", "../records", "a/b", "Prod", "", "x" * 64, ".hidden"])
def test_channel_names_that_could_escape_are_refused(registry, tmp_path, channel):
    a, _ = two_artifacts(registry, tmp_path)
    for call in (
        lambda: registry.create_channel(channel, SERVING),
        lambda: registry.promote(a, channel),
        lambda: registry.pointer(channel),
    ):
        with pytest.raises(ValueError, match="channel name .* is not allowed"):
            call()
    assert registry.channels() == ["production"]


@pytest.mark.parametrize("bad", ["D/../D", "../" + "a" * 61, "A" * 64, "a" * 63, ""])
def test_digests_that_are_not_digests_are_refused(registry, tmp_path, bad):
    two_artifacts(registry, tmp_path)
    for call in (
        lambda: registry.promote(bad, "production"),
        lambda: registry.artifact(bad),
        lambda: registry.records(bad),
    ):
        with pytest.raises(ValueError, match="is not a SHA-256 digest"):
            call()
    assert registry.pointer("production")[0] is None


def test_invalid_names_are_usage_errors_in_the_cli(tmp_path, capsys):
    from pipeline.cli import main as strata

    assert strata(["promote", "D/../D", "--channel", "production", "--registry", str(tmp_path / "r")]) == 2
    assert "is not a SHA-256 digest" in capsys.readouterr().err
