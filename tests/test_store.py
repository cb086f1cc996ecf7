"""Provenance-carrying Parquet: bit-exact round trips (local disk and S3), atomic commits,
and a reader that refuses data that is not what the caller expects."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.engines.hf import HFEngine
from pipeline.extract.job import run_extract
from pipeline.identity import target_identity
from pipeline.store.encoding import split_planes
from pipeline.store.fs import resolve
from pipeline.store.reader import DatasetReader, ProvenanceMismatch, ShardCorrupt
from pipeline.store.writer import SampleMeta, ShardWriter
from schemas.capture import CapturePoint as C
from schemas.dataset import META_CODEC, META_PROVENANCE, dataset_schema
from schemas.extract import ExtractConfig
from schemas.provenance import EngineRef, TensorProvenance

POINTS = ["layer_output:1", "layer_output:2", "final:post_norm"]


def extract(tiny_target, conversations, uri, dtype="float32", points=POINTS, **extra):
    cfg = ExtractConfig.model_validate(
        {
            "target": {"path": str(tiny_target)},
            "source": {"uri": str(conversations)},
            "output": {"uri": uri, "rows_per_shard": 16},
            "capture": points,
            "max_length": 128,
            # batch_tokens=1: one sequence per forward, so a recomputation is bit-identical.
            "engine": {"dtype": dtype, "device": "cpu", "batch_tokens": 1},
            **extra,
        }
    )
    return cfg, run_extract(cfg, progress=False, use_ray=False)


def assert_bit_exact(reader, tiny_target, dtype):
    eng = HFEngine(tiny_target, [C.parse(p) for p in reader.points], dtype=dtype, device="cpu")
    n = 0
    for s in reader.iter_samples():
        b = eng.capture([s.input_ids.tolist()])
        for p in reader.points:
            want = split_planes(
                torch.from_numpy(b.planes[p])
                .permute(1, 2, 0)
                .contiguous()
                .view(torch.uint8)
                .flatten(1)
                .view({"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype])
            )
            got = split_planes(s.tensors[p])
            assert torch.equal(got, want), f"{s.sample_id} {p}"
        n += 1
    return n


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_local_round_trip_is_bit_exact(tiny_target, conversations, tmp_path, dtype):
    cfg, m = extract(tiny_target, conversations, str(tmp_path / "ds"), dtype=dtype)
    assert m.totals.rows + m.totals.quarantined == m.totals.input_rows == 40
    r = DatasetReader(cfg.output.uri, expect_target=target_identity(tiny_target), expect_points=POINTS)
    assert assert_bit_exact(r, tiny_target, dtype) == m.totals.rows
    for c in m.columns:
        assert c.dtype == dtype and c.target_key == m.target.key and c.engine.name == "hf"


def test_decodable_with_pyarrow_and_numpy_from_the_docs(tiny_target, conversations, tmp_path):
    """Follow schemas/dataset.py ENCODING_DOC literally: no Strata code on the read side."""
    cfg, m = extract(tiny_target, conversations, str(tmp_path / "ds"), points=["layer_output:2"])
    path = tmp_path / "ds" / m.shards[0].path
    t = pq.read_table(path)
    i, H = 3, m.target.hidden_size
    T = t["num_tokens"][i].as_py()
    planes = []
    for k in range(4):  # float32
        field = t.schema.field(f"layer_output:2#b{k}")
        cell = t[f"layer_output:2#b{k}"][i].as_buffer()
        if field.metadata[b"strata.codec"] == b"zstd":
            cell = pa.decompress(cell, decompressed_size=T * H, codec="zstd")
        planes.append(np.frombuffer(cell, np.uint8).reshape(T, H))
    values = np.stack(planes, axis=-1).view("<u4")[..., 0].view(np.float32)
    prov = json.loads(t.schema.field("layer_output:2#b0").metadata[b"strata.provenance"])
    assert prov["capture_point"] == {"kind": "layer_output", "layer": 2, "norm": None} and prov["boundary"] == "r_3"
    r = DatasetReader(cfg.output.uri)
    sample = next(s for j, s in enumerate(r.iter_samples()) if j == i)
    assert np.array_equal(values, sample.tensors["layer_output:2"].numpy())
    # Schema-level provenance: target identity, extraction config, software, encoding doc.
    meta = pq.read_schema(path).metadata
    assert json.loads(meta[b"strata.target"])["weights_sha256"] == m.target.weights_sha256
    assert b"byte_planes_v1" in meta[b"strata.encoding_doc"]


def test_bf16_compresses_below_072(tiny_target, tmp_path):
    """Encoding on realistic bf16 activations (per-channel scales), 4096 wide."""
    H, T = 4096, 256
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(T, H, generator=g) * torch.exp(torch.randn(H, generator=g) * 0.7)).to(torch.bfloat16)
    prov = TensorProvenance(
        capture_point=C.layer_output(1),
        boundary="r_2",
        dtype="bfloat16",
        hidden_size=H,
        encoding="byte_planes_v1",
        engine=EngineRef(name="hf", version="x", native_id=2, native_id_convention="hf_hidden_states_index"),
        target_model="t",
        target_key="k",
    )
    schema = dataset_schema([prov], "{}", "{}", {})
    fs, path = resolve(str(tmp_path / "s.parquet"))
    w = ShardWriter(fs, path, schema)
    meta = SampleMeta("s0", "src", 0, "c", list(range(T)), [1] * T)
    w.write([meta], [T], {"layer_output:1": split_planes(x).numpy()})
    nbytes, _ = w.commit()
    assert nbytes / (T * H * 2) <= 0.72


def test_parallel_writer_threads_write_the_same_shard(tmp_path):
    """Writer threads compress a row group's cells in parallel: the shard (and so its checksum
    and the unit's commit record) is byte-identical to a single thread's."""
    H, B = 512, 6
    g = torch.Generator().manual_seed(1)
    prov = TensorProvenance(
        capture_point=C.layer_output(1),
        boundary="r_2",
        dtype="bfloat16",
        hidden_size=H,
        encoding="byte_planes_v1",
        engine=EngineRef(name="hf", version="x", native_id=2, native_id_convention="hf_hidden_states_index"),
        target_model="t",
        target_key="k",
    )
    schema = dataset_schema([prov], "{}", "{}", {})
    lengths = [37, 5, 120, 64, 9, 80]
    metas = [SampleMeta(f"s{i}", "src", i, "c", list(range(n)), [1] * n) for i, n in enumerate(lengths)]
    x = torch.randn(sum(lengths), H, generator=g).to(torch.bfloat16)
    digests = []
    for threads in (1, 4):
        fs, path = resolve(str(tmp_path / f"t{threads}.parquet"))
        w = ShardWriter(fs, path, schema, compress_threads=threads)
        for half in (slice(0, B // 2), slice(B // 2, B)):
            rows = lengths[half]
            start = sum(lengths[: half.start])
            w.write(metas[half], rows, {"layer_output:1": split_planes(x[start : start + sum(rows)]).numpy()})
        digests.append(w.commit())
    assert digests[0] == digests[1]
    assert (tmp_path / "t1.parquet").read_bytes() == (tmp_path / "t4.parquet").read_bytes()


def test_writer_threads_default_from_the_actors_cpus():
    from schemas.extract import RayConfig

    assert RayConfig().writer_threads_per_actor() == 1
    assert RayConfig(cpus_per_actor=4).writer_threads_per_actor() == 3
    assert RayConfig(cpus_per_actor=4, writer_threads=8).writer_threads_per_actor() == 8


def test_uncommitted_shard_is_invisible(tiny_target, tmp_path):
    prov = TensorProvenance(
        capture_point=C.layer_output(1),
        boundary="r_2",
        dtype="float32",
        hidden_size=8,
        encoding="byte_planes_v1",
        engine=EngineRef(name="hf", version="x", native_id=2, native_id_convention="hf_hidden_states_index"),
        target_model="t",
        target_key="k",
    )
    schema = dataset_schema([prov], "{}", "{}", {})
    assert schema.field("layer_output:1#b3").metadata[META_CODEC] == b"zstd"
    assert META_PROVENANCE in schema.field("layer_output:1#b0").metadata
    fs, path = resolve(str(tmp_path / "shards" / "part-00000.parquet"))
    w = ShardWriter(fs, path, schema)
    w.write(
        [SampleMeta("s", "src", 0, "c", [1, 2], [0, 1])],
        [2],
        {"layer_output:1": split_planes(torch.randn(2, 8)).numpy()},
    )
    assert not (tmp_path / "shards" / "part-00000.parquet").exists()  # only a dot-temp exists
    w.abort()
    assert list((tmp_path / "shards").iterdir()) == []
    with pytest.raises(ValueError, match="expected byte planes of shape"):
        ShardWriter(fs, path, schema).write(
            [SampleMeta("s", "src", 0, "c", [1, 2], [0, 1])], [2], {"layer_output:1": np.zeros((4, 3, 8), np.uint8)}
        )


def test_reader_refuses_other_target_naming_both(tiny_target, conversations, tmp_path):
    from pipeline.demo.tiny import make_tiny_target

    other = make_tiny_target(tmp_path / "other", num_layers=6, hidden_size=64, seed=1)
    cfg, _ = extract(tiny_target, conversations, str(tmp_path / "ds"))
    with pytest.raises(ProvenanceMismatch) as e:
        DatasetReader(cfg.output.uri, expect_target=target_identity(other, name="other-target"))
    msg = str(e.value)
    assert "tiny" in msg and "other-target" in msg and "weights" in msg


def test_reader_refuses_other_capture_points_naming_both(tiny_target, conversations, tmp_path):
    cfg, _ = extract(tiny_target, conversations, str(tmp_path / "ds"))
    with pytest.raises(ProvenanceMismatch) as e:
        DatasetReader(cfg.output.uri, expect_points=["layer_output:0", "layer_output:2"])
    assert "layer_output:0" in str(e.value) and "'layer_output:1', 'layer_output:2', 'final:post_norm'" in str(e.value)


def test_reader_refuses_corrupt_and_missing_shards(tiny_target, conversations, tmp_path):
    cfg, m = extract(tiny_target, conversations, str(tmp_path / "ds"))
    shard = tmp_path / "ds" / m.shards[1].path
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    r = DatasetReader(cfg.output.uri)
    with pytest.raises(ShardCorrupt, match=m.shards[1].path):
        list(r.iter_samples())
    shard.unlink()
    with pytest.raises(ShardCorrupt, match=f"{m.shards[1].path} .* missing"):
        list(DatasetReader(cfg.output.uri).iter_samples())


def test_a_manifest_listing_one_file_twice_is_refused(tiny_target, conversations, tmp_path):
    """Shard 1's entry pointed at shard 0's file (path, bytes, sha256): every checksum still
    passes, so the reader checks source rows and sample ids."""
    from schemas.manifest import MANIFEST_NAME, DatasetManifest

    cfg, m = extract(tiny_target, conversations, str(tmp_path / "ds"))
    DatasetReader(cfg.output.uri).verify_all()  # the real dataset passes
    path = tmp_path / "ds" / MANIFEST_NAME
    edited = DatasetManifest.model_validate_json(path.read_text())
    s0, s1 = edited.shards[0], edited.shards[1]
    edited.shards[1] = s1.model_copy(update={"path": s0.path, "bytes": s0.bytes, "sha256": s0.sha256, "rows": s0.rows})
    edited.totals = edited.totals.model_copy(update={"bytes": sum(s.bytes for s in edited.shards)})  # totals agree
    path.write_text(edited.model_dump_json())
    with pytest.raises(ShardCorrupt, match=f"shard {s0.path} .* its unit {s1.unit} covers"):
        DatasetReader(cfg.output.uri).verify_all()
    # Edited to claim shard 0's source range as well, the manifest no longer reconciles.
    edited.shards[1] = edited.shards[1].model_copy(update={"source_rows": s0.source_rows})
    path.write_text(edited.model_dump_json())
    with pytest.raises(ValueError, match="covered twice"):
        DatasetReader(cfg.output.uri).verify_all()


@pytest.mark.s3
def test_s3_round_trip_is_bit_exact(tiny_target, conversations, s3_server):
    uri = f"s3://{s3_server['bucket']}/datasets/tiny-bf16"
    cfg, m = extract(tiny_target, conversations, uri, dtype="bfloat16", s3={"endpoint_url": s3_server["endpoint"]})
    keys = [
        o["Key"]
        for o in s3_server["client"].list_objects_v2(Bucket=s3_server["bucket"], Prefix="datasets/tiny-bf16/")[
            "Contents"
        ]
    ]
    assert "datasets/tiny-bf16/manifest.json" in keys
    assert sum(k.endswith(".parquet") for k in keys) == m.totals.shards
    assert not any(".tmp-" in k for k in keys)
    r = DatasetReader(uri, s3=cfg.s3, expect_target=target_identity(tiny_target))
    assert assert_bit_exact(r, tiny_target, "bfloat16") == m.totals.rows
    # A manifest never carries credentials.
    body = (
        s3_server["client"]
        .get_object(Bucket=s3_server["bucket"], Key="datasets/tiny-bf16/manifest.json")["Body"]
        .read()
    )
    assert b"strata-test-secret" not in body


def test_inspect_verify_catches_flipped_truncated_deleted_shards_and_bad_totals(
    tiny_target, conversations, tmp_path, capsys
):
    from pipeline.cli import main as strata
    from schemas.manifest import MANIFEST_NAME, DatasetManifest

    cfg, m = extract(tiny_target, conversations, str(tmp_path / "ds"))
    uri = cfg.output.uri
    assert strata(["inspect", uri]) == 0 and "verified  no" in capsys.readouterr().out
    assert strata(["inspect", uri, "--verify"]) == 0 and "verified  yes" in capsys.readouterr().out
    shard = tmp_path / "ds" / m.shards[0].path
    good = shard.read_bytes()
    for broken in (good[:-1] + bytes([good[-1] ^ 1]), good[: len(good) // 2]):  # flipped, truncated
        shard.write_bytes(broken)
        assert strata(["inspect", uri, "--verify"]) == 3
        assert "FAILED verification" in capsys.readouterr().err
    shard.unlink()
    assert strata(["inspect", uri, "--verify", "--json"]) == 3 and "missing" in capsys.readouterr().err
    shard.write_bytes(good)
    path = tmp_path / "ds" / MANIFEST_NAME
    edited = DatasetManifest.model_validate_json(path.read_text())
    edited.totals = edited.totals.model_copy(update={"tokens": edited.totals.tokens + 1})
    path.write_text(edited.model_dump_json())
    assert strata(["inspect", uri, "--verify"]) == 3 and "totals.tokens" in capsys.readouterr().err
    from pipeline.store.reader import DatasetReader

    with pytest.raises(ValueError, match="totals.tokens"):  # one verification: training's reader refuses it too
        DatasetReader(uri)


def test_each_sample_is_a_row_group_so_a_batch_reads_only_its_samples(
    tiny_target, conversations, tmp_path, monkeypatch
):
    """Extraction packs many samples into one forward; training takes a few samples from each of
    many shards, and Parquet reads whole column chunks: a row group per forward batch would make
    every sample cost its whole forward batch's bytes."""
    from pipeline.store.reader import index_samples
    from pipeline.train.data import load_batch

    cfg, m = extract(tiny_target, conversations, str(tmp_path / "ds"), engine={"dtype": "float32", "device": "cpu"})
    reader = DatasetReader(cfg.output.uri)
    reader.verify_all()
    refs = index_samples(reader)
    assert len(refs) == m.totals.rows and [r.row for r in refs] == [0] * len(refs)
    for shard in reader.shards:  # the 16-row units went through the engine in fewer forwards than rows
        assert pq.ParquetFile(tmp_path / "ds" / shard.path).metadata.num_row_groups == shard.rows > 1
    read: list[tuple[str, int]] = []
    real = reader.read_row_group
    monkeypatch.setattr(
        reader, "read_row_group", lambda s, rg, columns=None: read.append((s, rg)) or real(s, rg, columns)
    )
    batch = [refs[3], refs[len(refs) // 2], refs[-1]]
    got = load_batch(reader, batch, POINTS[:2], POINTS[2], packed=True)
    assert sorted(read) == sorted((r.shard, r.row_group) for r in batch)  # three samples, three one-row reads
    samples = {s.sample_id: s for s in reader.iter_samples()}
    want = torch.cat([samples[r.sample_id].tensors[POINTS[2]] for r in batch]).float().numpy()
    assert np.array_equal(got["final"].reshape(want.shape), want)
    # The footer is parsed once per shard, and what it caches reads the same rows.
    assert len(reader._footers) == len({r.shard for r in batch})
    assert load_batch(reader, batch, POINTS[:2], POINTS[2], packed=True)["final"].tobytes() == got["final"].tobytes()
