"""Fingerprints: computed at extraction from the stored values, and able to tell
neighbouring residual-stream boundaries apart."""

import pytest
import torch

from pipeline import fingerprint as fpm
from pipeline.conventions import all_boundaries
from pipeline.engines.hf import HFEngine
from pipeline.extract.job import run_extract
from pipeline.store.encoding import bits_to_torch, join_planes
from pipeline.store.reader import DatasetReader
from schemas.extract import ExtractConfig


@pytest.fixture(scope="module")
def extracted(tiny_target, conversations, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp") / "ds"
    cfg = ExtractConfig.model_validate(
        {
            "target": {"path": str(tiny_target)},
            "source": {"uri": str(conversations)},
            "output": {"uri": str(out)},
            "capture": ["layer_output:1", "layer_output:2", "final:post_norm"],
            "max_length": 128,
            "engine": {"dtype": "float32", "device": "cpu", "batch_tokens": 1},
            "fingerprint": {"probe_samples": 6},
        }
    )
    return out, run_extract(cfg, progress=False, use_ray=False)


def test_fingerprints_written_with_the_dataset(extracted):
    out, m = extracted
    assert m.fingerprints["probe_samples"] == 6 and (out / m.fingerprints["path"]).exists()
    fp = fpm.Fingerprints.load(str(out))
    r = DatasetReader(str(out))
    assert fp.points == r.points and len(fp.sample_ids) == 6
    assert fp.sample_ids == fpm.probe_ids([s.sample_id for s in r.iter_samples()], 6)
    proj = fpm.projection(m.target.hidden_size, fp.dim, fp.seed)
    by_id = {s.sample_id: s for s in r.iter_samples()}
    for i, sid in enumerate(fp.sample_ids):
        s = by_id[sid]
        assert fp.tokens(i) == s.input_ids.tolist()
        for p in fp.points:
            want, _ = fpm.sketch(s.tensors[p], proj)
            assert torch.equal(fp.sample(p, i), want)
            assert fp.digests[p][i] == fpm.tensor_digest(s.tensors[p])


def test_fingerprints_come_out_in_probe_order_whatever_order_the_row_groups_are_read_in():
    """``compute`` reads each row group once, so probes arrive grouped by where they are stored;
    the fingerprints still hold them in probe order, each sample's sketch, digest and tokens its own."""
    g = torch.Generator().manual_seed(0)
    samples = [
        (f"s{i}", torch.randint(0, 100, (n,), generator=g), {"a": torch.randn(n, 16, generator=g)}, i or None)
        for i, n in enumerate((5, 3, 7, 4))
    ]
    order = [s[0] for s in samples]
    want = fpm.from_samples(iter(samples), ["a"], dim=8)
    got = fpm.from_samples(iter([samples[2], samples[0], samples[3], samples[1]]), ["a"], dim=8, order=order)
    assert got.sample_ids == want.sample_ids == order and got.lengths == want.lengths == [5, 3, 7, 4]
    assert got.digests == want.digests and got.prompt_lengths == want.prompt_lengths == [None, 1, 2, 3]
    assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.sketches["a"], want.sketches["a"])
    assert torch.equal(got.rms["a"], want.rms["a"])
    for i, (_, toks, tensors, _) in enumerate(samples):
        assert got.tokens(i) == toks.tolist() and got.digests["a"][i] == fpm.tensor_digest(tensors["a"])


def test_sketch_preserves_relative_l2_and_separates_neighbouring_layers(tiny_target):
    """Compare every boundary r_0..r_N, final post-norm of one batch, in full space and sketch space."""
    n = 6
    points = all_boundaries(n)
    eng = HFEngine(tiny_target, points, dtype="float32", device="cpu")
    b = eng.capture([[1] + list(range(40, 140))])
    full = {str(p): bits_to_torch(join_planes(list(b.planes[str(p)])), "float32") for p in points}
    proj = fpm.projection(eng.hidden_size, 64, 0)
    sk = {k: fpm.sketch(v, proj)[0] for k, v in full.items()}
    names = [str(p) for p in points]
    x = full["layer_output:2"]
    bf16_noise = fpm.rel_l2(fpm.sketch(x.bfloat16().float(), proj)[0], sk["layer_output:2"])
    assert bf16_noise < 0.01  # rounding the same tensor: tiny
    for a, c in zip(names, names[1:], strict=False):
        exact, approx = fpm.rel_l2(full[a], full[c]), fpm.rel_l2(sk[a], sk[c])
        print(f"{a} vs {c}: rel L2 {exact:.3f} full, {approx:.3f} sketch (bf16 noise {bf16_noise:.4f})")
        assert approx == pytest.approx(exact, rel=0.25), (a, c, exact, approx)
        assert approx > 20 * bf16_noise, (a, c, approx)  # neighbours: far apart in sketch space


def test_probe_samples_are_held_out_from_training():
    from pipeline.store.reader import SampleRef
    from pipeline.train.data import split_eval

    ids = [f"sample-{i}" for i in range(400)]
    refs = [SampleRef("s", 0, i, 10, sid) for i, sid in enumerate(ids)]
    probes = frozenset(fpm.probe_ids(ids, 16))
    for fraction in (0.05, 0.0):  # held out whatever the eval fraction
        train, held = split_eval(refs, fraction, probes)
        assert probes <= {r.sample_id for r in held} and not probes & {r.sample_id for r in train}
        assert len(train) + len(held) == len(refs)
    assert split_eval(refs, 0.0)[1] == []  # without them, fraction 0 holds nothing out
