"""Faults a demanding user causes -- a stopped or refusing S3 server, a full disk -- and the
invariants that must hold through them: one clear line, nothing half-written or half-visible,
every row once after a rerun, the channel never at an artifact without its own passing record. (Kills, corrupt shards, concurrent promotions,
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
        with pytest.raises(
            StoreUnavailable, match="refused the request .*check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
        ):
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


# -- the dataset store under faults --------------------------------------------------------------
def _extract_cfg(tiny_target, conversations, uri, **extra):
    from schemas.extract import ExtractConfig

    return ExtractConfig.model_validate(
        {
            "target": {"path": str(tiny_target)},
            "source": {"uri": str(conversations)},
            "output": {"uri": uri, "rows_per_shard": 16},
            "capture": ["layer_output:1", "final:post_norm"],
            "max_length": 128,
            "engine": {"dtype": "float32", "device": "cpu"},
            **extra,
        }
    )


def _assert_every_row_once(uri, cfg, source_rows):
    from pipeline.store.reader import DatasetReader

    r = DatasetReader(uri, s3=cfg.s3)
    r.verify_all()  # every shard whole, its unit's rows, no sample twice
    m = r.manifest
    assert m.totals.rows + m.totals.quarantined == source_rows
    ids = [s.sample_id for s in r.iter_samples()]
    assert len(ids) == len(set(ids)) == m.totals.rows


def test_extraction_to_s3_survives_the_endpoint_stopping_and_restarting(
    tiny_target, conversations, tmp_path, monkeypatch
):
    """S3 goes away after the first shard is published: the job stops with one clear line, no
    manifest and no half-written object is visible, and the rerun (same config) resumes and
    writes every row exactly once."""
    import pipeline.store.writer as writer
    from pipeline.extract.job import run_extract
    from pipeline.store.fs import list_files, resolve

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", S3_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", S3_SECRET)
    s3 = LocalS3(tmp_path)
    s3.start()
    try:
        uri = f"s3://strata-test/faults-{uuid.uuid4().hex[:6]}"
        cfg = _extract_cfg(tiny_target, conversations, uri, s3={"endpoint_url": s3.endpoint})
        real, published = writer.publish_local_file, []

        def publish_then_stop(*a, **k):
            real(*a, **k)
            published.append(a[-1])
            if len(published) == 1:
                s3.stop()

        monkeypatch.setattr(writer, "publish_local_file", publish_then_stop)
        with pytest.raises(StoreUnavailable, match="cannot reach the S3 endpoint"):
            run_extract(cfg, progress=False, use_ray=False)
        monkeypatch.setattr(writer, "publish_local_file", real)
        s3.start()  # same data, same ports
        fs, root = resolve(uri, cfg.s3)
        keys = [k for d in ("", "units", "shards") for k in list_files(fs, f"{root}/{d}".rstrip("/"))]
        assert not any(k.endswith("manifest.json") for k in keys) and not any(".tmp" in k for k in keys), keys
        m = run_extract(cfg, progress=False, use_ray=False)
        source_rows = sum(1 for line in conversations.read_text().splitlines() if line.strip())
        _assert_every_row_once(uri, cfg, source_rows)
        assert m.totals.shards > 1
    finally:
        s3.stop()


@pytest.mark.parametrize("fault", ["shard data", "commit"])
def test_a_full_disk_during_a_local_write_is_one_clear_error_and_resumes_every_row_once(
    fault, tiny_target, conversations, tmp_path, monkeypatch
):
    """ENOSPC after the first shard is published -- while a shard's bytes are written, or at the
    fsync of the next commit: the job stops naming the disk, no partial file (temporary or
    final) is left in the output, and the rerun writes every row exactly once."""
    import errno
    import os

    import pipeline.store.writer as writer
    from pipeline.extract.job import run_extract
    from pipeline.store.fs import StoreFull

    uri = str(tmp_path / "ds")
    cfg = _extract_cfg(tiny_target, conversations, uri)
    full = OSError(errno.ENOSPC, "No space left on device")
    shards: list[str] = []
    real_publish, real_write, real_fsync = writer.publish_local_file, writer._HashingFile.write, os.fsync

    def publish(*a, **k):
        real_publish(*a, **k)
        shards.append(a[-1])

    def write(self, data):  # the disk fills while a shard's bytes are written
        if fault == "shard data" and shards:
            raise full
        return real_write(self, data)

    def fsync(fd):  # the disk fills under the next commit: the shard's fsync or the unit record's
        if fault == "commit" and shards:
            raise full
        return real_fsync(fd)

    monkeypatch.setattr(writer, "publish_local_file", publish)
    monkeypatch.setattr(writer._HashingFile, "write", write)
    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(StoreFull, match="no space left on the device: free space and rerun"):
        run_extract(cfg, progress=False, use_ray=False)
    left = [p.name for p in (tmp_path / "ds").rglob("*") if p.is_file()]
    assert not any(".tmp" in n for n in left) and "manifest.json" not in left, left
    monkeypatch.undo()
    m = run_extract(cfg, progress=False, use_ray=False)
    source_rows = sum(1 for line in conversations.read_text().splitlines() if line.strip())
    _assert_every_row_once(uri, cfg, source_rows)
    assert m.totals.shards > 1
