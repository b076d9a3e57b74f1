"""A GLM-family transformer in torch, built from a ModelSpec, tensor-parallel by construction.

Faithful to the variants the presets name (ChatGLM/GLM-130B code, THUDM):
- LayerNorm or RMSNorm; pre-LN, post-LN, or DeepNorm (post-LN with residual scaled by
  alpha = (2N)^(1/2), Wang et al. 2022 "DeepNet", as in GLM-130B);
- rotary positions (Su et al. 2021; ChatGLM and GLM rotate half of each head in interleaved
  pairs, llama the whole head with rotate_half: ModelSpec.rotary_fraction, rope_interleaved), learned
  absolute positions, or ALiBi biases (Press et al. 2022);
- GELU MLP or GeGLU/SwiGLU (Shazeer 2020), fused [gate | up] as ChatGLM2's dense_h_to_4h;
- multi-head or grouped/multi-query attention (kv_groups), fused [q | k | v] projection;
- hidden dropout after the attention output and after the FFN output, attention dropout on
  the probabilities (ModelSpec.hidden_dropout / attention_dropout), only while training;
- the what-if variants (docs/variants.md): causal linear attention (attention_kind "linear",
  Katharopoulos et al. 2020; no attention dropout: there are no probabilities), a pruned FFN
  (ffn_size columns) and K consecutive blocks sharing parameters (share_layers).

Every linear is a Megatron-style tensor-parallel layer (planner/executor/parallel/tensor.py);
TP = 1 runs the same code with groups of size 1. Attention is TrainSpec.attention: "flash"
(torch scaled_dot_product_attention; no s x s tensor kept) or "eager" (softmax(QK^T/sqrt(d) +
mask) -> dropout -> @V in plain ops, storing the softmax). docs/runtime.md lists, measured,
what each layer saves for backward.

The model is a flat list of layers: WordEmbedding, [PositionEmbedding], Block x L, FinalNorm,
OutputLayer (or, tied, the word embedding again). PipelineModule splits that list at the
plan's boundaries (parallel/pipeline.py); GLMModel runs it whole. Layers pass a tuple
(hidden, position_ids, segment_ids) so pipeline stages can send it. Parameter names are
ChatGLM's; `p.canonical` is each parameter's layout-independent name (its init seed).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from planner.executor.parallel.groups import SINGLE, TPGroup
from planner.executor.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                              mark_replicated, mark_split, parallel_input_linear, replicated,
                                              scaled_std, scatter_seq, seeded_normal, tp_rng,
                                              vocab_parallel_cross_entropy, INIT_STD)
from planner.specs.model import ModelSpec

IGNORE = -100
ATTENTION = ("flash", "eager")


# --- norms: save the input and per-row statistics only -----------------------------------------


class _RMSNormFn(torch.autograd.Function):
    """y = x * rsqrt(mean(x^2) + eps) * w, statistics in fp32; saves x and the fp32 rstd (b x s x 1).
    (On CPU, torch's F.rms_norm is a composite that keeps several fp32 copies of x.)"""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.to(rstd.dtype) * rstd
        g = grad.to(rstd.dtype)
        grad_w = (g * xhat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        gx = g * weight.to(rstd.dtype)
        grad_x = rstd * (gx - xhat * (gx * xhat).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_w, None


class RMSNorm(nn.Module):
    """Zhang & Sennrich 2019; ChatGLM2/3 and GLM-4."""

    def __init__(self, hidden: int, tp: TPGroup, name: str, eps: float = 1e-5) -> None:
        super().__init__()
        self.tp, self.eps = tp, eps
        self.weight = nn.Parameter(torch.ones(hidden))
        mark_replicated(self.weight, f"{name}.weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFn.apply(x, replicated(self.weight, self.tp), self.eps)


class LayerNorm(nn.Module):
    """Ba et al. 2016 (GLM-10B, GLM-130B); torch's kernel saves x, mean and rstd."""

    def __init__(self, hidden: int, tp: TPGroup, name: str, eps: float = 1e-5) -> None:
        super().__init__()
        self.tp, self.eps = tp, eps
        self.weight = nn.Parameter(torch.ones(hidden))
        self.bias = nn.Parameter(torch.zeros(hidden))
        mark_replicated(self.weight, f"{name}.weight")
        mark_replicated(self.bias, f"{name}.bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), replicated(self.weight, self.tp), replicated(self.bias, self.tp),
                            self.eps)


def make_norm(spec: ModelSpec, tp: TPGroup, name: str) -> nn.Module:
    norm = RMSNorm if spec.norm == "rmsnorm" else LayerNorm
    return norm(spec.hidden, tp, name, eps=spec.norm_eps)


# --- per-micro-batch tensors shared by a stage's blocks -------------------------------------------


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
        allowed = ((segments[:, :, None] == segments[:, None, :]) & causal)[:, None]  # b 1 s s
        if spec.position == "alibi":
            heads = spec.heads // self.tp.size
            slopes = alibi_slopes(spec.heads)[self.tp.rank * heads:(self.tp.rank + 1) * heads].to(pos.device)
            dist = (pos[:, None, :] - pos[:, :, None]).float()  # b s s (key - query)
            bias = slopes[None, :, None, None] * dist[:, None]  # b n s s
        else:
            bias = torch.zeros(allowed.shape, device=segments.device)
        # linear attention masks documents chunk by chunk (linear_attention): no s x s mask
        out = {} if spec.linear_attention else {"mask": bias.to(dtype).masked_fill(~allowed, float("-inf"))}
        rot = rotary_dims(spec)
        if spec.position == "rotary" and rot:
            inv = 1.0 / (spec.rope_theta ** (torch.arange(0, rot, 2, device=pos.device, dtype=torch.float32) / rot))
            ang = pos.float()[..., None] * inv  # b s rot/2
            out["cos"], out["sin"] = ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]
        return out


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


# --- what a layer keeps for backward (docs/runtime.md) --------------------------------------------


@contextlib.contextmanager
def saved_for_backward(params=()):
    """Record the tensors kept for backward while the body runs forward: those autograd nodes
    save (saved-tensor hooks) and the inputs DeepSpeed's activation checkpointing holds (ctx
    attributes, which the hooks do not see). Yields {storage pointer: [tensors]}: views of one
    storage are one allocation; parameters (`params`) are left out."""
    global _checkpoint
    skip = {p.untyped_storage().data_ptr() for p in params}
    kept: dict[int, list[torch.Tensor]] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            kept.setdefault(ptr, []).append(t)
        return t

    run_checkpoint = _checkpoint

    def checkpoint_keeping_inputs(fn, *args):
        for a in args:
            if torch.is_tensor(a):
                keep(a)
        return run_checkpoint(fn, *args)

    _checkpoint = checkpoint_keeping_inputs
    try:
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            yield kept
    finally:
        _checkpoint = run_checkpoint


def storage_bytes(kept: dict[int, list[torch.Tensor]]) -> int:
    return sum(ts[0].untyped_storage().nbytes() for ts in kept.values())


# --- the transformer block ----------------------------------------------------------------------


def dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """Training-mode dropout that keeps a 1-byte mask for backward on every device: on CPU,
    F.dropout multiplies by a noise tensor of the input's dtype (2 bytes in bf16, 4 in fp32);
    torch.native_dropout (what F.dropout runs on CUDA) saves a bool mask."""
    return torch.native_dropout(x, p, True)[0]


def _checkpoint(fn, *args):
    import deepspeed
    return deepspeed.checkpointing.checkpoint(fn, *args)


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


class SelfAttention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int, tp: TPGroup, attention: str, cache: StageCache,
                 seed: int) -> None:
        super().__init__()
        if spec.heads % tp.size or spec.kv_heads % tp.size:
            raise ValueError(f"TP {tp.size} must divide the heads ({spec.heads}) and KV groups ({spec.kv_heads})")
        if attention not in ATTENTION:
            raise ValueError(f"unknown attention kernel {attention!r}")
        self.spec, self.tp, self.attention, self.cache = spec, tp, attention, cache
        name = f"layers.{layer}.self_attention"
        self.query_key_value = ColumnParallelLinear(spec.hidden, (spec.q_size, spec.kv_size, spec.kv_size),
                                                    spec.qkv_bias, tp, f"{name}.query_key_value", seed)
        self.dense = RowParallelLinear(spec.q_size, spec.hidden, spec.linear_bias, tp, f"{name}.dense", seed,
                                       std=scaled_std(spec.layers))
        self.checkpoint_core = False
        """Selective recompute: recompute the attention core in backward (Korthikanti et al. 2022)."""

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
             segments: torch.Tensor) -> torch.Tensor:
        shared = self.cache.get(pos, segments, q.dtype)
        if "cos" in shared:
            il = self.spec.rope_interleaved
            q, k = rotary(q, shared["cos"], shared["sin"], il), rotary(k, shared["cos"], shared["sin"], il)
            v = v.contiguous()  # else the saved v (a view) keeps the whole QKV output alive
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # b n s d
        if self.spec.linear_attention:
            return _LinearAttention.apply(q, k, v, segments).transpose(1, 2).flatten(2)
        p = self.spec.attention_dropout if self.training else 0.0
        with tp_rng() if p > 0 else contextlib.nullcontext():  # heads differ per TP rank
            # torch has no memory-efficient CPU kernel with dropout: SDPA would fall back to its
            # math path, which keeps the scores, an fp32 dropout mask and the dropout output in
            # fp32; the eager path keeps them in the activation dtype with a 1-byte mask
            if self.attention == "eager" or (p > 0 and q.device.type == "cpu"):
                out = eager_attention(q, k, v, shared["mask"], p)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=shared["mask"], dropout_p=p,
                                                     enable_gqa=k.shape[1] != q.shape[1])
        return out.transpose(1, 2).flatten(2)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        qkv = self.query_key_value(x)  # b s (q + 2 kv)/t, full sequence
        t = (spec.q_size + 2 * spec.kv_size) // qkv.shape[-1]  # this rank's share of the heads: 1/TP
        q, k, v = qkv.split([spec.q_size // t, spec.kv_size // t, spec.kv_size // t], dim=-1)
        b, s = qkv.shape[:2]
        d = spec.dim_per_head
        q, k, v = q.reshape(b, s, -1, d), k.reshape(b, s, -1, d), v.reshape(b, s, -1, d)
        if self.checkpoint_core and self.training:
            out = _checkpoint(self.core, q, k, v, pos, segments)
        else:
            out = self.core(q, k, v, pos, segments)
        return self.dense(out)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int, tp: TPGroup, seed: int) -> None:
        super().__init__()
        if spec.ffn_size % tp.size:
            raise ValueError(f"TP {tp.size} must divide the FFN size {spec.ffn_size}")
        self.spec = spec
        name = f"layers.{layer}.mlp"
        # ffn_size: ffn_hidden, or fewer columns for a pruned FFN (ModelSpec.ffn_sparsity)
        self.dense_h_to_4h = ColumnParallelLinear(spec.hidden, (spec.ffn_size,) * spec.ffn_in_matrices,
                                                  spec.linear_bias, tp, f"{name}.dense_h_to_4h", seed)
        self.dense_4h_to_h = RowParallelLinear(spec.ffn_size, spec.hidden, spec.linear_bias, tp,
                                               f"{name}.dense_4h_to_h", seed, std=scaled_std(spec.layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dense_h_to_4h(x)
        if self.spec.glu:
            gate, up = h.chunk(2, dim=-1)  # this rank's slice of gate, then of up
            h = (F.silu(gate) if self.spec.activation == "swiglu" else F.gelu(gate)) * up
        else:
            h = F.gelu(h)
        return self.dense_4h_to_h(h)


class Block(nn.Module):
    """One transformer layer. `checkpoint=True`: full recompute of this block in backward."""

    def __init__(self, spec: ModelSpec, layer: int = 0, checkpoint: bool = False, selective: bool = False, *,
                 tp: TPGroup = SINGLE, attention: str = "flash", cache: StageCache | None = None,
                 seed: int = 0) -> None:
        super().__init__()
        self.spec, self.tp, self.layer = spec, tp, layer
        cache = cache if cache is not None else StageCache(spec, tp)
        self.input_layernorm = make_norm(spec, tp, f"layers.{layer}.input_layernorm")
        self.self_attention = SelfAttention(spec, layer, tp, attention, cache, seed)
        self.self_attention.checkpoint_core = selective and not checkpoint
        self.post_attention_layernorm = make_norm(spec, tp, f"layers.{layer}.post_attention_layernorm")
        self.mlp = MLP(spec, layer, tp, seed)
        self.checkpoint = checkpoint
        # DeepNorm (Wang et al. 2022, Table 1, decoder-only): x * alpha + f(x), alpha = (2N)^(1/2)
        self.alpha = math.sqrt(2 * spec.layers) if spec.norm_position == "deepnorm" else 1.0

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        p = self.spec.hidden_dropout
        if p == 0 or not self.training:
            return x
        with tp_rng() if self.tp.sequence_parallel else contextlib.nullcontext():  # shards differ per rank
            return dropout(x, p)

    def _run(self, h: torch.Tensor, pos: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        attn = lambda x: self._dropout(self.self_attention(x, pos, segments))  # noqa: E731
        mlp = lambda x: self._dropout(self.mlp(x))  # noqa: E731
        if self.spec.norm_position == "pre":
            h = h + attn(self.input_layernorm(h))
            return h + mlp(self.post_attention_layernorm(h))
        # post-LN / DeepNorm (GLM-130B): norm after the residual sum
        h = self.input_layernorm(h * self.alpha + attn(h))
        return self.post_attention_layernorm(h * self.alpha + mlp(h))

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]):
        h, pos, segments = inputs
        if self.checkpoint and self.training:
            h = _checkpoint(self._run, h, pos, segments)
        else:
            h = self._run(h, pos, segments)
        return h, pos, segments


# --- embedding and output ---------------------------------------------------------------------


class WordEmbedding(nn.Module):
    """Vocab-parallel word embedding (first layer). Tied models (GLM-10B) also project the
    output with it: `logits` (the pipeline's last stage holds a copy, DeepSpeed TiedLayerSpec)."""

    def __init__(self, spec: ModelSpec, tp: TPGroup = SINGLE, seed: int = 0) -> None:
        super().__init__()
        self.tp = tp
        self.word_embeddings = VocabParallelEmbedding(spec.vocab, spec.padded_vocab(tp.size), spec.hidden, tp,
                                                      "embedding.word_embeddings", seed,
                                                      scatter=spec.position != "learned")
        self.poison = False
        """Set by the stability test (--inject-nan): makes this micro-batch's activations NaN."""

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]):
        ids, pos, segments = inputs
        h = self.word_embeddings(ids)
        if self.poison:
            h = h * float("nan")
        return h, pos, segments

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return parallel_input_linear(h, self.word_embeddings.weight, None, self.tp)


