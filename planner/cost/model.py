"""The cost model: (model, cluster, train, plan) -> Estimate, and the per-layer costs the
search's exact solvers share with it.

Pure Python (no torch, deepspeed or optuna), deterministic, and fast enough for hundreds of
thousands of calls in a search.
"""
from __future__ import annotations

from dataclasses import dataclass

from planner.cost import comm, compute, memory, pipeline
from planner.cost.factors import cluster_factors
from planner.cost.layers import LayerCosts
from planner.specs.estimate import GB, MemoryBreakdown
from planner.specs.hardware import ClusterSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import Plan
from planner.specs.train import TrainSpec


@dataclass(frozen=True, slots=True)
class _BlockTimes:
    forward: float  # GEMMs + attention core + element-wise, no communication
    backward: float
    tp_fwd: float  # exposed TP collectives of one forward
    tp_bwd: float
    selective: float  # extra forward work of selective recompute (attention core + softmax)


def _act_bytes(precision: str) -> float:
    return 4.0 if precision == "fp32" else 2.0


def _block_times(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, plan: Plan,
                 f: dict[str, float]) -> _BlockTimes:
    dev = cluster.device
    prec = plan.precision if dev.supports(plan.precision) else "fp32"
    s, b, t, e = train.seq_len, plan.micro_batch, plan.tp, _act_bytes(plan.precision)
    gemm_f, core_f = compute.block_compute_times(model, dev, s, b, t, prec, compute_scale=f["compute_scale"],
                                                 attention_scale=f["attention_scale"])
    hbm = dev.hbm_bandwidth_gbps * 1e9
    elem_all = compute.block_elementwise_bytes(model, s, b, t, e, plan.sequence_parallel, flash=False)
    elem_flash = compute.block_elementwise_bytes(model, s, b, t, e, plan.sequence_parallel, flash=True)
    elem_f = elem_all / hbm * f["elementwise_scale"]
    softmax_f = (elem_all - elem_flash) / hbm * f["elementwise_scale"]
    bw, lat = comm.group_link(cluster, t, 1)
    # Megatron TP: two all-reduces of b s h per block forward and two backward (with sequence
    # parallelism, all-gather + reduce-scatter pairs of the same volume).
    ar = comm.allreduce_time(s * b * model.hidden * e, t, bw, lat, f["comm_efficiency"])
    fwd = gemm_f + core_f + elem_f
    return _BlockTimes(forward=fwd, backward=2.0 * (gemm_f + core_f) + 2.0 * elem_f, tp_fwd=2 * ar,
                       tp_bwd=2 * ar, selective=core_f + softmax_f)


def _stage_params(model: ModelSpec, plan: Plan, layers: tuple[int, ...]) -> list[float]:
    """Parameters held by one device of each stage (TP-split; embedding first, output last)."""
    out = []
    per_layer, last = model.layer_params, len(layers) - 1
    for i, n in enumerate(layers):
        psi = n * per_layer
        if i == 0:
            psi += model.embedding_params
        if i == last:
            psi += model.output_params
            if model.tied_embeddings and last > 0:
                psi += model.vocab * model.hidden  # the last stage keeps a copy for the output layer
        out.append(psi / plan.tp)
    return out


def bucket_bytes(plan: Plan, psi_dev: float) -> float:
    """DeepSpeed's flattened gradient-reduce bucket (x2 double-buffered with overlap_comm for
    ZeRO 1-2), plus ZeRO-3's all-gather bucket; never larger than the parameters themselves."""
    e = _act_bytes(plan.precision)
    n = min(float(plan.bucket_elements), psi_dev)
    if plan.zero == 0:
        return n * e
    if plan.zero in (1, 2):
        return n * e * (2 if plan.overlap_comm else 1)
    return n * e * (2 if plan.overlap_comm else 1) + n * e


def layer_costs(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, plan: Plan) -> LayerCosts:
    f = cluster_factors(cluster)
    return _layer_costs(model, cluster, train, plan, f, _block_times(model, cluster, train, plan, f))


