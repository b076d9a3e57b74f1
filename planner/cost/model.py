"""The cost model: (model, cluster, train, plan) -> Estimate, and the per-layer costs the
search's exact solvers share with it.

Pure Python (no torch, deepspeed or optuna), deterministic, and fast enough for hundreds of
thousands of calls in a search.
"""
from __future__ import annotations

from dataclasses import dataclass

from planner.cost import comm, compute, engines, memory, params, pipeline
from planner.cost.attention import attention_kernel, recomputes_scores
from planner.cost.factors import cluster_factors
from planner.cost.layers import LayerCosts
from planner.specs.estimate import GB, MemoryBreakdown
from planner.specs.hardware import ClusterSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import Plan
from planner.specs.train import TrainSpec

CE_ALLREDUCES = 3
"""Small fp32 all-reduces of b x s values in the vocab-parallel cross-entropy (max logit, sum
of exponentials, target logit: Megatron-LM _VocabParallelCrossEntropy, the executor's
planner/executor/parallel/tensor.py)."""


@dataclass(frozen=True, slots=True)
class _BlockTimes:
    forward: float  # GEMMs + attention core + element-wise, no communication
    backward: float  # 2x forward, plus flash's recomputed scores
    tp_fwd: float  # exposed TP collectives of one forward
    tp_bwd: float
    selective: float  # extra forward work of selective recompute (attention core + softmax)


def _act_bytes(precision: str) -> float:
    return 4.0 if precision == "fp32" else 2.0


def _kernel(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec) -> str:
    return attention_kernel(model, train, cluster.device.kind)


def _tp_link(cluster: ClusterSpec, plan: Plan) -> tuple[float, float]:
    return comm.group_links(cluster, plan, "tp")[0]  # TP divides the node: the same in every stage


def _block_times(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, plan: Plan,
                 f: dict[str, float]) -> _BlockTimes:
    dev = cluster.device
    prec = plan.precision if dev.supports(plan.precision) else "fp32"
    s, b, t, e = train.seq_len, plan.micro_batch, plan.tp, _act_bytes(plan.precision)
    kernel = _kernel(model, cluster, train)
    gemm_f, core_f = compute.block_compute_times(model, dev, s, b, t, prec, compute_scale=f["compute_scale"],
                                                 attention_scale=f["attention_scale"])
    hbm = dev.hbm_bandwidth_gbps * 1e9
    elem = compute.block_elementwise_bytes(model, s, b, t, e, plan.sequence_parallel, kernel)
    no_scores = compute.block_elementwise_bytes(model, s, b, t, e, plan.sequence_parallel, "flash")
    elem_f = elem / hbm * f["elementwise_scale"]
    scores_f = (elem - no_scores) / hbm * f["elementwise_scale"]
    # flash's backward recomputes QK^T (one of the core's two GEMMs)
    rec_f = compute.core_time(model, dev, compute.flash_recompute_flops(model, s, b, t), s, prec,
                              f["attention_scale"]) if recomputes_scores(kernel) else 0.0
    bw, lat = _tp_link(cluster, plan)
    # Megatron TP: two all-reduces of b s h per block forward and two backward (with sequence
    # parallelism, all-gather + reduce-scatter pairs of the same volume).
    ar = comm.allreduce_time(s * b * model.hidden * e, t, bw, lat, f["comm_efficiency"])
    fwd = gemm_f + core_f + elem_f
    return _BlockTimes(forward=fwd, backward=2.0 * (gemm_f + core_f) + rec_f + 2.0 * elem_f, tp_fwd=2 * ar,
                       tp_bwd=2 * ar, selective=core_f + scores_f)


def layer_costs(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, plan: Plan) -> LayerCosts:
    f = cluster_factors(cluster)
    return _layer_costs(model, cluster, train, plan, f, _block_times(model, cluster, train, plan, f))


