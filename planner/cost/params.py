"""Exact parameter counts per device: tensor by tensor, as the executor's TP layers split them.

Megatron-style tensor parallelism (Shoeybi et al. 2019, arXiv 1909.08053, sec. 3; the
runtime contract in README "The cost model"), per TP rank of t:
- QKV projection column-parallel, split by heads and KV groups: h x (q + 2 kv)/t, bias
  (q + 2 kv)/t;
- FFN input column-parallel (a GLU's gate and up split together): h x k f/t, bias k f/t;
- attention output and FFN output row-parallel: weight split on the input dim, bias whole
  (replicated, added once after the all-reduce);
- norms replicated;
- word embedding vocab-parallel over the padded vocabulary V_pad = ModelSpec.padded_vocab(t):
  V_pad/t x h; a learned position embedding replicated (first stage only);
- output layer vocab-parallel: V_pad/t x h; a tied model's output uses the embedding's
  shard, and under PP its last stage holds its own copy (DeepSpeed TiedLayerSpec).

Counts are integers so that "within 1%" against the executor's tensor-by-tensor measurement
means something. Plans whose degrees do not divide the shapes are illegal (plan_problems);
their counts here round down.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate

from planner.specs.model import ModelSpec
from planner.specs.plan import Plan

PERSISTENCE_PER_HIDDEN = 10
"""ZeRO-3 keeps parameters of at most this many x hidden elements gathered on every rank
(planner/dsconfig.py _zero_block: stage3_param_persistence_threshold = 10 x hidden, HF
Trainer's "auto" rule; DeepSpeed runtime/zero/parameter_offload.py mark_persistent_parameters:
ds_numel <= threshold)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Tensors:
    """Element counts of the parameter tensors one device holds for one part of the model."""

    numels: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.numels)

    def small(self, threshold: int) -> int:
        """Elements in tensors of at most `threshold` elements (ZeRO-3's persistent parameters)."""
        return sum(n for n in self.numels if n <= threshold)


def _norm(model: ModelSpec) -> tuple[int, ...]:
    return (model.hidden, model.hidden) if model.norm == "layernorm" else (model.hidden,)


