"""Every capture kind equals an independent recomputation (fp32, tiny target)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.engines import packing
from pipeline.engines.hf import HFEngine
from pipeline.store.encoding import bits_to_torch, join_planes
from schemas.capture import CapturePoint as C

N = 6
POINTS = [C.embedding(), C.layer_output(0), C.layer_output(2), C.layer_output(N - 1), C.final("pre"), C.final("post")]
SEQS = [[1, 17, 42, 99, 7, 300, 5], [1, 64, 65], [1, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def reference(tiny_target):
    m = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32, attn_implementation="eager")
    out = []
    with torch.no_grad():
        for s in SEQS:
            o = m.model(input_ids=torch.tensor([s]), output_hidden_states=True)
            out.append((o.hidden_states, o.last_hidden_state))
    return out


def unpack(batch, point, i):
    off = sum(batch.lengths[:i])
    planes = batch.planes[str(point)][:, off : off + batch.lengths[i]]
    return bits_to_torch(join_planes(list(planes)), "float32")


def test_each_point_equals_hidden_states_bit_exact(tiny_target, reference):
    eng = HFEngine(tiny_target, POINTS, dtype="float32", device="cpu", attn_implementation="eager")
    for i, s in enumerate(SEQS):
        b = eng.capture([s])  # one sequence: same kernels as the reference, so bit-exact
        hs, last = reference[i]
        assert torch.equal(unpack(b, C.embedding(), 0), hs[0][0])
        assert torch.equal(unpack(b, C.layer_output(0), 0), hs[1][0])  # o_0 = hidden_states[1]
        assert torch.equal(unpack(b, C.layer_output(2), 0), hs[3][0])  # o_j = hidden_states[j+1]
        assert torch.equal(unpack(b, C.final("post"), 0), last[0])  # post-norm = last_hidden_state
        assert torch.equal(unpack(b, C.final("post"), 0), hs[N][0])  # and HF's hidden_states[N]
        assert torch.equal(unpack(b, C.final("pre"), 0), unpack(b, C.layer_output(N - 1), 0))  # r_N twice
        assert not torch.equal(unpack(b, C.final("pre"), 0), unpack(b, C.final("post"), 0))


def test_batched_capture_matches_unbatched(tiny_target, reference):
    eng = HFEngine(tiny_target, POINTS, dtype="float32", device="cpu", attn_implementation="eager")
    b = eng.capture(SEQS)  # eager cannot pack: one sequence per forward, in order
    assert b.lengths == [len(s) for s in SEQS]
    for i in range(len(SEQS)):
        hs, last = reference[i]
        assert torch.equal(unpack(b, C.layer_output(2), i), hs[3][0])
        assert torch.equal(unpack(b, C.final("post"), i), last[0])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_capture_is_bit_identical_to_one_sequence_at_a_time(tiny_target, dtype, request):
    """Packing replaces padding: sequences of very different lengths run end to end in one row,
    each with its own positions and attending only to itself, and every captured value equals
    a lone forward of that sequence bit for bit (a packed forward that let a sequence see its
    neighbours, or restarted no positions, would differ).

    fp32 matmuls round a row the same way wherever it sits in the matrix except in a tail
    micro-kernel: a lone matrix of 1-3, 5-7 or 9-11 rows (a sequence that short; a
    chat-templated conversation never is), and, with several BLAS threads, the rows where the
    threads' shares meet (packed or padded alike). So fp32 runs on one thread with sequences of
    12 tokens or more; bf16 matmuls agree at any row count and thread count.
    """
    if dtype == "float32":
        threads = torch.get_num_threads()
        request.addfinalizer(lambda: torch.set_num_threads(threads))
        torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    lengths = (57, 12, 130, 16, 18, 96) if dtype == "float32" else (57, 3, 130, 1, 18, 96)
    seqs = [torch.randint(3, 2000, (n,), generator=g).tolist() for n in lengths]
    eng = HFEngine(tiny_target, POINTS, dtype=dtype, device="cpu", attn_implementation="sdpa")
    alone = eng.capture_tensors(seqs)
    packed = eng.capture(seqs)
    assert packed.lengths == [len(s) for s in seqs]
    for p in POINTS:
        for i in range(len(seqs)):
            off = sum(packed.lengths[:i])
            planes = packed.planes[str(p)][:, off : off + packed.lengths[i]]
            got = bits_to_torch(join_planes(list(planes)), dtype)
            assert torch.equal(got, alone[str(p)][i].to(got.dtype)), (str(p), i, len(seqs[i]))
    # and the row is really one forward: one call of the packed attention per layer, not one per sequence
    calls = []
    orig = packing.packed_sdpa

    def spy(*a, **kw):
        calls.append(kw.get("cu_seq_lens_q"))
        return orig(*a, **kw)

    from transformers import AttentionInterface

    AttentionInterface.register(packing.PACKED_SDPA, spy)
    try:
        eng.capture(seqs)
    finally:
        AttentionInterface.register(packing.PACKED_SDPA, orig)
    assert len(calls) == N and all(c is not None and c.tolist()[-1] == sum(map(len, seqs)) for c in calls)
    assert eng.model.config._attn_implementation == "sdpa"  # serving keeps the loaded implementation


def test_never_uses_output_hidden_states(tiny_target, monkeypatch):
    eng = HFEngine(tiny_target, POINTS[:2], dtype="float32", device="cpu")
    seen = {}
    orig = eng.base.forward

    def spy(*a, **kw):
        seen.update(kw)
        return orig(*a, **kw)

    monkeypatch.setattr(eng.base, "forward", spy)
    eng.capture([SEQS[0]])
    assert not seen.get("output_hidden_states")


def test_batches_are_consecutive_samples_within_the_token_budget():
    from pipeline.engines.packing import pack_by_tokens

    lengths = [10, 50, 20, 50, 5, 30, 120, 7]
    batches = pack_by_tokens(lengths, 100)
    assert [i for b in batches for i in b] == list(range(len(lengths)))  # every sample once, in order
    for b in batches:
        assert sum(lengths[i] for i in b) <= 100 or len(b) == 1
    assert [6] in batches  # longer than the budget: alone
    assert len(batches) == 4  # [10,50,20] [50,5,30] [120] [7]


def test_provenance_native_ids(tiny_target):
    eng = HFEngine(tiny_target, [C.layer_output(2)], dtype="float32", device="cpu")
    ref = eng.engine_ref(C.layer_output(2))
    assert (ref.name, ref.native_id, ref.native_id_convention) == ("hf", 3, "hf_hidden_states_index")
    assert eng.engine_ref(C.final("pre")).native_id is None  # HF hidden_states[N] is post-norm
    with pytest.raises(ValueError, match="6 decoder layers"):
        HFEngine(tiny_target, [C.layer_output(6)], dtype="float32", device="cpu")


def test_every_engine_implements_the_whole_contract():
    """HF, vLLM and SGLang engines are TargetEngines with nothing left abstract (a missing
    method would make the class uninstantiable: caught here, without starting an engine)."""
    from pipeline.engines.base import TargetEngine
    from pipeline.engines.hf import HFEngine
    from pipeline.engines.sglang.engine import SGLangEngine
    from pipeline.engines.vllm.engine import VLLMEngine

    for cls in (HFEngine, VLLMEngine, SGLangEngine):
        assert issubclass(cls, TargetEngine) and not cls.__abstractmethods__, (cls, cls.__abstractmethods__)
