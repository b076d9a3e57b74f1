"""One transformer block on one TP rank: its forward, backward and selective-recompute
seconds and its exposed collectives (BlockTimes), from the compute terms (planner.cost.compute),
the TP collectives (planner.cost.tp), MoE (planner.cost.moe), context parallelism
(planner.cost.longctx) and a profiled CPU's block probe; and the attention kernel the plan's
runtime runs.

Pure Python (no torch, deepspeed or optuna).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from planner.cost import compute, longctx, moe
from planner.cost.attention import attention_kernel
from planner.cost.factors import Factors, cluster_factors, concurrency
from planner.cost.probes import block_probe
from planner.cost.runtime import get_runtime
from planner.cost.tp import overlapped_tp, tp_block_comm, tp_link
from planner.specs.cluster import ClusterSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import Plan
from planner.specs.train import TrainSpec
from planner.specs.dtypes import activation_bytes


@dataclass(frozen=True, slots=True)
class BlockTimes:
    forward: float  # GEMMs + attention core + element-wise, no communication
    backward: float  # 2x forward, plus flash's recomputed scores
    tp_fwd: float  # exposed collectives of one forward: TP's and (a2a_fwd of them) EP's / CP's
    tp_bwd: float
    selective: float  # extra forward work of selective recompute (attention core + softmax)
    a2a_fwd: float = 0.0  # of tp_fwd: MoE and context-parallel all-to-alls / ring sends
    a2a_bwd: float = 0.0


def block_kernel(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec) -> str:
    return attention_kernel(model, train, cluster.device.kind)


def block_times(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, plan: Plan,
                 f: Factors, ctx: tuple[int, str] = (1, "ulysses"), probe: bool = True) -> BlockTimes:
    """One block's times for a cp-free plan (planner.cost.longctx.local); `ctx` = the original
    plan's (cp, cp_kind): its attention core is cp times a block's at s/cp, plus the
    context-parallel communication. MoE blocks' FFN, router and all-to-alls are weighted in by
    their share of the blocks (planner.cost.moe).

    On a profiled CPU (`probe`, planner/specs/step.py) the compute terms compose as the
    executor's block measured: scale x (GEMMs + core + element-wise) + overhead_s per block
    forward + backward, 1/3 of it forward and 2/3 backward (its operators run once forward and
    twice backward), the overhead stretched by the oversubscription like the rest. A probe with
    per-class scales (BlockProbe.classes) weighs GEMMs, core and element-wise work each by its
    own measured multiplier."""
    dev = cluster.device
    prec = plan.precision if dev.supports(plan.precision) else "fp32"
    s, b, t, e = train.seq_len, plan.micro_batch, plan.tp, activation_bytes(plan.precision)
    kernel = block_kernel(model, cluster, train)
    rt = get_runtime(plan.runtime)
    bc = compute.block_compute_times(model, dev, s, b, t, prec, compute_scale=f.compute_scale,
                                     attention_scale=f.attention_scale, kernel=kernel,
                                     attention=attention_kernel_of(rt, train))
    gemm_f, gemm_b, core_f = bc.gemm_fwd, bc.gemm_bwd, bc.core_fwd
    # the attention core's backward beyond 2x its forward (flash: the recomputed Q K^T)
    rec_f = bc.core_bwd - 2.0 * core_f
    hbm = dev.hbm_bytes_per_s
    elem = compute.block_elementwise_bytes(model, s, b, t, e, plan.sequence_parallel, kernel)
    no_scores = compute.block_elementwise_bytes(model, s, b, t, e, plan.sequence_parallel, "flash")
    elem_f = elem / hbm * f.elementwise_scale
    scores_f = (elem - no_scores) / hbm * f.elementwise_scale
    tp_fwd, tp_bwd = tp_block_comm(model, s, b, t, e, plan.sequence_parallel, tp_link(cluster, plan),
                                   f.comm_efficiency)
    if plan.sequence_parallel and rt.tp_comm_overlap:
        tp_fwd, tp_bwd = overlapped_tp(tp_fwd, tp_bwd, gemm_f, gemm_b)
    cp, kind = ctx
    a2a_f = a2a_b = 0.0
    if cp > 1:  # a rank's share of the s x s core: cp x a block's at s/cp (flash only: validate)
        core_f, rec_f = core_f * longctx.core_factor(cp), rec_f * longctx.core_factor(cp)
        cf, cb = longctx.block_comm(model, cluster, t, b, cp, kind, s, e, f.comm_efficiency, core_f,
                                    2.0 * core_f + rec_f)
        a2a_f, a2a_b = cf, cb
    w = moe.share(model)
    if w:
        moe_t = moe.ffn_time(model, dev, s, b, t, plan.ep, prec, f.compute_scale)
        dense = compute.weight_gemm_times(model, dev, s, b, t, prec)[2:]  # the FFN a MoE block replaces
        gemm_f += w * (moe_t - sum(x[0] for x in dense) * f.compute_scale)
        gemm_b += w * (2.0 * moe_t - sum(x[1] for x in dense) * f.compute_scale)
        moe_e, dense_e = moe.ffn_elementwise_bytes(model, s, b, t, e)
        elem_f += w * (moe_e - dense_e) / hbm * f.elementwise_scale
        af, ab = moe.alltoall_comm(model, cluster, plan, s, e, f.comm_efficiency)
        a2a_f, a2a_b = a2a_f + w * af, a2a_b + w * ab
    fwd = gemm_f + core_f + elem_f
    bwd = gemm_b + 2.0 * core_f + rec_f + 2.0 * elem_f
    selective = core_f + scores_f
    bp = block_probe(cluster, plan) if probe else None
    if bp is not None:
        over = bp.overhead_s * dev.oversubscription(cluster.gpus_per_node) * concurrency(cluster, plan)
        gs, cs, es = bp.classes  # per term class (one scale for all in older profiles)
        fwd = gs * gemm_f + cs * core_f + es * elem_f + over / 3.0
        bwd = gs * gemm_b + cs * (2.0 * core_f + rec_f) + es * 2.0 * elem_f + 2.0 * over / 3.0
        selective = cs * core_f + es * scores_f
    return BlockTimes(forward=fwd, backward=bwd, tp_fwd=tp_fwd + a2a_f,
                       tp_bwd=tp_bwd + a2a_b, selective=selective, a2a_fwd=a2a_f, a2a_bwd=a2a_b)


def attention_kernel_of(rt, train: TrainSpec) -> compute.AttentionKernel:
    """The flash kernel families the plan's runtime runs, in order: the one its environment names
    (TrainSpec.attention_backend, e.g. Transformer Engine with NVTE_FUSED_ATTN=0 runs
    FlashAttention-2, not cuDNN) first, then the runtime's own preference (profiles/runtimes/*.json
    "attention_kernels"), so a profile without the named family falls back as the runtime would."""
    fams = tuple(rt.attention_kernels)
    if train.attention_backend:
        fams = (train.attention_backend,) + tuple(f for f in fams if f != train.attention_backend)
    return compute.AttentionKernel(fams, rt.causal_attention)


def block_compute_time(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, plan: Plan) -> float:
    """Forward + backward seconds of one block's compute terms (GEMMs, attention core,
    element-wise; no communication, no step probe): what the profiler's block probe is
    measured against (planner/profiler/write.py)."""
    train = runtime_train(train, plan)
    f = cluster_factors(cluster, plan.runtime)
    plan, train = longctx.local(plan, train)
    bt = block_times(model, cluster, train, plan, f, probe=False)
    return bt.forward + bt.backward


def block_compute_parts(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, plan: Plan) -> tuple[float, float, float]:
    """(GEMMs, attention core, element-wise) forward + backward seconds of block_compute_time,
    each class alone (the other classes' factors set to 0): what the profiler's block probe
    attributes the measured block to, class by class."""
    train = runtime_train(train, plan)
    f = cluster_factors(cluster, plan.runtime)
    plan, train = longctx.local(plan, train)
    out = []
    for keep in ("compute_scale", "attention_scale", "elementwise_scale"):
        g = f.replace(**{k: (getattr(f, k) if k == keep else 0.0)
                         for k in ("compute_scale", "attention_scale", "elementwise_scale")})
        bt = block_times(model, cluster, train, plan, g, probe=False)
        out.append(bt.forward + bt.backward)
    return out[0], out[1], out[2]


def runtime_train(train: TrainSpec, plan: Plan) -> TrainSpec:
    """The training spec as the plan's runtime runs it: Megatron-Core (Transformer Engine) and
    FSDP (llm-foundry, attn_impl=flash) always run flash attention (profiles/runtimes/*.json
    "attention"); DeepSpeed runs the kernel TrainSpec.attention names."""
    kernel = get_runtime(plan.runtime).attention
    if kernel == "plan" or kernel == train.attention:
        return train
    return dataclasses.replace(train, attention=kernel)
