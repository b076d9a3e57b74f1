"""The mixture-of-experts FFN of a MoE block (planner/specs/moe.py), on DeepSpeed-MoE.

DeepSpeed's `deepspeed.moe.layer.MoE` does the dispatch (GShard, Lepikhin et al. 2020, Algorithm
2: tokens into per-expert buffers of `capacity` slots), the all-to-all over the expert-parallel
group, the local experts and the combine; the DeepSpeed engine reduces the expert gradients over
the expert-data-parallel group and ZeRO partitions their states there (the parameters carry
`allreduce = False` and `group_name`). Two parts of it are the planner's own:

- the router (`Router`, installed as the MOELayer's gate): the model's routing, deterministic,
  as Hugging Face glm4_moe / deepseek_v3 (sigmoid scores, top-k on score + a per-expert bias
  `e_score_correction_bias`, weights = the chosen scores normalised to sum 1) and qwen3_moe /
  mixtral (softmax scores, weights = the top-k probabilities normalised to sum 1). DeepSpeed's
  TopKGate samples the second expert (Gumbel noise) and drops tokens at random, which no
  single-process model reproduces. Capacity: MoESpec.capacity_factor c > 0 gives every expert
  ceil(c k T / E) slots (GShard; routes past it are dropped in token order), 0 is dropless (the
  busiest expert's count, the maximum over the expert-parallel group). No auxiliary loss is
  added to the training loss (l_aux = 0): the sigmoid router balances with its bias.
- the experts (`Expert`): whole SwiGLU/GeGLU/GELU FFNs of expert_ffn columns, initialised from
  the seed of their global index (layers.L.mlp.experts.E...), so every expert-parallel size
  starts from the single-process model. Under tensor parallelism DeepSpeed hands each TP rank
  1/TP of every expert's capacity slots (drop_tokens), so an expert's gradient is partial on
  each TP rank: its weights enter the FFN through copy_to_tp (identity forward, all-reduce over
  TP backward), as replicated weights under sequence parallelism do (parallel/tensor.py).

Under Megatron sequence parallelism the FFN's input is the TP rank's sequence shard: the routed
part all-gathers it (DeepSpeed-MoE wants the TP ranks' tokens identical) and keeps its shard of
the output.

Shared experts (MoESpec.shared_experts) run on every token as one tensor-parallel FFN of
shared_experts x shared_size columns (Hugging Face glm4_moe's shared_experts MLP).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from planner.model.parallel.groups import SINGLE, TPGroup, expert_group_name
from planner.model.parallel.tensor import (INIT_STD, _gather_seq, copy_to_tp, mark_replicated, scaled_std,
                                           scatter_seq, seeded_normal, seq_shard)
from planner.specs.model import ModelSpec


def capacity(counts: torch.Tensor, tokens: int, experts: int, top_k: int, capacity_factor: float, tp: int) -> int:
    """Slots per expert: ceil(c k T / E) with a capacity factor c, else the busiest expert's
    routed tokens (`counts` already maximised over the expert-parallel group); at least 1,
    rounded up to a multiple of TP (DeepSpeed splits the slots over the TP ranks)."""
    if capacity_factor:
        c = math.ceil(capacity_factor * top_k * tokens / experts)
    else:
        c = int(counts.max())
    c = max(c, 1)
    return -(-c // tp) * tp


class Router(nn.Module):
    """The MOELayer gate: an h x E linear in fp32, top-k routing (module docstring)."""

    def __init__(self, spec: ModelSpec, layer: int, tp: TPGroup, seed: int) -> None:
        super().__init__()
        m = spec.moe
        self.spec, self.tp = spec, tp
        name = f"layers.{layer}.mlp.router.weight"
        self.weight = nn.Parameter(seeded_normal(name, (m.experts, spec.hidden), INIT_STD, seed,
                                                 [range(m.experts)]))
        mark_replicated(self.weight, name)
        # DeepSeek-V3 / GLM-4.5's balancing bias: chooses experts, never weights them; not trained by
        # gradient (a buffer, as Hugging Face's e_score_correction_bias)
        self.register_buffer("e_score_correction_bias", torch.zeros(m.experts), persistent=True)
        # buffer -> canonical name, for Hugging Face checkpoints (planner/hf: mlp.gate.e_score_correction_bias)
        self.canonical_buffers = {"e_score_correction_bias": f"layers.{layer}.mlp.router.e_score_correction_bias"}
        self.ep_group = None

    def _set_ep_group(self, group) -> None:
        self.ep_group = group

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert indices [T, k], weights [T, k] fp32) of tokens x [T, h]: the top-k weights
        normalised to sum 1, times MoESpec.routed_scale (transformers' Glm4MoeTopkRouter)."""
        m = self.spec.moe
        logits = F.linear(x.float(), self.weight.float())
        if m.router == "sigmoid":
            scores = torch.sigmoid(logits)
            idx = torch.topk(scores.detach() + self.e_score_correction_bias, m.top_k, dim=-1).indices
        else:
            scores = torch.softmax(logits, dim=-1)
            idx = torch.topk(scores.detach(), m.top_k, dim=-1).indices
        w = scores.gather(-1, idx)
        return idx, w / w.sum(-1, keepdim=True) * m.routed_scale  # GLM-4.5: routed_scaling_factor 2.5

    def forward(self, x: torch.Tensor, used_token=None, sparse_routes: bool = True, use_tutel: bool = False):
        """MOELayer's gate call: (l_aux, capacity, E, indices [k, T], locations [k, T], gates
        [k, T], counts [E]) in DeepSpeed's sparse-route form (a dropped route: index -1)."""
        import torch.distributed as dist
        m = self.spec.moe
        tokens, e = x.shape[0], m.experts
        idx, w = self.route(x)
        mask = torch.zeros(tokens, e, dtype=torch.long, device=x.device).scatter_(1, idx, 1)
        counts = mask.sum(0)
        peak = counts.max().clone()
        if self.ep_group is not None and dist.get_world_size(self.ep_group) > 1 and not m.capacity_factor:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.ep_group)
        cap = capacity(peak, tokens, e, m.top_k, m.capacity_factor, self.tp.size)
        locations = (torch.cumsum(mask, dim=0) - 1).gather(1, idx)  # slot of each route in its expert
        kept = locations < cap
        indices = torch.where(kept, idx, torch.full_like(idx, -1))
        gates = w * kept
        l_aux = x.new_zeros((), dtype=torch.float32)
        return (l_aux, cap, e, indices.t().contiguous().to(torch.int32),
                (locations * kept).t().contiguous().to(torch.int32), gates.t().contiguous(), counts.detach())


