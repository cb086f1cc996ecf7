"""The EAGLE-3 draft model and its training-time test (TTT), top to bottom.

Shapes: B batch, T tokens, H draft hidden, Ht target hidden, A aux capture slots,
V target vocab, Vd draft vocab, h heads, d head dim.

    aux  [B, T, A*Ht]  --fc-->  h0 [B, T, H]                     (once, at step 0)
    step i (0..S-1), at every position t:
        x = cat(input_layernorm(embed(tok_{t+i+1})), hidden_norm(h_i))   [.., 2H]
        h_attn = h_i + o_proj(attn(x))       queries at position t+i attend to
                                             step-0 keys k_0[0..t] (causal) and to
                                             their own keys k_1[t]..k_i[t]
        h_{i+1} = h_attn + mlp(post_attention_layernorm(h_attn))   (pre-norm: fed back)
        logits_i = lm_head(norm(h_{i+1}))    [.., Vd]  predicts token t+i+2
    loss = sum_i 0.8^i * mean over the batch's real positions of
           mask * softCE(logits_i, softmax of the target's draft-vocab logits at t+i+1)
    (SpecForge's definition -- renormalised over the draft vocab, averaged over every position
    of an unpadded sequence -- with padding left out of the mean, so the loss is the same
    whether a batch pads its sequences to rows or packs them end to end)

A batch holds one sequence per row (padded to the longest) or several end to end in one row
(packed, ``seq_lens`` giving their lengths): a packed sequence keeps its own positions, is
scored only up to its own end, and for attention is set out as a row of the padded layout
(``Layout``), so it attends only to itself and drafts exactly what the padded batch drafts.

Weight names match SpecForge / SGLang / vLLM EAGLE-3 checkpoints (fc, midlayer.*, norm,
lm_head, d2t, t2d). The token embedding is the target's, frozen and never saved.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class DraftConfig:
    hidden_size: int
    target_hidden_size: int
    num_aux: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096

    @classmethod
    def from_target(cls, target: dict, num_aux: int, draft_vocab_size: int) -> DraftConfig:
        """The draft mirrors one decoder layer of the target (HF ``config.json`` dict)."""
        t = target.get("text_config", target)
        heads = t["num_attention_heads"]
        return cls(
            hidden_size=t["hidden_size"],
            target_hidden_size=t["hidden_size"],
            num_aux=num_aux,
            intermediate_size=t["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=t.get("num_key_value_heads", heads),
            head_dim=t.get("head_dim") or t["hidden_size"] // heads,
            vocab_size=t["vocab_size"],
            draft_vocab_size=min(draft_vocab_size, t["vocab_size"]),
            rms_norm_eps=t.get("rms_norm_eps", 1e-5),
            rope_theta=float(t.get("rope_theta") or (t.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            max_position_embeddings=t.get("max_position_embeddings", 4096),
        )

    def to_dict(self) -> dict:
        return asdict(self)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama's RMSNorm: normalise in fp32, cast back to x's dtype, then scale."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (Llama's rotate-half form). x [B, h, T, d], positions [T]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def ttt_mask(T: int, steps_so_far: int, device: torch.device) -> torch.Tensor:
    """[T, T*(i+1)] bool: causal over step-0 keys, diagonal over each later step's keys."""
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    eye = torch.eye(T, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * (steps_so_far - 1), dim=1)


