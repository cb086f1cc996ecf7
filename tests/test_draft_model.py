"""The EAGLE-3 draft's math against naive references written as explicit loops."""

import math

import pytest
import torch
import torch.nn.functional as F

from pipeline.draft.model import (
    DraftConfig,
    Eagle3Draft,
    Layout,
    TargetBatch,
    draft_to_target,
    init_weights,
    rope,
    shift,
    simulated_acceptance_length,
    ttt_attention,
)
from pipeline.draft.vocab import (
    build_draft_vocab,
    count_trained_tokens,
)

CFG = DraftConfig(
    hidden_size=32,
    target_hidden_size=24,
    num_aux=3,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=50,
    draft_vocab_size=20,
)


def naive_attention(q, ks, vs):
    """Position t of step i attends to step-0 keys 0..t and its own keys of steps 1..i."""
    B, h, T, d = q.shape
    out = torch.zeros_like(q)
    for b in range(B):
        for hh in range(h):
            for t in range(T):
                keys = [ks[0][b, hh, s] for s in range(t + 1)] + [k[b, hh, t] for k in ks[1:]]
                vals = [vs[0][b, hh, s] for s in range(t + 1)] + [v[b, hh, t] for v in vs[1:]]
                scores = torch.stack([q[b, hh, t] @ k / math.sqrt(d) for k in keys])
                out[b, hh, t] = (scores.softmax(0)[:, None] * torch.stack(vals)).sum(0)
    return out


@pytest.mark.parametrize("T", [1, 5, 17])
@pytest.mark.parametrize("step", [0, 1, 3, 6])
def test_ttt_attention_equals_naive_loop(T, step):
    g = torch.Generator().manual_seed(T * 10 + step)
    q = torch.randn(2, 3, T, 8, generator=g)
    ks = [torch.randn(2, 3, T, 8, generator=g) for _ in range(step + 1)]
    vs = [torch.randn(2, 3, T, 8, generator=g) for _ in range(step + 1)]
    torch.testing.assert_close(ttt_attention(q, ks, vs), naive_attention(q, ks, vs), rtol=1e-5, atol=1e-5)


def naive_unroll(m: Eagle3Draft, aux, ids, steps):
    """The whole TTT unrolled one position at a time, with per-(step, position) key lists."""
    c, mid = m.config, m.midlayer
    B, T = ids.shape
    h = m.fc(aux)
    K, V = {}, {}
    outs = []
    for i in range(steps):
        qs = {}
        for t in range(T):
            tok = ids[:, t + i + 1] if t + i + 1 < T else torch.zeros(B, dtype=torch.long)
            x = torch.cat([mid.input_layernorm(m.embed_tokens(tok)), mid.hidden_norm(h[:, t])], -1)[:, None]
            pos = torch.tensor([t + i])
            q = rope(
                mid.self_attn.q_proj(x).view(B, 1, c.num_attention_heads, c.head_dim).transpose(1, 2), pos, c.rope_theta
            )
            k = rope(
                mid.self_attn.k_proj(x).view(B, 1, c.num_key_value_heads, c.head_dim).transpose(1, 2), pos, c.rope_theta
            )
            v = mid.self_attn.v_proj(x).view(B, 1, c.num_key_value_heads, c.head_dim).transpose(1, 2)
            rep = c.num_attention_heads // c.num_key_value_heads
            qs[t], K[i, t], V[i, t] = q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        new_h = []
        for t in range(T):
            keys = [K[0, s] for s in range(t + 1)] + [K[j, t] for j in range(1, i + 1)]
            vals = [V[0, s] for s in range(t + 1)] + [V[j, t] for j in range(1, i + 1)]
            a = F.scaled_dot_product_attention(qs[t], torch.cat(keys, 2), torch.cat(vals, 2))
            ht = h[:, t] + mid.self_attn.o_proj(a.transpose(1, 2).reshape(B, -1))
            new_h.append(ht + mid.mlp(mid.post_attention_layernorm(ht)))
        h = torch.stack(new_h, 1)
        outs.append(h)
    return outs


