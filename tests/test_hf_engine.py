"""Every capture kind equals an independent recomputation (fp32, tiny target)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

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
        assert torch.equal(unpack(b, C.layer_output(0), 0), hs[1][0])        # o_0 = hidden_states[1]
        assert torch.equal(unpack(b, C.layer_output(2), 0), hs[3][0])        # o_j = hidden_states[j+1]
        assert torch.equal(unpack(b, C.final("post"), 0), last[0])           # post-norm = last_hidden_state
        assert torch.equal(unpack(b, C.final("post"), 0), hs[N][0])          # and HF's hidden_states[N]
        assert torch.equal(unpack(b, C.final("pre"), 0), unpack(b, C.layer_output(N - 1), 0))  # r_N twice
        assert not torch.equal(unpack(b, C.final("pre"), 0), unpack(b, C.final("post"), 0))


def test_batched_capture_matches_unbatched(tiny_target, reference):
    eng = HFEngine(tiny_target, POINTS, dtype="float32", device="cpu", attn_implementation="eager")
    b = eng.capture(SEQS)  # right-padded batch; packed in order
    assert b.lengths == [len(s) for s in SEQS]
    for i in range(len(SEQS)):
        hs, last = reference[i]
        torch.testing.assert_close(unpack(b, C.layer_output(2), i), hs[3][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(unpack(b, C.final("post"), i), last[0], rtol=1e-5, atol=1e-5)


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


def test_batch_planning_respects_token_budget():
    from pipeline.engines.base import plan_by_tokens

    lengths = [10, 50, 20, 50, 5, 30]
    batches = plan_by_tokens(lengths, 100)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert max(lengths[i] for i in b) * len(b) <= 100 or len(b) == 1


def test_provenance_native_ids(tiny_target):
    eng = HFEngine(tiny_target, [C.layer_output(2)], dtype="float32", device="cpu")
    ref = eng.engine_ref(C.layer_output(2))
    assert (ref.name, ref.native_id, ref.native_id_convention) == ("hf", 3, "hf_hidden_states_index")
    assert eng.engine_ref(C.final("pre")).native_id is None   # HF hidden_states[N] is post-norm
    with pytest.raises(ValueError, match="6 decoder layers"):
        HFEngine(tiny_target, [C.layer_output(6)], dtype="float32", device="cpu")


def test_every_engine_implements_the_whole_contract():
    """HF, vLLM and SGLang engines are TargetEngines with nothing left abstract (a missing
    method would make the class uninstantiable: caught here, without starting an engine)."""
    from pipeline.engines.base import TargetEngine
    from pipeline.engines.hf import HFEngine
    from pipeline.engines.sglang_engine import SGLangEngine
    from pipeline.engines.vllm_engine import VLLMEngine

    for cls in (HFEngine, VLLMEngine, SGLangEngine):
        assert issubclass(cls, TargetEngine) and not cls.__abstractmethods__, (cls, cls.__abstractmethods__)