def ttt_attention(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> torch.Tensor:
    """Attention of step i = len(ks)-1 (q [B,h,T,d]; ks/vs per step, GQA-expanded).

    One fused SDPA call over the concatenated keys with a boolean mask: on GPU this runs
    the memory-efficient kernel, so no [T, T*steps] weight matrix is kept for backward.
    """
    k, v = torch.cat(ks, dim=2), torch.cat(vs, dim=2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=ttt_mask(q.shape[2], len(ks), q.device))


@dataclass
class Layout:
    """Where a batch's sequences lie: one per row, padded to the longest, or end to end in a
    single row (packed). A packed batch's attention runs on its sequences set out as rows
    (``rows``): one SDPA call, the one the padded batch makes, with no work across sequences;
    everything else runs on the real tokens alone."""

    positions: torch.Tensor  # [T] each token's position in its own sequence
    remaining: torch.Tensor  # [B, T] tokens after this one in its own sequence (negative on padding)
    tokens: int  # real tokens, padding excluded: what the loss averages over
    rows: tuple[int, int] | None = None  # packed: (sequences, longest) of the attention's padded rows
    slots: torch.Tensor | None = None  # packed: each token's place in those rows, flattened

    @classmethod
    def of(cls, input_ids: torch.Tensor, seq_lens: torch.Tensor | list[int] | None = None) -> Layout:
        """``seq_lens``: one length per row (padded), or the lengths packed in one row; None: rows are full."""
        B, T = input_ids.shape
        dev = input_ids.device
        lens = [T] * B if seq_lens is None else [int(x) for x in seq_lens]
        if len(lens) == B:
            t = torch.arange(T, device=dev)
            return cls(t, torch.as_tensor(lens, device=dev)[:, None] - 1 - t[None, :], sum(lens))
        if B != 1 or sum(lens) != T:
            raise ValueError(f"a packed batch is one row of its sequences end to end: {lens} in [{B}, {T}]")
        longest = max(lens)
        positions = torch.cat([torch.arange(length, device=dev) for length in lens])
        row = torch.repeat_interleave(torch.arange(len(lens), device=dev), torch.as_tensor(lens, device=dev))
        counts = torch.as_tensor(lens, device=dev)[row]
        return cls(positions, (counts - 1 - positions)[None, :], T, (len(lens), longest), row * longest + positions)

    def to_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[1, h, T, d] packed -> [S, h, longest, d], zeros past each sequence's end."""
        assert self.rows is not None and self.slots is not None
        S, longest = self.rows
        flat = x[0].transpose(0, 1)  # [T, h, d]
        out = flat.new_zeros(S * longest, *flat.shape[1:]).index_copy(0, self.slots, flat)
        return out.view(S, longest, *flat.shape[1:]).transpose(1, 2)

    def from_rows(self, y: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`to_rows` on the real tokens."""
        assert self.rows is not None and self.slots is not None
        S, longest = self.rows
        flat = y.transpose(1, 2).reshape(S * longest, y.shape[1], y.shape[3])  # [S*longest, h, d]
        return flat.index_select(0, self.slots).transpose(0, 1)[None]


class Attention(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.c = c
        h, kv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, c.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        ks: list[torch.Tensor],
        vs: list[torch.Tensor],
        layout: Layout | None = None,
    ) -> torch.Tensor:
        """x [B,T,2H] -> [B,T,H]; appends this step's (GQA-expanded) keys/values to ks/vs (as rows)."""
        B, T, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = rope(q, positions, c.rope_theta), rope(k, positions, c.rope_theta)
        packed = layout is not None and layout.rows is not None
        if packed:
            q, k, v = layout.to_rows(q), layout.to_rows(k), layout.to_rows(v)
        rep = c.num_attention_heads // c.num_key_value_heads
        ks.append(k.repeat_interleave(rep, dim=1))
        vs.append(v.repeat_interleave(rep, dim=1))
        a = ttt_attention(q, ks, vs)
        if packed:
            a = layout.from_rows(a)
        return self.o_proj(a.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """The draft's single decoder layer; attention reads [embedding ; hidden] (2H wide)."""

    def __init__(self, c: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(
        self,
        emb: torch.Tensor,
        h: torch.Tensor,
        positions: torch.Tensor,
        ks: list[torch.Tensor],
        vs: list[torch.Tensor],
        layout: Layout | None = None,
    ) -> torch.Tensor:
        """One step: the token embedding and the previous state -> h_{i+1} (pre-norm, fed back)."""
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], dim=-1)
        h_attn = h + self.self_attn(x, positions, ks, vs, layout)
        return h_attn + self.mlp(self.post_attention_layernorm(h_attn))


class Eagle3Draft(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's; frozen, not saved
        self.fc = nn.Linear(c.num_aux * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))

    # -- one pass of the midlayer ------------------------------------------------------------
    def step(
        self,
        tokens: torch.Tensor,
        h: torch.Tensor,
        positions: torch.Tensor,
        ks: list[torch.Tensor],
        vs: list[torch.Tensor],
        layout: Layout | None = None,
    ) -> torch.Tensor:
        """Run the midlayer once; appends this step's keys/values to ks/vs; returns h_{i+1}."""
        return self.midlayer(self.embed_tokens(tokens), h, positions, ks, vs, layout)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))

    # -- training-time test -------------------------------------------------------------------
    def unroll(self, aux: torch.Tensor, input_ids: torch.Tensor, steps: int, layout: Layout | None = None):
        """Yield h_{i+1} [B,T,H] for steps i = 0..steps-1 (the draft's pre-norm outputs)."""
        layout = layout or Layout.of(input_ids)
        h = self.fc(aux.to(self.fc.weight.dtype))
        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []
        for i in range(steps):
            # Position t at step i reads token t+i+1 (and sits at position t+i). Past a packed
            # sequence's end that is the next sequence's token: never scored (``Layout.remaining``).
            h = self.step(shift(input_ids, i + 1, fill=0), h, layout.positions + i, ks, vs, layout)
            yield h

    def forward(
        self,
        aux: torch.Tensor,
        input_ids: torch.Tensor,
        target: TargetBatch,
        steps: int = 7,
        decay: float = 0.8,
        seq_lens: torch.Tensor | list[int] | None = None,
    ) -> TTTOutput:
        """Unroll ``steps`` draft steps over whole sequences and score them against the target.

        At step i, position t predicts token t+i+2, which the target predicted at position
        t+i+1; it counts when that token is trained (assistant, not padding) and lies in t's
        own sequence. Positions whose target token is outside the draft vocab are left out of
        the loss and count as wrong. ``seq_lens``: see :meth:`Layout.of`.
        """
        layout = Layout.of(input_ids, seq_lens)
        losses, correct, counted = [], [], []
        total = aux.new_zeros((), dtype=torch.float32)
        for i, h in enumerate(self.unroll(aux, input_ids, steps, layout)):
            s = self.score_step(h, i, target, layout)
            loss_i = s.ce.sum() / layout.tokens  # SpecForge's mean over positions, padding left out
            total = total + (decay**i) * loss_i
            losses.append(loss_i.detach())
            correct.append(s.hit.sum().detach())
            counted.append(s.trained.sum().detach())
        return TTTOutput(total, torch.stack(losses), torch.stack(correct), torch.stack(counted))

    def score_step(self, h: torch.Tensor, i: int, target: TargetBatch, layout: Layout) -> StepScore:
        """Step i's loss terms and hits at every position (the probe weighs them per sequence)."""
        logits = self.logits(h).float()
        p, trained, mask = step_target(target, i, layout)
        ce = -(p * logits.log_softmax(-1)).sum(-1)
        hit = (draft_to_target(logits.argmax(-1), self.d2t) == shift(target.greedy, i + 1, fill=-1)) & trained
        return StepScore(ce * mask, mask, hit, trained)


