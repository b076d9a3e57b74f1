"""Megatron-style tensor parallelism (Shoeybi et al. 2019, sec. 3; sequence parallelism:
Korthikanti et al. 2022, sec. 4.2.2), written for this executor.

Per TP rank t of T (the runtime contract, README "Running and verifying a plan"):
- ColumnParallelLinear splits the output dimension. A fused matrix made of sub-matrices
  (QKV = [q | k | v] with grouped KV heads; a GLU's [gate | up]) is split part by part, so
  rank t holds its 1/T of every part (heads/T query heads, kv/T KV groups; f/T of gate and
  of up). Bias split the same way.
- RowParallelLinear splits the input dimension; its bias is replicated and added once,
  after the all-reduce (or reduce-scatter).
- VocabParallelEmbedding holds V_pad/T rows (V_pad = ModelSpec.padded_vocab(T)); the output
  layer uses V_pad/T columns and vocab_parallel_cross_entropy (fp32) never gathers the logits
  and leaves the padded columns out of the softmax.
- Collectives: `copy_to_tp` (identity, all-reduce in backward) in front of a column-parallel
  layer; `reduce_from_tp` (all-reduce, identity in backward) after a row-parallel one. With
  sequence parallelism they become all-gather / reduce-scatter along the sequence (dim 1 of
  b x s x h), and the column-parallel linear saves only its sequence shard, gathering it again
  in backward (Megatron's LinearWithGradAccumulationAndAsyncCommunication).

Initialisation is layout-independent: every weight is drawn as if unsplit, from a generator
seeded by (run seed, parameter name, block of rows), and each rank keeps its slice, so every
TP degree starts from exactly the single-process model.
"""
from __future__ import annotations

import contextlib
import hashlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from planner.model.parallel.groups import SINGLE, TPGroup

# --- collectives as autograd functions ------------------------------------------------------