def _layer_costs(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, plan: Plan, f: dict[str, float],
                 bt: _BlockTimes) -> LayerCosts:
    dev = cluster.device
    s, b, t, e = train.seq_len, plan.micro_batch, plan.tp, _act_bytes(plan.precision)
    prec = plan.precision if dev.supports(plan.precision) else "fp32"
    hbm = dev.hbm_bandwidth_gbps * 1e9
    sbh = s * b * model.hidden
    base = bt.forward + bt.backward + bt.tp_fwd + bt.tp_bwd
    block_time = base + (bt.selective if plan.recompute == "selective" else 0.0)
    block_full = base + bt.forward + bt.tp_fwd
    # first stage: embedding lookup and its gradient (memory-bound)
    first = 3.0 * 2.0 * sbh * e / hbm * f["elementwise_scale"]
    # last stage: final norm, output GEMM (2 b s h V / t, backward 2x), cross-entropy in fp32
    logits_f = compute.logits_forward_flops(model, s, b, t)
    last = 3.0 * compute.gemm_time(dev, logits_f, prec, f["compute_scale"])
    last += (3.0 * s * b * model.vocab / t * (e + 8.0) + 6.0 * sbh * e) / hbm * f["elementwise_scale"]
    act_mode = "selective" if plan.recompute == "selective" else "none"
    act = memory.block_activation_bytes(model, s, b, t, sequence_parallel=plan.sequence_parallel,
                                        recompute=act_mode, act_bytes=e) * f["activation_scale"]
    act_none = memory.block_activation_bytes(model, s, b, t, sequence_parallel=plan.sequence_parallel,
                                             recompute="none", act_bytes=e) * f["activation_scale"]
    act_full = memory.block_activation_bytes(model, s, b, t, sequence_parallel=plan.sequence_parallel,
                                             recompute="full", act_bytes=e)
    work = act_none if plan.recompute != "none" else 0.0
    psi_block = model.layer_params / t
    state = sum(memory.model_state_bytes(psi_block, plan.dp, plan.zero, plan.precision))
    first_state = sum(memory.model_state_bytes(model.embedding_params / t, plan.dp, plan.zero, plan.precision))
    out_params = model.output_params + (model.vocab * model.hidden if model.tied_embeddings and plan.pp > 1 else 0)
    last_state = sum(memory.model_state_bytes(out_params / t, plan.dp, plan.zero, plan.precision))
    return LayerCosts(
        block_time=block_time, block_time_full_recompute=block_full, first_stage_time=first,
        last_stage_time=last, block_act_bytes=act, block_act_bytes_full_recompute=act_full,
        block_work_bytes=work, first_stage_act_bytes=sbh * (e + 1),
        last_stage_act_bytes=memory.logits_bytes(s, b, model.vocab, t, e) + sbh * e,
        block_state_bytes=state, first_stage_state_bytes=first_state, last_stage_state_bytes=last_state,
        fixed_bytes=f["memory_overhead_gb"] * GB,
        in_flight=pipeline.in_flight(plan.pp, plan.grad_accum, plan.interleave),
    )


def stage_memory(model: ModelSpec, plan: Plan, lc: LayerCosts, layers: tuple[int, ...],
                 checkpointed: tuple[int, ...], fragmentation: float) -> list[MemoryBreakdown]:
    """Per-stage peak memory of one device from the shared layer costs."""
    psi = _stage_params(model, plan, layers)
    out = []
    p = len(layers)
    for i, (n, r) in enumerate(zip(layers, checkpointed)):
        params, grads, opt = memory.model_state_bytes(psi[i], plan.dp, plan.zero, plan.precision)
        k = lc.in_flight[i]
        acts = k * ((n - r) * lc.block_act_bytes + r * lc.block_act_bytes_full_recompute)
        if i == 0:
            acts += k * lc.first_stage_act_bytes
        if n > 0 and (r > 0 or plan.recompute == "selective"):
            acts += lc.block_work_bytes
        logits = lc.last_stage_act_bytes if i == p - 1 else 0.0
        buckets = bucket_bytes(plan, psi[i])
        overhead = lc.fixed_bytes + fragmentation * (acts + logits + buckets)
        out.append(MemoryBreakdown(params=params, grads=grads, optimizer=opt, activations=acts, logits=logits,
                                   buckets=buckets, overhead=overhead))
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
