"""Mixture-of-experts costs of one block: expert GEMMs, router, dispatch/combine all-to-alls,
the dispatched tokens' activations, and the expert states sharded over expert parallelism.

The cost model's blocks are identical (planner.cost.layers.LayerCosts), so a MoE model's
block is the layer-weighted mean of its dense blocks (moe.first_dense of them) and its MoE
blocks: `share` = moe_layers / layers. Over the whole model (pp 1) that is exact; under PP
the few dense blocks (GLM-4.5: 3 of 92; Air: 1 of 46) are spread over the stages instead of
sitting on the first.

Per MoE block and micro-batch, T = b s tokens on a rank, k = top_k, E experts, f_e the
expert FFN, lf = MoESpec.load_factor (capacity factor, or the stated imbalance when dropless):
- router: 2 T h E FLOPs (an h x E GEMM on every TP rank) and its fp32 scores;
- routed experts (GShard, Lepikhin et al. 2020, arXiv 2006.16668, Algorithm 2, as DeepSpeed
  moe/sharded_moe.py MOELayer runs it): T k lf / t token-expert pairs per rank (DeepSpeed drops
  the TP ranks' duplicate tokens before dispatch, drop_tokens), each an FFN of f_e: 2 (m + 1)
  h f_e FLOPs per pair for m input matrices; the GEMMs are grouped per local expert, so their
  efficiency is that of one expert's GEMM of T k lf ep / (E t) rows;
- shared experts: a dense FFN of shared_size per token, split by TP like the dense FFN;
- dispatch and combine: an all-to-all of T k lf h / t elements each, forward, and the same two
  backward (_AllToAll.backward), over the ep ranks: exposed (DeepSpeed-MoE does not overlap them);
- expert weights: experts / ep per rank, whole (not split by TP); their gradients are reduced
  and ZeRO partitions them over the expert-data-parallel group of dp x cp / ep ranks
  (Plan.expert_dp).
"""
from __future__ import annotations

import dataclasses

from planner.cost import compute
from planner.cost.comm import allreduce_time as comm_allreduce
from planner.cost.factors import Factors
from planner.cost.longctx import alltoall_time, axis_link
from planner.specs.hardware import DeviceProfile
from planner.specs.cluster import ClusterSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import Plan

FP32 = 4.0


def share(model: ModelSpec) -> float:
    """Share of blocks that are MoE blocks (0 for a dense model)."""
    return model.moe_layers / model.layers if model.moe else 0.0


def routed_pairs(model: ModelSpec, s: int, b: int, t: int) -> float:
    """Token-expert pairs one rank computes per MoE block: T k lf / t."""
    m = model.moe
    return s * b * m.top_k * m.load_factor / t


def ffn_flops(model: ModelSpec, s: int, b: int, t: int) -> tuple[float, float, float]:
    """Forward FLOPs of one MoE block's FFN part on one rank: (router, shared experts, routed
    experts)."""
    m, h, k = model.moe, model.hidden, model.ffn_in_matrices
    tokens = s * b
    router = 2.0 * tokens * h * m.experts
    shared = 2.0 * tokens * h * m.shared_size * (k + 1) * m.shared_experts / t
    routed = 2.0 * routed_pairs(model, s, b, t) * h * model.moe.expert_ffn * (k + 1)
    return router, shared, routed