@pytest.mark.parametrize("T", [4, 9])
def test_draft_unroll_equals_position_by_position_reference(T):
    torch.manual_seed(0)
    m = Eagle3Draft(CFG)
    init_weights(m, seed=1)
    aux = torch.randn(2, T, CFG.num_aux * CFG.target_hidden_size)
    ids = torch.randint(0, CFG.vocab_size, (2, T))
    with torch.no_grad():
        fast = list(m.unroll(aux, ids, 7))
        slow = naive_unroll(m, aux, ids, 7)
    for i, (a, b) in enumerate(zip(fast, slow, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"step {i}")


def test_loss_masks_out_of_vocab_targets_and_counts_them_wrong():
    torch.manual_seed(0)
    m = Eagle3Draft(CFG)
    init_weights(m)
    ids, d2t, t2d = build_draft_vocab(torch.arange(CFG.vocab_size).flip(0), CFG.draft_vocab_size)
    m.d2t.copy_(d2t)
    m.t2d.copy_(t2d)
    B, T = 1, 6
    aux = torch.randn(B, T, CFG.num_aux * CFG.target_hidden_size)
    tokens = torch.randint(0, CFG.vocab_size, (B, T))
    p = torch.softmax(torch.randn(B, T, CFG.draft_vocab_size), -1)
    greedy = torch.full((B, T), CFG.vocab_size - 1)  # never in the draft vocab (ids 0..19)
    tb = TargetBatch(p_draft=p, greedy=greedy, in_draft_vocab=t2d[greedy], trained=torch.ones(B, T, dtype=torch.bool))
    out = m(aux, tokens, tb, steps=2)
    assert out.loss.item() == 0.0  # all targets masked from the loss
    assert out.correct.sum().item() == 0  # ...and all counted wrong
    assert out.counted.tolist() == [T - 2, T - 3]  # step i: positions whose token t+i+2 exists
    tb.greedy = torch.zeros(B, T, dtype=torch.long)  # id 0 is in the draft vocab
    tb.in_draft_vocab = t2d[tb.greedy]
    out = m(aux, tokens, tb, steps=2)
    assert out.loss.item() > 0
    out.loss.backward()
    assert m.fc.weight.grad is not None and m.embed_tokens.weight.grad is None


def test_draft_vocab_round_trip():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])
    ids, d2t, t2d = build_draft_vocab(counts, 4)
    assert ids.tolist() == [0, 2, 3, 5]  # top-4 by count, sorted by id
    assert d2t.tolist() == [0, 1, 1, 2]  # target = draft + d2t[draft]
    assert draft_to_target(torch.arange(4), d2t).tolist() == ids.tolist()
    c = count_trained_tokens([(torch.tensor([2, 2, 3]), torch.tensor([0, 1, 1]))], 8)
    assert c.tolist() == [0, 0, 1, 1, 0, 0, 0, 0]


def test_shift_and_acceptance_length():
    x = torch.tensor([[1, 2, 3, 4]])
    assert shift(x, 1, 0).tolist() == [[2, 3, 4, 0]] and shift(x, 5, -1).tolist() == [[-1] * 4]
    assert simulated_acceptance_length([0.8, 0.5, 0.5]) == pytest.approx(0.8 + 0.4 + 0.2)


