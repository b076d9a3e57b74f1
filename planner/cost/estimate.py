"""Assemble the step time, throughput, FLOPs utilisation and per-stage memory of a plan."""
from __future__ import annotations

from planner.cost import comm, compute, pipeline
from planner.cost.factors import cluster_factors
from planner.cost.model import _act_bytes, _block_times, _layer_costs, _stage_params, stage_memory, stage_times
from planner.specs.estimate import GB, Estimate, TimeBreakdown
from planner.specs.hardware import ClusterSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import Plan
from planner.specs.train import TrainSpec
from planner.specs.validate import plan_problems

_LABELS = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer states",
           "activations": "activations", "logits": "logits", "buckets": "communication buckets",
           "overhead": "runtime allowance"}


def _dp_comm(cluster: ClusterSpec, plan: Plan, psi_dev: float, f: dict[str, float],
             mb_compute: float, last_backward: float) -> tuple[float, float]:
    """(exposed gradient-sync seconds, exposed ZeRO-3 gather seconds) per step.

    ZeRO (Rajbhandari et al. 2020, section 7): stages 0-2 move 2 Psi per step (all-reduce, or
    reduce-scatter + all-gather), stage 3 moves 3 Psi (gathers in forward and backward plus a
    reduce-scatter). DeepSpeed's stage 2 and 3 reduce gradients every micro-batch.
    """
    d = plan.dp
    if d <= 1:
        return 0.0, 0.0
    bw, lat = comm.group_link(cluster, d, plan.tp)
    eff = f["comm_efficiency"]
    e = _act_bytes(plan.precision)
    m = plan.grad_accum
    hide = f["dp_overlap"] if plan.overlap_comm else 0.0
    if plan.zero in (0, 1):
        t = comm.allreduce_time(psi_dev * e, d, bw, lat, eff)
        # DeepSpeed's ZeRO-0 and pipeline engines reduce after the backward pass: no overlap
        window = last_backward if (plan.zero == 1 and plan.pp == 1) else 0.0
        return max(t - hide * min(t, window), 0.0), 0.0
    rs = comm.reducescatter_time(psi_dev * e, d, bw, lat, eff)
    if plan.zero == 2:
        ag = comm.allgather_time(psi_dev * e, d, bw, lat, eff)
        per_mb = max(rs - hide * min(rs, mb_compute), 0.0)
        return m * per_mb + ag, 0.0
    ag = comm.allgather_time(psi_dev * e, d, bw, lat, eff)
    gathers = 2.0 * ag
    per_mb_rs = max(rs - hide * min(rs, mb_compute), 0.0)
    per_mb_ag = max(gathers - hide * min(gathers, mb_compute), 0.0)
    return m * per_mb_rs, m * per_mb_ag


def _optimizer_time(cluster: ClusterSpec, plan: Plan, psi_dev: float, f: dict[str, float]) -> float:
    """Adam is memory-bound: per parameter it reads and writes master weight, momentum and
    variance (fp32) and reads the gradient; mixed precision also writes the 2-byte copy."""
    psi = psi_dev / (plan.dp if plan.zero >= 1 else 1)
    per_param = 28.0 if plan.precision == "fp32" else 30.0
    return psi * per_param / (cluster.device.hbm_bandwidth_gbps * 1e9) * f["optimizer_scale"]