class Expert(nn.Module):
    """One routed expert: a whole FFN of expert_ffn columns (module docstring)."""

    def __init__(self, spec: ModelSpec, layer: int, index: int, tp: TPGroup, seed: int) -> None:
        super().__init__()
        self.spec, self.tp = spec, tp
        f, k, h = spec.moe.expert_ffn, spec.ffn_in_matrices, spec.hidden
        name = f"layers.{layer}.mlp.experts.{index}"
        self.dense_h_to_4h = nn.Parameter(seeded_normal(f"{name}.dense_h_to_4h.weight", (k * f, h), INIT_STD, seed,
                                                        [range(k * f)]))
        self.dense_4h_to_h = nn.Parameter(seeded_normal(f"{name}.dense_4h_to_h.weight", (h, f),
                                                        scaled_std(spec.layers), seed, [range(h)]))
        mark_replicated(self.dense_h_to_4h, f"{name}.dense_h_to_4h.weight")
        mark_replicated(self.dense_4h_to_h, f"{name}.dense_4h_to_h.weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, copy_to_tp(self.dense_h_to_4h, self.tp))
        if self.spec.glu:
            gate, up = h.chunk(2, dim=-1)
            h = (F.silu(gate) if self.spec.activation == "swiglu" else F.gelu(gate)) * up
        else:
            h = F.gelu(h)
        return F.linear(h, copy_to_tp(self.dense_4h_to_h, self.tp))


def _gather_tokens_gloo(input_: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """deepspeed.moe.mappings._gather_tokens with a list all-gather: DeepSpeed's gathers with
    all_gather_into_tensor, which gloo rejects (measured: "ProcessGroupGloo::allgather: invalid
    tensor size"), so EP with TP > 1 fails on CPU without this."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils.bwc import bwc_tensor_model_parallel_group, bwc_tensor_model_parallel_world_size
    mpu = deepspeed.utils.groups.mpu
    n = bwc_tensor_model_parallel_world_size(mpu)
    if n == 1:
        return input_
    parts = [torch.empty_like(input_) for _ in range(n)]
    dist.all_gather(parts, input_.contiguous(), group=bwc_tensor_model_parallel_group(mpu))
    return torch.cat(parts, dim=dim).contiguous()


def use_list_gather_on_gloo() -> None:
    """Install _gather_tokens_gloo when the process group is gloo (the CPU executor)."""
    import torch.distributed as dist
    from deepspeed.moe import mappings
    if dist.is_initialized() and dist.get_backend() == "gloo":
        mappings._gather_tokens = _gather_tokens_gloo


class MoEFFN(nn.Module):
    """The FFN of a MoE block: DeepSpeed-MoE over the routed experts (this rank's experts / ep of
    them, global indices ep_rank x experts/ep onwards, the order of DeepSpeed's all-to-all) plus
    the shared experts."""

    def __init__(self, spec: ModelSpec, layer: int, tp: TPGroup = SINGLE, ep: TPGroup = SINGLE,
                 seed: int = 0, shared: nn.Module | None = None) -> None:
        """shared: the shared experts' tensor-parallel FFN (block.py MLP), or None."""
        super().__init__()
        from deepspeed.moe.layer import MoE
        m = spec.moe
        if tp.size > 1:
            use_list_gather_on_gloo()
        if m.experts % ep.size:
            raise ValueError(f"EP {ep.size} must divide the {m.experts} experts")
        self.spec, self.layer, self.tp = spec, layer, tp
        local = m.experts // ep.size
        # DeepSpeed deep-copies its expert argument per local expert: give it a placeholder (an
        # Expert holds a process group, which cannot be copied) and install each from its own seed
        self.moe = MoE(spec.hidden, nn.Identity(), num_experts=m.experts, ep_size=ep.size, k=m.top_k,
                       capacity_factor=max(m.capacity_factor, 1.0), drop_tokens=bool(m.capacity_factor),
                       use_rts=False, top2_2nd_expert_sampling=False)
        experts = self.moe.deepspeed_moe.experts.deepspeed_experts
        for j in range(local):
            experts[j] = Expert(spec, layer, ep.rank * local + j, tp, seed)
            for p in experts[j].parameters():
                p.allreduce = False
                p.group_name = self.moe.expert_group_name
        self.moe.deepspeed_moe.gate = Router(spec, layer, tp, seed)
        self.shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        if tp.sequence_parallel and tp.group is not None:
            # Megatron SP: x is this TP rank's sequence shard, DeepSpeed-MoE wants the TP ranks'
            # tokens identical (it splits their slots over TP): route the whole sequence, keep the shard
            out = scatter_seq(self.moe(_GatherReplicated.apply(x, tp))[0], tp)  # backward: all-gather
        else:
            out = self.moe(x)[0]
        return out if self.shared is None else out + self.shared(x)


class _GatherReplicated(torch.autograd.Function):
    """All-gather the sequence shards forward; backward keep this rank's shard of a gradient
    that is already whole on every TP rank (the MoE's input gradient: DeepSpeed gathers its
    slots' gradients over TP), so nothing is summed twice."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _gather_seq(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return seq_shard(grad, ctx.tp).contiguous(), None