def _layer_costs(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, plan: Plan, f: dict[str, float],
                 bt: _BlockTimes) -> LayerCosts:
    dev = cluster.device
    s, b, t, e = train.seq_len, plan.micro_batch, plan.tp, _act_bytes(plan.precision)
    prec = plan.precision if dev.supports(plan.precision) else "fp32"
    kernel = _kernel(model, cluster, train)
    hbm = dev.hbm_bandwidth_gbps * 1e9
    sbh = s * b * model.hidden
    v_local = model.padded_vocab(t) / t
    base = bt.forward + bt.backward + bt.tp_fwd + bt.tp_bwd
    block_time = base + (bt.selective if plan.recompute == "selective" else 0.0)
    block_full = base + bt.forward + bt.tp_fwd
    # TP outside the blocks: embedding forward all-reduce of b s h; output-layer backward
    # all-reduce of b s h and the cross-entropy's small fp32 all-reduces of b s
    bw, lat = _tp_link(cluster, plan)
    eff = f["comm_efficiency"]
    first_tp = comm.allreduce_time(sbh * e, t, bw, lat, eff)
    last_tp = comm.allreduce_time(sbh * e, t, bw, lat, eff) + CE_ALLREDUCES * comm.allreduce_time(
        s * b * 4.0, t, bw, lat, eff)
    # first stage: embedding lookup and its gradient (memory-bound)
    first = 3.0 * 2.0 * sbh * e / hbm * f["elementwise_scale"]
    # last stage: final norm, output GEMM (2 b s h V_pad / t, backward 2x), cross-entropy in fp32
    logits_f = compute.logits_forward_flops(model, s, b, t)
    last = 3.0 * compute.gemm_time(dev, logits_f, prec, f["compute_scale"])
    last += (3.0 * s * b * v_local * (e + 8.0) + 6.0 * sbh * e) / hbm * f["elementwise_scale"]
    act_mode = "selective" if plan.recompute == "selective" else "none"
    kw = dict(sequence_parallel=plan.sequence_parallel, act_bytes=e, kernel=kernel)
    act = memory.block_activation_bytes(model, s, b, t, recompute=act_mode, **kw) * f["activation_scale"]
    act_none = memory.block_activation_bytes(model, s, b, t, recompute="none", **kw) * f["activation_scale"]
    act_full = memory.block_activation_bytes(model, s, b, t, recompute="full", **kw)
    work = act_none  # counted only where a block is recomputed (stage_bytes)
    thr = params.persistence_threshold(model)
    blk, fst, lst = (params.block_tensors(model, t), params.first_stage_tensors(model, t),
                     params.last_stage_tensors(model, t, plan.pp))
    return LayerCosts(
        block_time=block_time, block_time_full_recompute=block_full, first_stage_time=first + first_tp,
        last_stage_time=last + last_tp, first_stage_tp=first_tp, last_stage_tp=last_tp,
        block_act_bytes=act, block_act_bytes_full_recompute=act_full,
        block_work_bytes=work, first_stage_act_bytes=sbh * (e + 1),
        last_stage_act_bytes=memory.logits_bytes(s, b, model.padded_vocab(t), t, e) + sbh * e,
        block_psi=blk.total, first_stage_psi=fst.total, last_stage_psi=lst.total,
        block_small=blk.small(thr), first_stage_small=fst.small(thr), last_stage_small=lst.small(thr),
        fixed_bytes=f["memory_overhead_gb"] * GB,
        in_flight=pipeline.in_flight(plan.pp, plan.grad_accum, plan.interleave),
    )


def stage_bytes(fp: engines.Footprint, plan: Plan, lc: LayerCosts, stage: int, blocks: int, checkpointed: int,
                fragmentation: float) -> tuple[float, float, float, float, float, float, float]:
    """Peak memory of one device of `stage` holding `blocks` blocks, `checkpointed` of them
    fully checkpointed: (params, grads, optimizer, activations, logits, buckets, overhead).

    `fp` is the plan's DeepSpeed engine (planner.cost.engines.footprint). Its buffers held
    from backward through the step count always. On top of them the peak is the larger of the
    backward phase (activations, logits, and the engine's backward-only buffers: full
    gradients before ZeRO-1's epilogue, reduce buckets, ZeRO-3's gathered weights) and the
    optimizer step (its step-only buffers, e.g. fp32 copies of the gradients), when
    activations are freed; a larger step phase shows as extra "buckets".
    """
    p = plan.pp
    psi, small = lc.stage_psi(stage, p, blocks)
    held, back, step_only = fp.evaluate(psi, small)
    k = lc.in_flight[stage]
    acts = k * ((blocks - checkpointed) * lc.block_act_bytes + checkpointed * lc.block_act_bytes_full_recompute)
    if stage == 0:
        acts += k * lc.first_stage_act_bytes
    if checkpointed > 0 or plan.recompute == "selective":
        acts += lc.block_work_bytes
    logits = lc.last_stage_act_bytes if stage == p - 1 else 0.0
    params, grads, opt, buckets = (h + b for h, b in zip(held, back))
    backward = acts + logits + sum(back)
    if step_only > backward:
        buckets += step_only - backward
    overhead = lc.fixed_bytes + fragmentation * (acts + logits + buckets)
    return params, grads, opt, acts, logits, buckets, overhead


def stage_memory(plan: Plan, lc: LayerCosts, layers: tuple[int, ...],
                 checkpointed: tuple[int, ...], fragmentation: float) -> list[MemoryBreakdown]:
    """Per-stage peak memory of one device from the shared layer costs."""
    fp = engines.footprint(plan)
    out = []
    for i, (n, r) in enumerate(zip(layers, checkpointed)):
        pa, gr, op, ac, lo, bu, ov = stage_bytes(fp, plan, lc, i, n, r, fragmentation)
        out.append(MemoryBreakdown(params=pa, grads=gr, optimizer=op, activations=ac, logits=lo, buckets=bu,
                                   overhead=ov))
    return out


def stage_times(lc: LayerCosts, layers: tuple[int, ...], checkpointed: tuple[int, ...],
                microbatch_overhead: float) -> list[float]:
    """Forward + backward seconds of one micro-batch on each stage."""
    p = len(layers)
    out = []
    for i, (n, r) in enumerate(zip(layers, checkpointed)):
        t = (n - r) * lc.block_time + r * lc.block_time_full_recompute + microbatch_overhead
        if i == 0:
            t += lc.first_stage_time
        if i == p - 1:
            t += lc.last_stage_time
        out.append(t)
    return out
