"""The attention of the GLM family below the projections: the additive mask and rotary angles
a stage's blocks share (StageCache), rotary positions (Su et al. 2021), ALiBi slopes (Press et
al. 2022), the eager softmax kernel with a 1-byte dropout mask, and causal linear attention
(Katharopoulos et al. 2020). SelfAttention (block.py) projects q, k, v and calls these."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from planner.model.parallel.groups import TPGroup
from planner.specs.model import ModelSpec

ATTENTION = ("flash", "eager")
"""TrainSpec.attention: torch's scaled_dot_product_attention, or eager_attention below."""


def alibi_slopes(n: int) -> torch.Tensor:
    """Press et al. 2022: geometric slopes 2^(-8i/n)."""
    return torch.tensor([2 ** (-8.0 * (i + 1) / n) for i in range(n)])


def rotary_dims(spec: ModelSpec) -> int:
    """The first rotary_fraction of each head's dims, rounded down to even: ChatGLM's 2D-RoPE
    and transformers' GlmForCausalLM rotate the first half, llama the whole head."""
    d = int(spec.dim_per_head * spec.rotary_fraction)
    return d - d % 2


class StageCache:
    """The additive attention mask (activation dtype; causal and within-document) and the
    rotary cos/sin of the current micro-batch, built once and shared by every block of this
    stage, so autograd stores them once per micro-batch rather than once per block. Keyed by
    the identity of the micro-batch's position/segment tensors (the same objects flow through
    a stage's blocks); a recompute under checkpointing sees detached copies and rebuilds."""

    def __init__(self, spec: ModelSpec, tp: TPGroup) -> None:
        self.spec, self.tp = spec, tp
        self._key: tuple | None = None
        self._value: dict[str, torch.Tensor] = {}

    def get(self, pos: torch.Tensor, segments: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        key = (pos, segments, dtype)
        if self._key is None or any(a is not b for a, b in zip(self._key, key)):
            self._key, self._value = key, self._build(pos, segments, dtype)
        return self._value

    def _build(self, pos: torch.Tensor, segments: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        spec, s = self.spec, segments.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool, device=segments.device).tril()
        allowed = (segments[:, :, None] == segments[:, None, :]) & causal  # b s s
        # linear attention masks documents chunk by chunk (linear_attention): no s x s mask
        out = {} if spec.linear_attention else {"mask": additive_mask(spec, self.tp, pos, pos, allowed, dtype)}
        angles = rotary_angles(spec, pos)
        if angles is not None:
            out["cos"], out["sin"] = angles
        return out


def additive_mask(spec: ModelSpec, tp: TPGroup, q_pos: torch.Tensor, k_pos: torch.Tensor, allowed: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    """The additive attention mask [b, heads/TP or 1, s, L]: -inf where `allowed` [b, s, L] is
    false, else ALiBi's bias slope x (key position - query position) for this rank's heads
    (q_pos [b, s], k_pos [b or 1, L]: absolute positions), or 0."""
    if spec.position == "alibi":
        heads = spec.heads // tp.size
        slopes = alibi_slopes(spec.heads)[tp.rank * heads:(tp.rank + 1) * heads].to(q_pos.device)
        dist = (k_pos[:, None, :] - q_pos[:, :, None]).float()  # b s L (key - query)
        bias = slopes[None, :, None, None] * dist[:, None]  # b n s L
    else:
        bias = torch.zeros((allowed.shape[0], 1) + tuple(allowed.shape[1:]), device=allowed.device)
    return bias.to(dtype).masked_fill(~allowed[:, None], float("-inf"))


def rotary_angles(spec: ModelSpec, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """cos and sin [b, s, 1, r/2] of the rotary angles at positions `pos` [b, s] (Su et al. 2021,
    base rope_theta over the first r = rotary_dims dims); None without rotary positions."""
    rot = rotary_dims(spec)
    if spec.position != "rotary" or not rot:
        return None
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, rot, 2, device=pos.device, dtype=torch.float32) / rot))
    ang = pos.float()[..., None] * inv  # b s rot/2
    return ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
    """Rotate the first r = 2 * cos.shape[-1] dims of each head in fp32 (x: b s n d); pair i
    turns by angle i: pairs (2i, 2i+1) when interleaved (ChatGLM, GLM), else (i, i + r/2)
    (llama's rotate_half)."""
    rot = 2 * cos.shape[-1]
    xr, xp = x[..., :rot].float(), x[..., rot:]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :rot // 2], xr[..., rot // 2:]
        out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return torch.cat((out.to(x.dtype), xp), dim=-1)


def dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """Training-mode dropout that keeps a 1-byte mask for backward on every device: on CPU,
    F.dropout multiplies by a noise tensor of the input's dtype (2 bytes in bf16, 4 in fp32);
    torch.native_dropout (what F.dropout runs on CUDA) saves a bool mask."""
    return torch.native_dropout(x, p, True)[0]



def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, p: float) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d) + mask) -> dropout -> @ V (b n s d; k, v: b kv s d). The query
    heads of one KV group are consecutive (ChatGLM2), so grouped K/V are used without repeating."""
    b, n, s, d = q.shape
    kv = k.shape[1]
    qg = q.reshape(b, kv, (n // kv) * s, d) * (1.0 / math.sqrt(d))
    scores = torch.matmul(qg, k.transpose(-1, -2)).view(b, n, s, s) + mask
    probs = torch.softmax(scores, dim=-1)
    if p > 0:
        probs = dropout(probs, p)
    return torch.matmul(probs.view(b, kv, (n // kv) * s, s), v).view(b, n, s, d)


LINEAR_CHUNK = 64
"""Tokens per chunk of linear_attention (planner.cost.compute.LINEAR_CHUNK, the same number)."""


def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: torch.Tensor,
                     chunk: int = LINEAR_CHUNK) -> torch.Tensor:
    """Causal linear attention (Katharopoulos et al. 2020, arXiv 2006.16236, eq. 4-6) with the
    feature map phi(x) = elu(x) + 1, within documents: out_i = phi(q_i) S_i / phi(q_i) z_i,
    S_i = sum phi(k_j) v_j^T and z_i = sum phi(k_j) over j <= i of i's document.

    q: b n s d, k and v: b g s d (the query heads of a KV group consecutive), segments: b s
    document ids, contiguous within a row (packing). Chunks of `chunk` tokens: inside a chunk
    the masked quadratic form, across chunks a d x d state per KV head for the document open at
    the chunk boundary (reset when a new document starts). In fp32; returns q's dtype."""
    b, n, s, d = q.shape
    g = k.shape[1]
    qf = (F.elu(q.float()) + 1.0).view(b, g, n // g, s, d)
    kf, vf = F.elu(k.float()) + 1.0, v.float()
    state = qf.new_zeros(b, g, d, d)
    norm = qf.new_zeros(b, g, d)
    prev = None  # b: document of the token before this chunk
    outs = []
    for lo in range(0, s, chunk):
        hi = min(lo + chunk, s)
        qc, kc, vc, sc = qf[:, :, :, lo:hi], kf[:, :, lo:hi], vf[:, :, lo:hi], segments[:, lo:hi]
        causal = torch.ones(hi - lo, hi - lo, dtype=torch.bool, device=q.device).tril()
        allowed = ((sc[:, :, None] == sc[:, None, :]) & causal).to(qf.dtype)  # b c c
        scores = torch.einsum("bgmid,bgjd->bgmij", qc, kc) * allowed[:, None, None]
        num = torch.einsum("bgmij,bgjd->bgmid", scores, vc)
        den = scores.sum(-1)
        if prev is not None:
            carry = (sc == prev[:, None]).to(qf.dtype)[:, None, None]  # b 1 1 c: same document as the state
            num = num + torch.einsum("bgmid,bgde->bgmie", qc, state) * carry[..., None]
            den = den + torch.einsum("bgmid,bgd->bgmi", qc, norm) * carry
        outs.append(num / den[..., None])  # den > 0: phi > 0 and each token attends to itself
        last = sc[:, -1]
        own = (sc == last[:, None]).to(qf.dtype)[:, None, :, None]  # b 1 c 1: keys of the open document
        keep = (last == prev).to(qf.dtype) if prev is not None else torch.zeros_like(last, dtype=qf.dtype)
        state = state * keep[:, None, None, None] + torch.einsum("bgjd,bgje->bgde", kc * own, vc)
        norm = norm * keep[:, None, None] + (kc * own).sum(2)
        prev = last
    return torch.cat(outs, dim=3).reshape(b, n, s, d).to(q.dtype)


class _LinearAttention(torch.autograd.Function):
    """linear_attention keeping only q, k, v (and the segment ids) for backward, which runs the
    chunked forward again (like flash attention's recompute): no chunk scores or states kept."""

    @staticmethod
    def forward(ctx, q, k, v, segments):
        ctx.save_for_backward(q, k, v, segments)
        return linear_attention(q, k, v, segments)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, segments = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
            gq, gk, gv = torch.autograd.grad(linear_attention(*leaves, segments), leaves, grad)
        return gq, gk, gv, None
