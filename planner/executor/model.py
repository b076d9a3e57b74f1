"""A GLM-family transformer in torch, built from a ModelSpec.

Faithful to the variants the presets name (ChatGLM/GLM-130B code, THUDM):
- LayerNorm or RMSNorm; pre-LN, post-LN, or DeepNorm (post-LN with residual scaled by
  alpha = (2N)^(1/2), Wang et al. 2022 "DeepNet", as in GLM-130B);
- rotary positions (Su et al. 2021; ChatGLM applies them to half of each head), learned
  absolute positions, or ALiBi biases (Press et al. 2022);
- GELU MLP or GeGLU/SwiGLU (Shazeer 2020), fused [gate | up] as ChatGLM2's dense_h_to_4h;
- multi-head or grouped/multi-query attention (kv_groups), fused [q | k | v] projection.

The model is a flat list of layers: Embedding, Block x L, Head. PipelineModule splits that
list at the plan's boundaries; the plain engine runs it as GLMModel. Linear names are
ChatGLM's, which planner.dsconfig.partition_config splits for AutoTP. Under AutoTP the
projections hold a slice of the heads: the attention infers its local head counts from the
projection's output width, so one class serves every TP degree.
Layers pass a tuple (hidden, position_ids, segment_ids) so pipeline stages can send it.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from planner.specs.model import ModelSpec

IGNORE = -100


class RMSNorm(nn.Module):
    """Zhang & Sennrich 2019; ChatGLM2/3 and GLM-4."""

    def __init__(self, hidden: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def make_norm(spec: ModelSpec) -> nn.Module:
    return RMSNorm(spec.hidden) if spec.norm == "rmsnorm" else nn.LayerNorm(spec.hidden, eps=1e-5)


def rotary(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotate the first half of each head's dims (ChatGLM's 2D-RoPE uses half the head); x: b s n d."""
    d = x.shape[-1]
    rot = d // 2 - (d // 2) % 2
    if rot == 0:
        return x
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, device=x.device, dtype=torch.float32) / rot))
    ang = pos.float()[..., None] * inv  # b s rot/2
    cos, sin = ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]
    xr, xp = x[..., :rot].float(), x[..., rot:]
    x1, x2 = xr[..., 0::2], xr[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return torch.cat((out.to(x.dtype), xp), dim=-1)


def alibi_slopes(n: int) -> torch.Tensor:
    """Press et al. 2022: geometric slopes 2^(-8i/n)."""
    return torch.tensor([2 ** (-8.0 * (i + 1) / n) for i in range(n)])


def attention_mask(segments: torch.Tensor) -> torch.Tensor:
    """Causal and within-document (packed rows): b 1 s s boolean, True = may attend."""
    s = segments.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=segments.device).tril()
    same = segments[:, :, None] == segments[:, None, :]
    return (same & causal)[:, None]


class SelfAttention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.query_key_value = nn.Linear(spec.hidden, spec.q_size + 2 * spec.kv_size, bias=spec.qkv_bias)
        self.dense = nn.Linear(spec.q_size, spec.hidden, bias=spec.linear_bias)
        self.checkpoint_core = False
        """Selective recompute: recompute softmax(QK^T)V in backward (Korthikanti et al. 2022)."""

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
             segments: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        if spec.position == "rotary":
            q, k = rotary(q, pos), rotary(k, pos)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # b n s d
        if k.shape[1] != q.shape[1]:  # grouped / multi-query attention
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        mask = attention_mask(segments)
        if spec.position == "alibi":
            heads = q.shape[1]
            tp = spec.heads // heads
            rank = _tp_rank(tp)
            slopes = alibi_slopes(spec.heads)[rank * heads:(rank + 1) * heads].to(q.device)
            dist = (pos[:, None, :] - pos[:, :, None]).float()  # b s s  (key - query)
            bias = slopes[None, :, None, None] * dist[:, None]
            mask = bias.to(q.dtype).masked_fill(~mask, float("-inf"))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).flatten(2)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        spec, d = self.spec, self.spec.dim_per_head
        qkv = self.query_key_value(x)
        tp = (spec.q_size + 2 * spec.kv_size) // qkv.shape[-1]  # AutoTP slice of the heads
        q_w, kv_w = spec.q_size // tp, spec.kv_size // tp
        q, k, v = qkv.split([q_w, kv_w, kv_w], dim=-1)
        b, s = x.shape[:2]
        q, k, v = q.reshape(b, s, -1, d), k.reshape(b, s, -1, d), v.reshape(b, s, -1, d)
        if self.checkpoint_core and self.training:
            out = _checkpoint(self.core, q, k, v, pos, segments)
        else:
            out = self.core(q, k, v, pos, segments)
        return self.dense(out)


def _tp_rank(tp: int) -> int:
    if tp == 1:
        return 0
    from deepspeed.utils import groups
    return groups.get_tensor_model_parallel_rank()


