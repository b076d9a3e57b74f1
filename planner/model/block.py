"""One transformer block of the executor's model (planner/model/glm.py): self-attention
(fused QKV projection, rotary, the attention core of planner/model/attention.py, DeepSpeed-Ulysses
context parallelism, the output projection), the dense FFN (a MoE block's: planner/model/moe.py),
the norms' wiring (pre-LN, post-LN, DeepNorm) with hidden dropout, and K consecutive blocks
sharing one set of parameters (ModelSpec.share_layers)."""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from planner.model import recompute
from planner.model.attention import ATTENTION, StageCache, _LinearAttention, dropout, eager_attention, rotary
from planner.model.kvcache import KVStep
from planner.model.moe import MoEFFN
from planner.model.norms import HeadRMSNorm, make_norm
from planner.model.parallel.groups import SINGLE, TPGroup
from planner.model.parallel.tensor import ColumnParallelLinear, RowParallelLinear, scaled_std, tp_rng
from planner.specs.model import ModelSpec


class SelfAttention(nn.Module):
    """Projections, rotary, the attention core and the output projection. With context
    parallelism (`cp`, DeepSpeed-Ulysses: Jacobs et al. 2023, arXiv 2309.14509) the block holds
    s/cp tokens; DeepSpeed's DistributedAttention all-to-alls q, k and v to the whole sequence
    and heads/(tp cp) of this TP rank's heads (the cp rank's consecutive share), runs the core,
    and all-to-alls the output back to s/cp tokens and this TP rank's heads."""

    def __init__(self, spec: ModelSpec, layer: int, tp: TPGroup, attention: str, cache: StageCache,
                 seed: int, cp: TPGroup = SINGLE) -> None:
        super().__init__()
        if spec.heads % (tp.size * cp.size) or spec.kv_heads % (tp.size * cp.size):
            raise ValueError(f"TP {tp.size} x CP {cp.size} must divide the heads ({spec.heads}) and KV groups "
                             f"({spec.kv_heads})")
        if attention not in ATTENTION:
            raise ValueError(f"unknown attention kernel {attention!r}")
        self.spec, self.tp, self.attention, self.cache, self.layer = spec, tp, attention, cache, layer
        self.ulysses = None
        if cp.size > 1:
            from deepspeed.sequence.layer import DistributedAttention
            self.ulysses = DistributedAttention(self._local_attention, cp.group, scatter_idx=2, gather_idx=1)
        name = f"layers.{layer}.self_attention"
        self.query_key_value = ColumnParallelLinear(spec.hidden, (spec.q_size, spec.kv_size, spec.kv_size),
                                                    spec.qkv_bias, tp, f"{name}.query_key_value", seed)
        self.dense = RowParallelLinear(spec.q_size, spec.hidden, spec.linear_bias, tp, f"{name}.dense", seed,
                                       std=scaled_std(spec.layers))
        self.q_norm = self.k_norm = None
        if spec.qk_norm:  # GLM-4.5: RMSNorm of each head's query and key before rotary (norms.py)
            self.q_norm = HeadRMSNorm(spec.dim_per_head, tp, f"{name}.q_norm", eps=spec.norm_eps)
            self.k_norm = HeadRMSNorm(spec.dim_per_head, tp, f"{name}.k_norm", eps=spec.norm_eps)
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

    def forward(self, x: torch.Tensor, pos: torch.Tensor, segments: torch.Tensor,
                kv: KVStep | None = None) -> torch.Tensor:
        spec = self.spec
        qkv = self.query_key_value(x)  # b s (q + 2 kv)/t, full sequence
        t = (spec.q_size + 2 * spec.kv_size) // qkv.shape[-1]  # this rank's share of the heads: 1/TP
        q, k, v = qkv.split([spec.q_size // t, spec.kv_size // t, spec.kv_size // t], dim=-1)
        b, s = qkv.shape[:2]
        d = spec.dim_per_head
        q, k, v = q.reshape(b, s, -1, d), k.reshape(b, s, -1, d), v.reshape(b, s, -1, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if kv is not None:  # generation: the new tokens over the KV cache (kvcache.py)
            if kv.angles is not None:
                il = spec.rope_interleaved
                q, k = rotary(q, *kv.angles, il), rotary(k, *kv.angles, il)
            return self.dense(kv.attend(self.layer, q, k, v).flatten(2))
        if self.ulysses is not None:  # b s/cp n/t d -> core on b s n/(t cp) d -> b s/cp n/t d
            return self.dense(self.ulysses(q, k, v, 0, None, pos, segments).flatten(2))
        return self.dense(self._core(q, k, v, pos, segments))

    def _core(self, q, k, v, pos, segments) -> torch.Tensor:
        if self.checkpoint_core and self.training:
            return recompute.checkpoint(self.core, q, k, v, pos, segments)
        return self.core(q, k, v, pos, segments)

    def _local_attention(self, q, k, v, pos, segments) -> torch.Tensor:
        """DistributedAttention's local attention: the core on the whole sequence (pos and
        segments are whole: StageCache builds the whole mask), b s heads d."""
        return self._core(q, k, v, pos, segments).unflatten(2, (q.shape[2], q.shape[3]))


class MLP(nn.Module):
    """The dense FFN (or, `ffn` and `name` given, a MoE block's shared experts: planner/model/moe.py)."""

    def __init__(self, spec: ModelSpec, layer: int, tp: TPGroup, seed: int, ffn: int | None = None,
                 name: str = "") -> None:
        super().__init__()
        # ffn_size: ffn_hidden, or fewer columns for a pruned FFN (ModelSpec.ffn_sparsity)
        ffn = spec.ffn_size if ffn is None else ffn
        if ffn % tp.size:
            raise ValueError(f"TP {tp.size} must divide the FFN size {ffn}")
        self.spec = spec
        name = f"layers.{layer}.mlp" + (f".{name}" if name else "")
        self.dense_h_to_4h = ColumnParallelLinear(spec.hidden, (ffn,) * spec.ffn_in_matrices,
                                                  spec.linear_bias, tp, f"{name}.dense_h_to_4h", seed)
        self.dense_4h_to_h = RowParallelLinear(ffn, spec.hidden, spec.linear_bias, tp,
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
                 seed: int = 0, cp: TPGroup = SINGLE, ep: TPGroup = SINGLE) -> None:
        super().__init__()
        self.spec, self.tp, self.layer = spec, tp, layer
        cache = cache if cache is not None else StageCache(spec, head_group(tp, cp))
        self.input_layernorm = make_norm(spec, tp, f"layers.{layer}.input_layernorm")
        self.self_attention = SelfAttention(spec, layer, tp, attention, cache, seed, cp)
        self.self_attention.checkpoint_core = selective and not checkpoint
        self.post_attention_layernorm = make_norm(spec, tp, f"layers.{layer}.post_attention_layernorm")
        if spec.moe is not None and layer >= spec.moe.first_dense:  # planner/model/moe.py
            m = spec.moe
            shared = MLP(spec, layer, tp, seed, ffn=m.shared_experts * m.shared_size, name="shared_experts") \
                if m.shared_experts else None
            self.mlp = MoEFFN(spec, layer, tp, ep, seed, shared)
        else:
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

    def _run(self, h: torch.Tensor, pos: torch.Tensor, segments: torch.Tensor,
             kv: KVStep | None = None) -> torch.Tensor:
        attn = lambda x: self._dropout(self.self_attention(x, pos, segments, kv))  # noqa: E731
        mlp = lambda x: self._dropout(self.mlp(x))  # noqa: E731
        if self.spec.norm_position == "pre":
            h = h + attn(self.input_layernorm(h))
            return h + mlp(self.post_attention_layernorm(h))
        # post-LN / DeepNorm (GLM-130B): norm after the residual sum
        h = self.input_layernorm(h * self.alpha + attn(h))
        return self.post_attention_layernorm(h * self.alpha + mlp(h))

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], kv: KVStep | None = None):
        """inputs: (hidden, position_ids, segment_ids). kv: a generation step over the KV cache."""
        h, pos, segments = inputs
        if self.checkpoint and self.training and kv is None:
            h = recompute.checkpoint(self._run, h, pos, segments)
        else:
            h = self._run(h, pos, segments, kv)
        return h, pos, segments


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


def head_group(tp: TPGroup, cp: TPGroup) -> TPGroup:
    """Whose heads a rank's attention core runs: TP rank t's heads, and under Ulysses the cp
    rank's consecutive share of them, i.e. slice t cp + c of tp x cp (ALiBi's slopes)."""
    if cp.size == 1:
        return tp
    return TPGroup(rank=tp.rank * cp.size + cp.rank, size=tp.size * cp.size)
