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

from dataclasses import dataclass
from functools import lru_cache

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
    h, q, kv, f, k = model.hidden, model.q_size, model.kv_size, model.ffn_hidden, model.ffn_in_matrices
    out = list(_norm(model))                                    # input norm (replicated)
    out.append(h * (q + 2 * kv) // t)                           # QKV weight (column)
    if model.qkv_bias:
        out.append((q + 2 * kv) // t)                           # QKV bias (split with it)
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
    """Every parameter tensor one device of `stage` holds when it has `blocks` blocks."""
    out = block_tensors(model, t).numels * blocks
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