def _all_reduce(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    dist.all_reduce(x, group=tp.group)
    return x


def _gather_seq(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """All-gather sequence shards: b x s/T x h -> b x s x h."""
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x.contiguous(), group=tp.group)
    return torch.cat(parts, dim=1)


def _reduce_scatter_seq(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Sum over the TP group and keep this rank's sequence shard: b x s x h -> b x s/T x h."""
    s = x.shape[1]
    if s % tp.size:
        raise ValueError(f"sequence parallelism needs the sequence length ({s}) divisible by TP ({tp.size})")
    chunks = [c.contiguous() for c in x.chunk(tp.size, dim=1)]
    out = torch.empty_like(chunks[0])
    dist.reduce_scatter(out, chunks, group=tp.group)
    return out


def seq_shard(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """This rank's sequence shard of a replicated b x s (x ...) tensor (no communication)."""
    n = x.shape[1] // tp.size
    return x[:, tp.rank * n:(tp.rank + 1) * n]


class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient backward (Megatron's f)."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.contiguous(), ctx.tp), None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward, identity backward (Megatron's g)."""

    @staticmethod
    def forward(ctx, x, tp):
        return _all_reduce(x.clone(memory_format=torch.contiguous_format), tp)  # out of place: x may be a view

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSeq(torch.autograd.Function):
    """All-gather along the sequence forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _gather_seq(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.tp), None


class _ReduceScatterSeq(torch.autograd.Function):
    """Reduce-scatter along the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _reduce_scatter_seq(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.tp), None


class _ScatterSeq(torch.autograd.Function):
    """Keep this rank's sequence shard forward (no communication), all-gather backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return seq_shard(x, tp).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.tp), None


def scatter_seq(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x if tp.group is None else _ScatterSeq.apply(x, tp)


def copy_to_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x if tp.group is None else _CopyToTP.apply(x, tp)


def reduce_from_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x if tp.group is None else _ReduceFromTP.apply(x, tp)


def gather_seq(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x if tp.group is None else _GatherSeq.apply(x, tp)


def reduce_scatter_seq(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x if tp.group is None else _ReduceScatterSeq.apply(x, tp)


def replicated(p: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """A replicated parameter used on a sequence shard: its gradient is partial on each TP rank,
    so it is all-reduced over TP in backward (Megatron all-reduces these "sequence_parallel"
    gradients once per step; here once per micro-batch, inside autograd, so that DeepSpeed's
    gradient hooks see the full gradient)."""
    return copy_to_tp(p, tp) if tp.sequence_parallel else p


class _SeqParallelLinear(torch.autograd.Function):
    """y = all_gather_seq(x) W^T + b, saving only the sequence shard x (gathered again in backward)."""

    @staticmethod
    def forward(ctx, x, weight, bias, tp):
        ctx.tp, ctx.has_bias = tp, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(_gather_seq(x, tp), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        full = _gather_seq(x, ctx.tp)
        grad_in = _reduce_scatter_seq(grad.matmul(weight), ctx.tp)
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_w = g2.t().matmul(full.reshape(-1, full.shape[-1]))
        grad_b = g2.sum(0) if ctx.has_bias else None
        return grad_in, grad_w, grad_b, None


def parallel_input_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          tp: TPGroup) -> torch.Tensor:
    """The column-parallel product: the input enters the TP region (copy, or gather under SP)."""
    if tp.group is not None and tp.sequence_parallel:
        return _SeqParallelLinear.apply(x, weight, bias, tp)
    return F.linear(copy_to_tp(x, tp), weight, bias)


# --- seeded, layout-independent initialisation ------------------------------------------------

INIT_STD = 0.02
"""Megatron-LM init_method_std (Shoeybi et al. 2019): normal(0, 0.02) for every weight matrix;
the output projections of residual branches use 0.02 / sqrt(2 L) (scaled_init_method_normal)."""
_INIT_BLOCK = 256
"""Rows drawn per generator: a rank draws only the blocks that overlap its slice."""


def _seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % (2 ** 63)


def seeded_normal(name: str, shape: tuple[int, int], std: float, seed: int, rows: list[range],
                  cols: range | None = None, real_rows: int | None = None) -> torch.Tensor:
    """Rows `rows` (and columns `cols`) of an unsplit normal(0, std) matrix of `shape`, identical
    for every split. Rows at or beyond `real_rows` (a padded vocabulary) are zero."""
    n_rows, n_cols = shape
    real = n_rows if real_rows is None else real_rows
    cols = cols if cols is not None else range(n_cols)
    pieces = []
    for rng in rows:
        for b in range(rng.start // _INIT_BLOCK, -(-rng.stop // _INIT_BLOCK)):
            lo, hi = b * _INIT_BLOCK, min((b + 1) * _INIT_BLOCK, n_rows)
            take_lo, take_hi = max(lo, rng.start), min(hi, rng.stop)
            if take_lo >= take_hi:
                continue
            g = torch.Generator().manual_seed(_seed(seed, name, b))
            block = torch.randn(hi - lo, n_cols, generator=g) * std
            block[max(real, lo) - lo:] = 0.0
            pieces.append(block[take_lo - lo:take_hi - lo, cols.start:cols.stop])
    return torch.cat(pieces, dim=0)


def mark_split(p: nn.Parameter, dim: int, parts: tuple[int, ...], canonical: str) -> None:
    """Record how `p` is split across TP (its full size along `dim` is sum(parts), each part
    split in T equal slices) and its layout-independent name."""
    p.tp_split = (dim, tuple(parts))
    p.canonical = canonical


def mark_replicated(p: nn.Parameter, canonical: str) -> None:
    p.tp_split = None
    p.canonical = canonical


# --- layers -----------------------------------------------------------------------------------


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b, A's output rows split part by part (see the module docstring)."""

    def __init__(self, in_features: int, parts: tuple[int, ...], bias: bool, tp: TPGroup, name: str,
                 seed: int, std: float = INIT_STD) -> None:
        super().__init__()
        for p in parts:
            if p % tp.size:
                raise ValueError(f"{name}: output part of {p} rows does not split over TP {tp.size}")
        self.tp, self.parts = tp, tuple(parts)
        local = [p // tp.size for p in parts]
        starts = [sum(parts[:i]) + tp.rank * n for i, n in enumerate(local)]
        rows = [range(s, s + n) for s, n in zip(starts, local)]
        self.weight = nn.Parameter(seeded_normal(f"{name}.weight", (sum(parts), in_features), std, seed, rows))
        mark_split(self.weight, 0, self.parts, f"{name}.weight")
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(sum(local)))
            mark_split(self.bias, 0, self.parts, f"{name}.bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return parallel_input_linear(x, self.weight, self.bias, self.tp)


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A's input columns split; the partial sums are all-reduced (or
    reduce-scattered along the sequence) and the replicated bias is added once, after."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup, name: str,
                 seed: int, std: float = INIT_STD) -> None:
        super().__init__()
        if in_features % tp.size:
            raise ValueError(f"{name}: {in_features} input columns do not split over TP {tp.size}")
        self.tp = tp
        n = in_features // tp.size
        self.weight = nn.Parameter(seeded_normal(f"{name}.weight", (out_features, in_features), std, seed,
                                                 [range(out_features)], cols=range(tp.rank * n, (tp.rank + 1) * n)))
        mark_split(self.weight, 1, (in_features,), f"{name}.weight")
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features))
            mark_replicated(self.bias, f"{name}.bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        y = reduce_scatter_seq(y, self.tp) if self.tp.sequence_parallel else reduce_from_tp(y, self.tp)
        return y if self.bias is None else y + replicated(self.bias, self.tp)


class VocabParallelEmbedding(nn.Module):
    """Rows [t V_pad/T, (t+1) V_pad/T) of the padded word embedding; a token outside this
    rank's rows contributes zeros, and the all-reduce (reduce-scatter under SP) sums the ranks."""

    def __init__(self, vocab: int, padded: int, hidden: int, tp: TPGroup, name: str, seed: int,
                 scatter: bool = True) -> None:
        super().__init__()
        self.scatter = scatter and tp.sequence_parallel
        """Under SP, reduce-scatter to sequence shards (else the sum stays whole: learned positions are
        added on the whole sequence first, as Megatron-LM does)."""
        if padded % tp.size or padded < vocab:
            raise ValueError(f"padded vocabulary {padded} must be >= {vocab} and divisible by TP {tp.size}")
        self.tp, self.vocab, self.padded = tp, vocab, padded
        n = padded // tp.size
        self.start, self.stop = tp.rank * n, (tp.rank + 1) * n
        self.weight = nn.Parameter(seeded_normal(f"{name}.weight", (padded, hidden), INIT_STD, seed,
                                                 [range(self.start, self.stop)], real_rows=vocab))
        mark_split(self.weight, 0, (padded,), f"{name}.weight")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.start) | (ids >= self.stop)
        out = F.embedding((ids - self.start).masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[..., None], 0.0)
        return reduce_scatter_seq(out, self.tp) if self.scatter else reduce_from_tp(out, self.tp)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's _VocabParallelCrossEntropy in fp32, with the padded columns left out of the
    softmax: three all-reduces of b x s fp32 (max, target logit, sum of exponentials)."""

    @staticmethod
    def forward(ctx, logits, target, start, real_stop, tp):
        x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 (fp64 stays fp64)
        x = x.clone() if x is logits else x
        if real_stop - start < x.shape[-1]:
            x[..., max(real_stop - start, 0):] = float("-inf")
        m = x.max(dim=-1).values
        if tp.group is not None:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp.group)
        x.sub_(m[..., None])
        outside = (target < start) | (target >= real_stop)
        local = (target - start).masked_fill(outside, 0)
        picked = x.gather(-1, local[..., None]).squeeze(-1).masked_fill(outside, 0.0)
        x.exp_()
        total = x.sum(dim=-1)
        if tp.group is not None:
            dist.all_reduce(picked, group=tp.group)
            dist.all_reduce(total, group=tp.group)
        loss = torch.log(total) - picked
        x.div_(total[..., None])  # the softmax, kept for backward
        ctx.save_for_backward(x, outside, local)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, outside, local = ctx.saved_tensors
        g = softmax  # freed after this backward: modify in place (Megatron does the same)
        g.scatter_add_(-1, local[..., None], -(~outside).to(g.dtype)[..., None])
        g.mul_(grad[..., None])
        return g.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab: int,
                                 tp: TPGroup = SINGLE) -> torch.Tensor:
    """Per-token cross-entropy (fp32, b x s) of vocab-parallel logits b x s x V_pad/T; targets
    index the real vocabulary (an out-of-range target, e.g. IGNORE, gives a finite dummy loss)."""
    n = logits.shape[-1]
    start = tp.rank * n
    return _VocabParallelCrossEntropy.apply(logits, target, start, min(start + n, vocab), tp)


# --- dropout RNG in the TP region -----------------------------------------------------------

RNG_NAME = "model-parallel-rng"
"""DeepSpeed's (Megatron's) tracker name: its activation checkpointing restores this state on
recompute (deepspeed/runtime/activation_checkpointing/checkpointing.py)."""


def tp_rng():
    """Context for randomness that must differ between TP ranks (dropout on head slices or on
    sequence shards); replicated activations use the default generator, identical on the TP ranks."""
    from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker
    tracker = get_cuda_rng_tracker()
    return tracker.fork(RNG_NAME) if RNG_NAME in tracker.get_states() else contextlib.nullcontext()


def seed_dropout(seed: int, pp_rank: int, tp_rank: int) -> None:
    """Megatron's seeding (megatron/training/initialize.py _set_random_seed and
    model_parallel_cuda_manual_seed): default generator seed + 100 pp; the TP-region
    generator additionally + 2718 + tp. DP ranks share seeds."""
    from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker
    base = seed + 100 * pp_rank
    torch.manual_seed(base)
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    tracker.add(RNG_NAME, base + 2718 + tp_rank)


def scaled_std(layers: int) -> float:
    return INIT_STD / math.sqrt(2 * layers)