def estimate(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, plan: Plan) -> Estimate:
    """Predict step time and per-device memory of `plan`. Never raises for an illegal or
    oversized plan: those come back with feasible=False and the reasons."""
    reasons = plan_problems(model, cluster, train, plan)
    f = cluster_factors(cluster)
    bt = _block_times(model, cluster, train, plan, f)
    lc = _layer_costs(model, cluster, train, plan, f, bt)
    layers = plan.layers_per_stage(model.layers)
    ckpt = plan.checkpointed_per_stage(model.layers)
    m, v, p = plan.grad_accum, plan.interleave, plan.pp

    times = stage_times(lc, layers, ckpt, f["microbatch_overhead_s"])
    slow = max(range(p), key=lambda i: times[i])
    steady, bubble = pipeline.pipeline_time(tuple(times), m, v)
    # point-to-point: each micro-batch sends b s h activations forward and their gradient back
    # at every boundary (v x as many with interleaving). DeepSpeed sends the full tensor from
    # each TP rank (no scatter/gather).
    e = _act_bytes(plan.precision)
    p2p = 0.0
    if p > 1:
        inter = plan.dp * plan.tp >= cluster.gpus_per_node and cluster.nodes > 1
        link = cluster.inter_node if inter else cluster.intra_node
        one = comm.p2p_time(train.seq_len * plan.micro_batch * model.hidden * e, link,
                            cluster.gpus_per_node, cluster.gpus_per_node, inter, f["comm_efficiency"])
        p2p = 2.0 * one * v
    pp_comm = m * p2p
    bubble += (p - 1) * p2p / v if p > 1 else 0.0

    psi = _stage_params(model, plan, layers)
    psi_dev = max(psi)
    n_slow, r_slow = layers[slow], ckpt[slow]
    mb_compute = times[slow]
    last_bwd = n_slow * (bt.backward + bt.tp_bwd)
    dp_sync, zero_gather = _dp_comm(cluster, plan, psi_dev, f, mb_compute, last_bwd)
    opt = _optimizer_time(cluster, plan, psi_dev, f)

    # breakdown of the slowest stage's steady-state work
    fwd = m * (n_slow * bt.forward)
    bwd = m * (n_slow * bt.backward)
    rec = m * (r_slow * (bt.forward + bt.tp_fwd) + (n_slow * bt.selective if plan.recompute == "selective" else 0.0))
    tpc = m * n_slow * (bt.tp_fwd + bt.tp_bwd)
    extra = steady - (fwd + bwd + rec + tpc)  # embedding / output layer / per-micro-batch overhead
    slow_extra_fwd = extra / 3.0
    time = TimeBreakdown(forward=fwd + slow_extra_fwd, backward=bwd + extra - slow_extra_fwd, recompute=rec,
                         tp_comm=tpc, pp_comm=pp_comm, bubble=bubble, dp_sync=dp_sync, zero_gather=zero_gather,
                         optimizer=opt, overhead=f["step_overhead_s"])
    step = time.total

    mem = stage_memory(model, plan, lc, layers, ckpt, f["memory_fragmentation"])
    cap = cluster.memory_bytes
    for i, mb in enumerate(mem):
        if mb.total > cap:
            parts = mb.to_gb()
            big = max(parts, key=parts.get)
            reasons.append(f"stage {i} needs {mb.total / GB:.1f} GB > {cap / GB:.1f} GB: "
                           f"{_LABELS[big]} {parts[big]:.1f} GB")
            break

    # forward share of each stage's micro-batch time (the rest is backward + recompute)
    fwd_share = []
    for i, (n, t_i) in enumerate(zip(layers, times)):
        fw = n * (bt.forward + bt.tp_fwd) + (lc.first_stage_time / 3.0 if i == 0 else 0.0) \
            + (lc.last_stage_time / 3.0 if i == p - 1 else 0.0)
        fwd_share.append((fw, max(t_i - fw, 0.0)))

    world = plan.world_size
    tokens = train.global_batch * train.seq_len
    model_flops = compute.model_flops_per_sequence(model, train.seq_len) * train.global_batch
    recompute_flops = 0.0
    if plan.recompute == "full":
        recompute_flops = sum(ckpt) * compute.block_forward_flops(model, train.seq_len, 1) * train.global_batch
    elif plan.recompute == "selective":
        _, core = compute.block_gemms(model, train.seq_len, 1, 1)
        recompute_flops = model.layers * core * train.global_batch
    hw_flops = model_flops + recompute_flops
    peak = cluster.device.peak_flops(plan.precision) or cluster.device.peak_flops("fp32")
    denom = step * world
    return Estimate(
        feasible=not reasons, reasons=tuple(reasons), step_time_s=step, time=time,
        tokens_per_s=tokens / step, tflops_per_gpu=model_flops / denom / 1e12, mfu=model_flops / (denom * peak),
        hfu=hw_flops / (denom * peak), stage_memory=tuple(mem), capacity_bytes=cap,
        bubble_fraction=pipeline.bubble_fraction(p, m, v), model_flops_per_step=model_flops,
        hardware_flops_per_step=hw_flops, stage_times=tuple(fwd_share))