def specforge_ttt_loss(step_logits, target_logits, t2d, loss_mask, decay=0.8):
    """SpecForge 0.2.0's loss, re-implemented from its source (specforge/algorithms/eagle3/
    model.py ``_compute_target_p`` / ``_compute_target_p_padded`` / the TTT loop, and
    specforge/core/loss.py ``_compute_loss``) with its own names and steps.

    ``target_logits`` is SpecForge's ``target`` after ``preprocess`` (position t holds the
    target's logits one position on); ``loss_mask`` is its loss mask in the same frame.
    """
    T = target_logits.shape[1]
    target_head = target_logits.float()
    target_token_ids = target_head.argmax(-1)
    position_mask = t2d[target_token_ids][..., None].int() * loss_mask[..., None]
    target_p = torch.nn.Softmax(dim=2)(target_head[..., t2d])
    target_p_padded = F.pad(target_p, pad=(0, 0, 0, len(step_logits)), value=1 / target_p.shape[-1])
    plosses = []
    for idx, logits in enumerate(step_logits):
        tp = target_p_padded[:, idx : idx + T, :]
        out_logp = torch.nn.LogSoftmax(dim=2)(logits.float())
        plosses.append(-torch.sum(position_mask * tp * out_logp, 2).mean())
        position_mask = torch.cat((position_mask[:, 1:], torch.zeros_like(position_mask[:, -1:])), dim=1)
    return sum(decay**i * p for i, p in enumerate(plosses))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_equals_specforge_on_the_same_tensors(tmp_path, seed):
    """Strata's soft target (TargetHead.targets, renormalised over the draft vocab) and TTT loss
    equal SpecForge's on the same target logits, masks and draft logits."""
    from safetensors.torch import save_file

    from pipeline.draft.target_head import TargetHead

    torch.manual_seed(seed)
    m = Eagle3Draft(CFG)
    init_weights(m, seed)
    counts = torch.randint(0, 100, (CFG.vocab_size,))
    ids, d2t, t2d = build_draft_vocab(counts, CFG.draft_vocab_size)
    m.d2t.copy_(d2t)
    m.t2d.copy_(t2d)
    B, T, H = 2, 12, 16
    head = torch.randn(CFG.vocab_size, H)
    save_file({"lm_head.weight": head}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text('{"tie_word_embeddings": false}')
    final = torch.randn(B, T, H) * 3
    trained = torch.rand(B, T) > 0.3
    aux = torch.randn(B, T, CFG.num_aux * CFG.target_hidden_size)
    tokens = torch.randint(0, CFG.vocab_size, (B, T))
    steps = 4

    tb = TargetHead(tmp_path).targets(final, trained, ids)
    ours = m(aux, tokens, tb, steps=steps)
    with torch.no_grad():
        step_logits = [m.logits(h) for h in m.unroll(aux, tokens, steps)]
    # SpecForge's frame: target[t] = logits at t+1 (``preprocess``), and its loss mask marks
    # the token that target predicts -- Strata's ``trained`` two positions on.
    target_sf = shift(final @ head.T, 1, fill=0.0)
    theirs = specforge_ttt_loss(step_logits, target_sf, t2d, shift(trained, 2, fill=False).int())
    torch.testing.assert_close(ours.loss.detach(), theirs, rtol=1e-5, atol=1e-6)
    # The previous definition (full-vocab probabilities of the draft tokens) differs.
    tb_full = TargetHead(tmp_path).targets(final, trained, ids, soft_target="full_vocab")
    assert not torch.allclose(m(aux, tokens, tb_full, steps=steps).loss.detach(), theirs, rtol=1e-3)
    assert torch.allclose(tb.p_draft.sum(-1), torch.ones(B, T))
    with pytest.raises(ValueError, match="soft_target"):
        TargetHead(tmp_path).targets(final, trained, ids, soft_target="nope")


def _sequences(lens, seed=1):
    g = torch.Generator().manual_seed(seed)
    H, V, Vd = CFG.num_aux * CFG.target_hidden_size, CFG.vocab_size, CFG.draft_vocab_size
    return [
        {
            "aux": torch.randn(n, H, generator=g),
            "ids": torch.randint(0, V, (n,), generator=g),
            "trained": torch.rand(n, generator=g) > 0.3,
            "p": torch.softmax(torch.randn(n, Vd, generator=g) * 2, -1),
            "greedy": torch.randint(0, V, (n,), generator=g),
        }
        for n in lens
    ]


def _padded(seqs):
    B, T = len(seqs), max(len(s["ids"]) for s in seqs)
    aux, ids = torch.zeros(B, T, seqs[0]["aux"].shape[-1]), torch.zeros(B, T, dtype=torch.long)
    trained, p = torch.zeros(B, T, dtype=torch.bool), torch.zeros(B, T, CFG.draft_vocab_size)
    greedy = torch.full((B, T), -1)
    for b, s in enumerate(seqs):
        n = len(s["ids"])
        aux[b, :n], ids[b, :n], trained[b, :n], p[b, :n], greedy[b, :n] = (
            s[k] for k in ("aux", "ids", "trained", "p", "greedy")
        )
    return aux, ids, TargetBatch(p, greedy, torch.ones_like(trained), trained)


def _packed(seqs):
    cat = {k: torch.cat([s[k] for s in seqs])[None] for k in seqs[0]}
    in_vocab = torch.ones_like(cat["trained"])
    return cat["aux"], cat["ids"], TargetBatch(cat["p"], cat["greedy"], in_vocab, cat["trained"])


def _loss_and_grads(m, batch, seq_lens, steps=5):
    m.zero_grad(set_to_none=True)
    out = m(*batch, steps=steps, seq_lens=seq_lens)
    out.loss.backward()
    return out, {k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None}


def test_a_packed_batch_trains_as_its_sequences_padded():
    """Sequences end to end in one row (each with its own positions, attending to itself, scored
    up to its own end) give the loss, counts and gradients of the same sequences padded to rows --
    equal up to fp32 rounding: the sums over positions add the same terms in another layout, so
    bit-for-bit equality is not what either layout's kernels promise. A row that let sequences see
    each other, or that ran on past a sequence's end, differs by orders of magnitude more."""
    torch.manual_seed(0)
    m = Eagle3Draft(CFG)
    init_weights(m, 0)
    lens = [23, 12, 40, 16, 5]
    seqs = _sequences(lens)
    padded, p_grads = _loss_and_grads(m, _padded(seqs), lens)
    packed, q_grads = _loss_and_grads(m, _packed(seqs), lens)
    torch.testing.assert_close(packed.step_loss, padded.step_loss, rtol=1e-6, atol=0)
    assert torch.equal(packed.correct, padded.correct) and torch.equal(packed.counted, padded.counted)
    # every trained position of every sequence, minus the last i+2 of each at step i
    expect = [sum(int(s["trained"][i + 2 :].sum()) for s in seqs) for i in range(5)]
    assert packed.counted.tolist() == expect
    for k, g in p_grads.items():
        torch.testing.assert_close(q_grads[k], g, rtol=1e-5, atol=1e-6 * float(g.abs().max())), k
    # the loss is a mean over real positions: the padded layout's extra positions add nothing
    wide = _padded(seqs)
    pad = (0, 0, 0, 9)
    wider = (
        F.pad(wide[0], pad),
        F.pad(wide[1], (0, 9)),
        TargetBatch(
            *(
                F.pad(t, pad if t.dim() == 3 else (0, 9))
                for t in (wide[2].p_draft, wide[2].greedy, wide[2].in_draft_vocab, wide[2].trained)
            )
        ),
    )
    torch.testing.assert_close(
        m(*wider, steps=5, seq_lens=lens).step_loss.detach(), padded.step_loss, rtol=1e-6, atol=0
    )
    # the same row read as one long sequence: neighbours seen, positions run on, ends crossed
    one, _ = _loss_and_grads(m, _packed(seqs), [sum(lens)])
    assert (one.step_loss - packed.step_loss).abs().max() > 1e-3 * packed.step_loss.abs().max()
    assert one.counted.sum() > packed.counted.sum()
    with pytest.raises(ValueError, match="packed batch"):
        m(*_packed(seqs), steps=2, seq_lens=[*lens[:-1], lens[-1] + 1])


def test_a_packed_batch_drafts_every_position_as_the_padded_batch_bit_for_bit(request):
    """The forward of a packed row equals the padded batch's at every position a sequence's own
    tokens reach, bit for bit: the attention runs on the sequences set out as rows -- the very SDPA
    call the padded batch makes -- and everything else row by row. fp32 matmuls round a row the same
    wherever it sits in the matrix on one thread for rows of 12 tokens or more (see
    ``test_hf_engine``); the backward's sums over positions are another matter (the test above)."""
    threads = torch.get_num_threads()
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    torch.set_num_threads(1)
    m = Eagle3Draft(CFG)
    init_weights(m, 3)
    lens = [14, 30, 12, 21]
    seqs = _sequences(lens, seed=4)
    aux, ids, _ = _packed(seqs)
    paux, pids, _ = _padded(seqs)
    with torch.no_grad():
        packed = list(m.unroll(aux, ids, 4, Layout.of(ids, lens)))
        padded = list(m.unroll(paux, pids, 4, Layout.of(pids, lens)))
    for i in range(4):
        at = 0
        for b, length in enumerate(lens):
            keep = length - i - 1  # positions whose tokens stay inside the sequence at step i
            assert torch.equal(packed[i][0, at : at + keep], padded[i][b, :keep]), (i, b)
            at += length