class PositionEmbedding(nn.Module):
    """Learned absolute positions (GLM-10B), replicated on every TP rank, added on the whole
    sequence; under SP the sum is then split into sequence shards (Megatron-LM's order), so the
    position table's gradient is whole on every TP rank and needs no TP all-reduce."""

    def __init__(self, spec: ModelSpec, tp: TPGroup = SINGLE, seed: int = 0) -> None:
        super().__init__()
        self.tp = tp
        name = "embedding.position_embeddings.weight"
        self.weight = nn.Parameter(seeded_normal(name, (spec.max_seq, spec.hidden), INIT_STD, seed,
                                                 [range(spec.max_seq)]))
        mark_replicated(self.weight, name)

    def forward(self, inputs):
        h, pos, segments = inputs
        h = h + F.embedding(pos, self.weight)
        return (scatter_seq(h, self.tp) if self.tp.sequence_parallel else h), pos, segments


class FinalNorm(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.final_layernorm = make_norm(spec, tp, "head.final_layernorm")

    def forward(self, inputs):
        return (self.final_layernorm(inputs[0]),) + tuple(inputs[1:])


class OutputLayer(nn.Module):
    """Vocab-parallel output layer (V_pad/T columns per rank); returns this rank's logits."""

    def __init__(self, spec: ModelSpec, tp: TPGroup = SINGLE, seed: int = 0) -> None:
        super().__init__()
        self.tp = tp
        padded, name = spec.padded_vocab(tp.size), "head.output_layer.weight"
        n = padded // tp.size
        self.weight = nn.Parameter(seeded_normal(name, (padded, spec.hidden), INIT_STD, seed,
                                                 [range(tp.rank * n, (tp.rank + 1) * n)], real_rows=spec.vocab))
        mark_split(self.weight, 0, (padded,), name)

    def forward(self, inputs) -> torch.Tensor:
        return parallel_input_linear(inputs[0], self.weight, None, self.tp)


def tied_logits(embedding: WordEmbedding, inputs) -> torch.Tensor:
    """forward_fn of the tied embedding on the last pipeline stage (DeepSpeed TiedLayerSpec)."""
    return embedding.logits(inputs[0])


class LMLoss:
    """Mean next-token cross-entropy over real tokens (labels already shifted; IGNORE elsewhere),
    vocab-parallel and in fp32 (parallel/tensor.py)."""

    def __init__(self, vocab: int, tp: TPGroup = SINGLE) -> None:
        self.vocab, self.tp = vocab, tp

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        per_token = vocab_parallel_cross_entropy(logits, labels, self.vocab, self.tp)
        real = (labels != IGNORE).float()
        return (per_token * real).sum() / real.sum().clamp(min=1.0)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """LMLoss without tensor parallelism (logits over the whole vocabulary)."""
    return LMLoss(logits.shape[-1])(logits, labels)


def block_flags(spec: ModelSpec, stage_layers: tuple[int, ...], checkpointed: tuple[int, ...]) -> list[bool]:
    """Per block, whether it is fully checkpointed: the first k blocks of each stage."""
    flags: list[bool] = []
    for n, k in zip(stage_layers, checkpointed):
        flags += [i < k for i in range(n)]
    assert len(flags) == spec.layers, (flags, spec.layers)
    return flags


def share_blocks(blocks: list[Block], k: int) -> None:
    """ModelSpec.share_layers: blocks i with i % k > 0 use the parameters of block i - i % k (its
    norms, QKV and output projections and FFN modules), so K consecutive blocks hold one set;
    nn.Module.parameters() yields each once, so DeepSpeed keeps one set of model states. Each
    block keeps its own checkpoint flag, attention kernel and stage cache."""
    for i, blk in enumerate(blocks):
        if k > 1 and i % k:
            first = blocks[i - i % k]
            blk.input_layernorm, blk.post_attention_layernorm = first.input_layernorm, first.post_attention_layernorm
            blk.self_attention.query_key_value = first.self_attention.query_key_value
            blk.self_attention.dense = first.self_attention.dense
            blk.mlp = first.mlp


class GLMModel(nn.Module):
    """The whole layer list in one process (pp == 1): embedding -> blocks -> norm -> output."""

    def __init__(self, spec: ModelSpec, checkpoint_flags: list[bool], selective: bool, *, tp: TPGroup = SINGLE,
                 attention: str = "flash", seed: int = 0) -> None:
        super().__init__()
        cache = StageCache(spec, tp)
        self.embedding = WordEmbedding(spec, tp, seed)
        self.position = PositionEmbedding(spec, tp, seed) if spec.position == "learned" else None
        self.layers = nn.ModuleList(Block(spec, i, c, selective, tp=tp, attention=attention, cache=cache, seed=seed)
                                    for i, c in enumerate(checkpoint_flags))
        share_blocks(list(self.layers), spec.share_layers)
        self.final = FinalNorm(spec, tp)
        self.output = None if spec.tied_embeddings else OutputLayer(spec, tp, seed)
        self.loss_fn = LMLoss(spec.vocab, tp)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        x = self.embedding((ids, pos, segments))
        if self.position is not None:
            x = self.position(x)
        for layer in self.layers:
            x = layer(x)
        x = self.final(x)
        return self.output(x) if self.output is not None else tied_logits(self.embedding, x)