def step_target(target: TargetBatch, i: int, layout: Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What step i is scored against at every position: the target's distribution for the token it
    predicts, whether that token is trained (in this sequence), and whether it is in the loss (also in
    the draft vocab)."""
    trained = shift(target.trained, i + 2, fill=False) & (layout.remaining >= i + 2)
    return shift(target.p_draft, i + 1, fill=0.0), trained, trained & shift(target.in_draft_vocab, i + 1, fill=False)


def shift(x: torch.Tensor, by: int, fill) -> torch.Tensor:
    """x[:, t] <- x[:, t+by]; the last ``by`` positions get ``fill``."""
    if by == 0:
        return x
    out = torch.full_like(x, fill)
    if by < x.shape[1]:
        out[:, : x.shape[1] - by] = x[:, by:]
    return out


@dataclass
class TargetBatch:
    """What the target says about each position of a batch (from its stored final state)."""

    p_draft: torch.Tensor  # [B,T,Vd] target distribution over the draft vocab (TargetHead.targets)
    greedy: torch.Tensor  # [B,T] target argmax over the FULL vocab (next-token prediction)
    in_draft_vocab: torch.Tensor  # [B,T] greedy token is in the draft vocab (else masked from loss)
    trained: torch.Tensor  # [B,T] loss mask of the token at this position (assistant, not padding)


@dataclass
class StepScore:
    """One TTT step at every position [B, T]: what the loss and the accuracy are made of."""

    ce: torch.Tensor  # soft cross-entropy against the target, 0 where not in the loss
    in_loss: torch.Tensor  # trained, and the target's token is in the draft vocab
    hit: torch.Tensor  # the draft's greedy token is the target's, at a trained position
    trained: torch.Tensor  # the predicted token is trained (assistant, in this sequence)


@dataclass
class TTTOutput:
    loss: torch.Tensor  # weighted sum over steps (scalar, differentiable)
    step_loss: torch.Tensor  # [S]
    correct: torch.Tensor  # [S] draft greedy == target greedy, over trained positions
    counted: torch.Tensor  # [S] trained positions (targets outside the draft vocab count wrong)

    def accuracy(self) -> list[float]:
        return (self.correct.float() / self.counted.clamp(min=1).float()).tolist()


def draft_to_target(draft_ids: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """Target token ids of draft-vocab ids: ``d2t`` holds offsets (vLLM's and SGLang's format)."""
    return draft_ids + d2t[draft_ids]


def simulated_acceptance_length(acc: list[float]) -> float:
    """sum_k prod_{i<=k} acc_i: expected accepted draft tokens per step under chain speculation."""
    total, prod = 0.0, 1.0
    for a in acc:
        prod *= a
        total += prod
    return total


def init_weights(model: Eagle3Draft, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.requires_grad and p.dim() == 2:
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