@lru_cache(maxsize=4096)
def block_tensors(model: ModelSpec, t: int) -> Tensors:
    """One transformer block on one TP rank."""
    h, q, kv, f, k = model.hidden, model.q_size, model.kv_size, model.ffn_size, model.ffn_in_matrices
    out = list(_norm(model))                                    # input norm (replicated)
    out.append(h * (q + 2 * kv) // t)                           # QKV weight (column)
    if model.qkv_bias:
        out.append((q + 2 * kv) // t)                           # QKV bias (split with it)
    if model.qk_norm:
        out += [model.dim_per_head] * 2                         # QK-norm weights (replicated)
    out.append(q * h // t)                                      # attention output weight (row)
    if model.linear_bias:
        out.append(h)                                           # its bias (replicated)
    out += list(_norm(model))                                   # post-attention norm
    out.append(h * k * f // t)                                  # FFN input weight(s) (column)
    if model.linear_bias:
        out.append(k * f // t)                                  # their bias (split)
    out.append(f * h // t)                                      # FFN output weight (row)
    if model.linear_bias:
        out.append(h)                                           # its bias (replicated)
    return Tensors(numels=tuple(out))


@lru_cache(maxsize=4096)
def expert_tensors(model: ModelSpec, ep: int) -> Tensors:
    """The routed experts of one MoE block on one rank: experts / ep whole experts (not split
    by TP), each its FFN input weight(s) k f x h and its output weight h x f."""
    h, k, f = model.hidden, model.ffn_in_matrices, model.moe.expert_ffn
    return Tensors(numels=(k * f * h, h * f) * (model.moe.experts // ep))


def moe_block_tensors(model: ModelSpec, t: int) -> Tensors:
    """The replicated part of one MoE block on one TP rank (its routed experts are counted
    apart, planner.cost.moe.expert_params): the block's attention and norms as in
    block_tensors, the router h x E (whole on every TP rank, as DeepSpeed's gate), and each
    shared expert split by TP like the dense FFN."""
    h, k, m = model.hidden, model.ffn_in_matrices, model.moe
    dense = block_tensors(model, t).numels
    attn = dense[:len(dense) - (4 if model.linear_bias else 2)]  # everything before the FFN
    out = list(attn) + [h * m.experts]
    for _ in range(m.shared_experts):
        out += [h * k * m.shared_size // t, m.shared_size * h // t]
        if model.linear_bias:
            out += [k * m.shared_size // t, h]
    return Tensors(numels=tuple(out))


@lru_cache(maxsize=4096)
def first_stage_tensors(model: ModelSpec, t: int) -> Tensors:
    """Word embedding (V_pad/t rows) and a learned position embedding (replicated)."""
    out = [model.padded_vocab(t) * model.hidden // t]
    if model.position == "learned":
        out.append(model.max_seq * model.hidden)
    return Tensors(numels=tuple(out))


@lru_cache(maxsize=4096)
def last_stage_tensors(model: ModelSpec, t: int, pp: int) -> Tensors:
    """Final norm and the output layer (V_pad/t columns); a tied model's output layer is the
    embedding's shard, held again on the last stage only under PP."""
    out = list(_norm(model))
    if not model.tied_embeddings or pp > 1:
        out.append(model.padded_vocab(t) * model.hidden // t)
    return Tensors(numels=tuple(out))


def stage_tensors(model: ModelSpec, t: int, pp: int, stage: int, blocks: int) -> Tensors:
    """Every parameter tensor one device of `stage` holds when it has `blocks` blocks (with
    share_layers K, blocks / K sets: K consecutive blocks use one; PP is refused with sharing,
    planner.specs.validate)."""
    out = block_tensors(model, t).numels * -(-blocks // model.share_layers)
    if stage == 0:
        out = first_stage_tensors(model, t).numels + out
    if stage == pp - 1:
        out = out + last_stage_tensors(model, t, pp).numels
    return Tensors(numels=out)


def stage_params(model: ModelSpec, plan: Plan) -> tuple[int, ...]:
    """Parameters held by one device of each pipeline stage (integers). The one count the
    memory, optimizer-time and data-parallel traffic terms all use."""
    t, p = plan.tp, plan.pp
    return tuple(stage_tensors(model, t, p, i, n).total for i, n in enumerate(plan.layers_per_stage(model.layers)))


def persistence_threshold(model: ModelSpec) -> int:
    return PERSISTENCE_PER_HIDDEN * model.hidden


ZERO_ALIGNMENT = 2
"""DeepSpeed 0.19.8 runtime/zero/stage_1_and_2.py: nccl_start_alignment_factor = 2; the
flattened group is padded to a multiple of 2 x dp elements before it is partitioned."""


@lru_cache(maxsize=65536)
def zero1_owned(numels: tuple[int, ...], dp: int) -> tuple[int, ...]:
    """Per DP rank, the gradient elements ZeRO-1 keeps alive for the partition the rank owns.

    DeepSpeed 0.19.8 (runtime/zero/stage_1_and_2.py) flattens the parameters in module order,
    pads the flat group to a multiple of 2 x dp and gives rank r the slice [r P, (r + 1) P),
    P = padded / dp. At the end of backward (independent_gradient_partition_epilogue)
    `all_grad_tensors` takes the *whole* p.grad of every parameter that overlaps the slice
    (get_all_grad_tensors -> get_param_gradient_attribute), `averaged_gradients` keeps narrow
    views of them and p.grad is cleared: the storages of those whole gradients stay alive
    until the step, so a rank holds P plus whatever its boundary tensors spill outside its
    slice; the last rank's zero padding (get_flat_partition) is a tensor of its own.
    Measured on chatglm3-6b tiny DP 4: 291,328 / 381,568 / 375,808 / 297,088 elements, the
    same as here."""
    ends = list(accumulate(numels))  # tensor i covers [ends[i] - numels[i], ends[i])
    total = ends[-1] if ends else 0
    padded = -(-total // (ZERO_ALIGNMENT * dp)) * (ZERO_ALIGNMENT * dp)
    part = padded // dp
    out = []
    for r in range(dp):
        lo, hi = r * part, (r + 1) * part
        first = bisect_right(ends, lo)                 # first tensor ending after lo
        last = bisect_left(ends, min(hi, total))       # the tensor holding element hi - 1
        owned = ends[last] - (ends[first] - numels[first]) if first < len(ends) and lo < total else 0
        out.append(owned + max(0, hi - max(lo, total)))
    return tuple(out)