def ffn_time(model: ModelSpec, dev: DeviceProfile, s: int, b: int, t: int, ep: int, precision: str,
             scale: float) -> float:
    """Forward seconds of one MoE block's FFN GEMMs on one rank (router, shared, routed experts
    grouped per local expert: each at the efficiency of one expert's GEMM)."""
    router, shared, routed = ffn_flops(model, s, b, t)
    m = model.moe
    one = routed / (m.experts // ep) / (model.ffn_in_matrices + 1)  # one GEMM of one local expert
    peak = dev.peak_flops(precision)
    routed_t = routed / (peak * dev.gemm_eff(one, precision)) * scale if routed else 0.0
    shared_t = compute.gemm_time(dev, shared, precision, scale) if shared else 0.0
    return compute.gemm_time(dev, router, precision, scale) + shared_t + routed_t


def dense_ffn_time(model: ModelSpec, dev: DeviceProfile, s: int, b: int, t: int, precision: str,
                   scale: float) -> float:
    """Forward seconds of the dense FFN's two GEMMs (what a MoE block replaces)."""
    gemms, _ = compute.block_gemms(model, s, b, t)
    div = compute.ffn_time_divisors(model)
    return sum(compute.gemm_time(dev, g, precision, scale) / d for g, d in zip(gemms[2:], div[2:]))


def ffn_elementwise_bytes(model: ModelSpec, s: int, b: int, t: int, e: float) -> tuple[float, float]:
    """(MoE block, dense block) memory traffic of the FFN's memory-bound ops, forward: the
    activation (read, write) on every expert's inner width; for MoE also the dispatch's and
    combine's permutations (read, write of T k lf h / t each) and the router's softmax/sigmoid
    and top-k over T x E fp32 scores (read, write)."""
    m, h, k = model.moe, model.hidden, model.ffn_in_matrices
    sb = s * b
    dense = sb * e * (k * model.ffn_size + model.ffn_size) * 2 / t
    pairs = routed_pairs(model, s, b, t)
    moe = pairs * e * (k * m.expert_ffn + m.expert_ffn) * 2 + pairs * h * e * 2 * 2
    moe += sb * e * (k + 1) * m.shared_size * 2 * m.shared_experts / t + sb * m.experts * FP32 * 2
    return moe, dense


def ffn_activation_bytes(model: ModelSpec, s: int, b: int, t: int, e: float) -> tuple[float, float]:
    """(MoE block, dense block) FFN bytes kept for backward: the dense FFN's e b s f/t x (4 GLU | 2)
    (planner.cost.memory.block_activation_bytes); a MoE block keeps the router's fp32 scores
    and probabilities (2 x 4 T E), for each routed pair its dispatched input and combined
    output (2 h e) and its expert's inner tensors (f_e e x (4 GLU | 2)), and the shared experts'
    like a dense FFN of shared_size."""
    m, h = model.moe, model.hidden
    per = 4 if model.glu else 2
    dense = e * b * s * model.ffn_size / t * per
    pairs = routed_pairs(model, s, b, t)
    moe = 2 * FP32 * s * b * m.experts + pairs * e * (2 * h + m.expert_ffn * per)
    moe += e * b * s * m.shared_size * m.shared_experts / t * per
    return moe, dense


def alltoall_comm(model: ModelSpec, cluster: ClusterSpec, plan: Plan, s: int, e: float,
                  eff: float) -> tuple[float, float]:
    """(forward, backward) seconds of one MoE block's dispatch and combine over the ep ranks
    (ep consecutive data-parallel ranks at stride tp: inside a node when tp x ep divides it)."""
    if plan.ep == 1:
        return 0.0, 0.0
    bw, lat, _ = axis_link(cluster, plan.tp, plan.ep)
    one = alltoall_time(routed_pairs(model, s, plan.micro_batch, plan.tp) * model.hidden * e, plan.ep, bw, lat, eff)
    return 2 * one, 2 * one


def expert_params(model: ModelSpec, ep: int) -> int:
    """Routed-expert parameters of one MoE block on one rank: experts / ep whole experts."""
    return model.moe.experts // ep * model.expert_params


def expert_plan(plan: Plan) -> Plan:
    """The plan the expert states follow: ZeRO over the expert-data-parallel ranks
    (dp / ep of the cp-free plan, planner.cost.longctx.local)."""
    return dataclasses.replace(plan, dp=plan.dp // plan.ep, ep=1, mics_shard=0, hpz=1)


def block_forward_flops(model: ModelSpec, s: int) -> float:
    """Model FLOPs of one (mean) block's forward for one sequence: a MoE block runs the router,
    the shared experts and k routed experts per token (no capacity padding: model FLOPs)."""
    dense = compute.block_forward_flops(model, s, 1)
    w = share(model)
    if not w:
        return dense
    gemms, _ = compute.block_gemms(model, s, 1, 1)
    unpadded = dataclasses.replace(model.moe, capacity_factor=0.0, imbalance=1.0)
    router, shared, routed = ffn_flops(dataclasses.replace(model, moe=unpadded), s, 1, 1)
    return dense + w * (router + shared + routed - gemms[2] - gemms[3])


def model_flops_per_sequence(model: ModelSpec, s: int) -> float:
    """Model FLOPs (forward + backward, no recompute) for one sequence, 3 x forward
    (planner.cost.compute.model_flops_per_sequence, with MoE blocks' active FLOPs)."""
    if not model.moe:
        return compute.model_flops_per_sequence(model, s)
    return 3.0 * (model.layers * block_forward_flops(model, s) + compute.logits_forward_flops(model, s, 1))


ADAM_BYTES = 30.0
"""Memory traffic of one mixed-precision Adam update per parameter (planner.cost.estimate.ADAM_BYTES;
28 in fp32)."""


def expert_sync_and_step(model: ModelSpec, cluster: ClusterSpec, plan: Plan, layers: tuple[int, ...],
                         f: Factors, backward: tuple[float, ...], e: float,
                         sharded: bool) -> tuple[float, float]:
    """(exposed gradient sync, optimizer step) seconds per step of the routed experts, on the
    slowest stage: their gradients are all-reduced (ZeRO 1-2: reduce-scattered and gathered,
    the same volume) over the dp / ep expert-data-parallel ranks (ranks at stride tp x ep:
    longctx.axis_link), hiding up to dp_overlap of it behind the stage's backward like the
    dense gradients (planner.cost.estimate.dp_comm); Adam updates their 1/(dp/ep) share when the
    optimizer is sharded (ZeRO 1-2), all of them otherwise."""
    dp_e = plan.dp // plan.ep
    per_block = share(model) * expert_params(model, plan.ep)
    bw, lat, _ = axis_link(cluster, plan.tp * plan.ep, dp_e)
    sync = step = 0.0
    for n, back in zip(layers, backward):
        psi = n * per_block
        t = comm_allreduce(psi * e, dp_e, bw, lat * f.latency_scale, f.comm_efficiency)
        sync = max(sync, max(t - f.dp_overlap * min(t, back), 0.0) * (plan.grad_accum if plan.zero == 2 else 1))
        per = ADAM_BYTES if plan.precision != "fp32" else 28.0
        step = max(step, psi / (dp_e if sharded else 1) * per / (cluster.device.hbm_bandwidth_gbps * 1e9)
                   * f.optimizer_scale)
    return sync, step
