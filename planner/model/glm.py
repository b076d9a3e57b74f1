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

Every linear is a Megatron-style tensor-parallel layer (planner/model/parallel/tensor.py);
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

from planner.data.batching import IGNORE
from planner.model.attention import ATTENTION, StageCache, _LinearAttention, dropout, eager_attention, rotary
from planner.model.kvcache import KVStep
from planner.model.moe import MoEFFN
from planner.model.norms import HeadRMSNorm, make_norm
from planner.model.parallel.groups import SINGLE, TPGroup
from planner.model.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                           mark_replicated, mark_split, parallel_input_linear, reduce_from_tp,
                                           scaled_std, scatter_seq, seeded_normal, seq_shard, tp_rng, vocab_parallel_cross_entropy,
                                           INIT_STD)
from planner.specs.model import ModelSpec


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



def _checkpoint(fn, *args):
    import deepspeed
    return deepspeed.checkpointing.checkpoint(fn, *args)



# --- the transformer block ----------------------------------------------------------------------


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
            return _checkpoint(self.core, q, k, v, pos, segments)
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
            h = _checkpoint(self._run, h, pos, segments)
        else:
            h = self._run(h, pos, segments, kv)
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
    position table's gradient is whole on every TP rank and needs no TP all-reduce. Under
    context parallelism the hidden states are this cp rank's s/cp tokens: their positions."""

    def __init__(self, spec: ModelSpec, tp: TPGroup = SINGLE, seed: int = 0, cp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.tp, self.cp = tp, cp
        name = "embedding.position_embeddings.weight"
        self.weight = nn.Parameter(seeded_normal(name, (spec.max_seq, spec.hidden), INIT_STD, seed,
                                                 [range(spec.max_seq)]))
        mark_replicated(self.weight, name)

    def forward(self, inputs):
        h, pos, segments = inputs
        h = h + F.embedding(seq_shard(pos, self.cp) if self.cp.size > 1 else pos, self.weight)
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
    vocab-parallel and in fp32 (parallel/tensor.py).

    Context parallelism (`cp`): the logits are this rank's s/cp tokens and `labels` the whole
    sequence's; the sum over the rank's real tokens is summed over the cp group (all-reduce
    forward, identity backward) and divided by the whole sequence's real tokens, so every cp
    rank holds the micro-batch's loss and its gradient is this rank's share of it: DeepSpeed sums
    the gradients over dp x cp ranks and divides by dp (engine._reduce_non_expert_gradients,
    zero/stage_1_and_2.py average_tensor: world / sequence_parallel_size)."""

    def __init__(self, vocab: int, tp: TPGroup = SINGLE, cp: TPGroup = SINGLE) -> None:
        self.vocab, self.tp, self.cp = vocab, tp, cp

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.cp.size == 1:
            per_token = vocab_parallel_cross_entropy(logits, labels, self.vocab, self.tp)
            real = (labels != IGNORE).float()
            return (per_token * real).sum() / real.sum().clamp(min=1.0)
        total = (labels != IGNORE).float().sum()
        labels = seq_shard(labels, self.cp)
        per_token = vocab_parallel_cross_entropy(logits, labels, self.vocab, self.tp)
        real = (labels != IGNORE).float()
        return reduce_from_tp((per_token * real).sum(), self.cp) / total.clamp(min=1.0)


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


def head_group(tp: TPGroup, cp: TPGroup) -> TPGroup:
    """Whose heads a rank's attention core runs: TP rank t's heads, and under Ulysses the cp
    rank's consecutive share of them, i.e. slice t cp + c of tp x cp (ALiBi's slopes)."""
    if cp.size == 1:
        return tp
    return TPGroup(rank=tp.rank * cp.size + cp.rank, size=tp.size * cp.size)


class GLMModel(nn.Module):
    """The whole layer list in one process (pp == 1): embedding -> blocks -> norm -> output.
    Context parallelism (`cp`): every cp rank gets the whole micro-batch, embeds its s/cp tokens
    and keeps the whole positions and document ids for the attention core (planner/model/
    attention.py StageCache builds the whole mask); the loss takes the whole labels."""

    def __init__(self, spec: ModelSpec, checkpoint_flags: list[bool], selective: bool, *, tp: TPGroup = SINGLE,
                 attention: str = "flash", seed: int = 0, cp: TPGroup = SINGLE, ep: TPGroup = SINGLE) -> None:
        super().__init__()
        self.cp = cp
        cache = StageCache(spec, head_group(tp, cp))
        self.embedding = WordEmbedding(spec, tp, seed)
        self.position = PositionEmbedding(spec, tp, seed, cp) if spec.position == "learned" else None
        self.layers = nn.ModuleList(Block(spec, i, c, selective, tp=tp, attention=attention, cache=cache, seed=seed,
                                          cp=cp, ep=ep)
                                    for i, c in enumerate(checkpoint_flags))
        share_blocks(list(self.layers), spec.share_layers)
        self.final = FinalNorm(spec, tp)
        self.output = None if spec.tied_embeddings else OutputLayer(spec, tp, seed)
        self.loss_fn = LMLoss(spec.vocab, tp, cp)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, segments: torch.Tensor,
                kv: KVStep | None = None) -> torch.Tensor:
        """This rank's vocab-parallel logits [b, s, V_pad/T]. With `kv` (generation: ids are the
        next tokens of kv's slots at positions kv.pos) only the last new token's, [b, 1, V_pad/T]."""
        if self.cp.size > 1 and kv is None:
            x = self.embedding((seq_shard(ids, self.cp), pos, segments))
        else:
            x = self.embedding((ids, pos, segments))
        if self.position is not None:
            x = self.position(x)
        for layer in self.layers:
            x = layer(x, kv)
        if kv is not None:
            x = (x[0][:, -1:],) + tuple(x[1:])
        x = self.final(x)
        return self.output(x) if self.output is not None else tied_logits(self.embedding, x)
