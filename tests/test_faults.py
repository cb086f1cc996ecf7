"""Faults a demanding user causes -- a stopped or refusing S3 server -- and the invariants that
must hold through them: one clear line, nothing half-written, the channel never at an
artifact without its own passing record. (Kills, corrupt shards, concurrent promotions,
tampered records and poison rows live with the component they test: test_extract_job,
test_train, test_store, test_registry, test_data_prep.)"""

import uuid

import pytest
from conftest import S3_KEY, S3_SECRET, LocalS3
from test_registry import SERVING, artifact, record

from pipeline.cli import main as strata
from pipeline.registry.registry import PromotionRefused, Registry
from pipeline.store.objects import S3Store, StoreUnavailable
from schemas.config import S3Config

pytestmark = pytest.mark.s3


def test_wrong_credentials_are_one_clear_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", S3_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", S3_SECRET)
    s3 = LocalS3(tmp_path, check_signatures=True)
    s3.start()
    try:
        uri = "s3://strata-test/creds"
        Registry(S3Store(uri, S3Config(endpoint_url=s3.endpoint))).create_channel("production", SERVING)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
        with pytest.raises(StoreUnavailable, match="refused the request .*check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"):
            Registry(S3Store(uri, S3Config(endpoint_url=s3.endpoint))).channels()
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
        assert strata(["registry", "ls", "--registry", uri]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "refused the request" in err[0] and "not-the-secret" not in err[0]
    finally:
        s3.stop()


def test_s3_stopped_mid_run_and_restarted(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", S3_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", S3_SECRET)
    s3 = LocalS3(tmp_path)
    s3.start()
    try:
        reg = Registry(S3Store(f"s3://strata-test/reg-{uuid.uuid4().hex[:6]}", S3Config(endpoint_url=s3.endpoint)))
        (d1, a), (d2, b) = artifact(tmp_path, 31), artifact(tmp_path, 32)
        for d, digest in ((d1, a), (d2, b)):
            reg.add_artifact(d)
            reg.add_record(record(digest))
        reg.create_channel("production", SERVING)
        reg.promote(a, "production")
        s3.stop()
        with pytest.raises(StoreUnavailable, match="cannot reach the S3 endpoint"):
            reg.promote(b, "production")
        s3.start()  # same data, same ports
        assert reg.pointer("production")[0].artifact_digest == a  # the failed promotion changed nothing
        assert reg.promote(b, "production").artifact_digest == b
        d3, c = artifact(tmp_path, 33)
        reg.add_artifact(d3)
        with pytest.raises(PromotionRefused, match="no validation record"):
            reg.promote(c, "production")
        assert reg.pointer("production")[0].artifact_digest == b
    finally:
        s3.stop()