def _checkpoint(fn, *args):
    import deepspeed
    return deepspeed.checkpointing.checkpoint(fn, *args)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.dense_h_to_4h = nn.Linear(spec.hidden, spec.ffn_in_matrices * spec.ffn_hidden, bias=spec.linear_bias)
        self.dense_4h_to_h = nn.Linear(spec.ffn_hidden, spec.hidden, bias=spec.linear_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dense_h_to_4h(x)
        if self.spec.glu:
            gate, up = h.chunk(2, dim=-1)
            act = F.silu(gate) if self.spec.activation == "swiglu" else F.gelu(gate)
            h = act * up
        else:
            h = F.gelu(h)
        return self.dense_4h_to_h(h)


class Block(nn.Module):
    """One transformer layer. `checkpoint=True`: full recompute of this block in backward."""

    def __init__(self, spec: ModelSpec, checkpoint: bool = False, selective: bool = False) -> None:
        super().__init__()
        self.spec = spec
        self.input_layernorm = make_norm(spec)
        self.self_attention = SelfAttention(spec)
        self.self_attention.checkpoint_core = selective and not checkpoint
        self.post_attention_layernorm = make_norm(spec)
        self.mlp = MLP(spec)
        self.checkpoint = checkpoint
        # DeepNorm (Wang et al. 2022, Table 1, decoder-only): x * alpha + f(x), alpha = (2N)^(1/2)
        self.alpha = math.sqrt(2 * spec.layers) if spec.norm_position == "deepnorm" else 1.0

    def _run(self, h: torch.Tensor, pos: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        if self.spec.norm_position == "pre":
            h = h + self.self_attention(self.input_layernorm(h), pos, segments)
            return h + self.mlp(self.post_attention_layernorm(h))
        # post-LN / DeepNorm (GLM-130B): norm after the residual sum
        h = self.input_layernorm(h * self.alpha + self.self_attention(h, pos, segments))
        return self.post_attention_layernorm(h * self.alpha + self.mlp(h))

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]):
        h, pos, segments = inputs
        if self.checkpoint and self.training:
            h = _checkpoint(self._run, h, pos, segments)
        else:
            h = self._run(h, pos, segments)
        return h, pos, segments


class Embedding(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.spec = spec
        self.word_embeddings = nn.Embedding(spec.vocab, spec.hidden)
        self.position_embeddings = nn.Embedding(spec.max_seq, spec.hidden) if spec.position == "learned" else None
        for emb in (self.word_embeddings, self.position_embeddings):
            if emb is not None:  # Megatron-LM init_method_std 0.02 (Shoeybi et al. 2019)
                nn.init.normal_(emb.weight, std=0.02)
        self.poison = False
        """Set by the stability test (--inject-nan): makes this micro-batch's activations NaN."""

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]):
        ids, pos, segments = inputs
        h = self.word_embeddings(ids)
        if self.position_embeddings is not None:
            h = h + self.position_embeddings(pos)
        if self.poison:
            h = h * float("nan")
        return h, pos, segments


class Head(nn.Module):
    """Final norm and the output layer; returns logits. Tied models (GLM-10B) project with
    the input embedding matrix instead of an output layer of their own."""

    def __init__(self, spec: ModelSpec, tied: bool = False) -> None:
        super().__init__()
        self.final_layernorm = make_norm(spec)
        self.output_layer = None if tied else nn.Linear(spec.hidden, spec.vocab, bias=False)

    def forward(self, inputs, weight: torch.Tensor | None = None):
        h = self.final_layernorm(inputs[0])
        return self.output_layer(h) if self.output_layer is not None else F.linear(h, weight)


class FinalNorm(nn.Module):
    """The final norm as its own pipeline layer (tied models: the tied embedding projects)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.final_layernorm = make_norm(spec)

    def forward(self, inputs):
        return (self.final_layernorm(inputs[0]),) + tuple(inputs[1:])


def tied_logits(embedding: Embedding, inputs) -> torch.Tensor:
    """forward_fn of the tied embedding on the last pipeline stage (DeepSpeed TiedLayerSpec)."""
    return F.linear(inputs[0], embedding.word_embeddings.weight)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over real tokens (labels already shifted; IGNORE elsewhere)."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE)


def block_flags(spec: ModelSpec, stage_layers: tuple[int, ...], checkpointed: tuple[int, ...]) -> list[bool]:
    """Per block, whether it is fully checkpointed: the first k blocks of each stage."""
    flags: list[bool] = []
    for n, k in zip(stage_layers, checkpointed):
        flags += [i < k for i in range(n)]
    assert len(flags) == spec.layers, (flags, spec.layers)
    return flags


class GLMModel(nn.Module):
    """Embedding -> blocks -> head, for the non-pipeline engine (pp == 1)."""

    def __init__(self, spec: ModelSpec, checkpoint_flags: list[bool], selective: bool) -> None:
        super().__init__()
        self.embedding = Embedding(spec)
        self.layers = nn.ModuleList(Block(spec, c, selective) for c in checkpoint_flags)
        self.head = Head(spec, tied=spec.tied_embeddings)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        x = self.embedding((ids, pos, segments))
        for layer in self.layers:
            x = layer(x)
        return self.head(x, self.embedding.word_embeddings.weight if self.head.output_layer is None else None)
