"""Assemble the step time, throughput, FLOPs utilisation and per-stage memory of a plan."""
from __future__ import annotations

import dataclasses
import math

from planner.cost import comm, compute, engines, longctx, moe, params, pipeline, runtime, zero
from planner.cost.attention import recomputes_scores
from planner.cost.engines import Engine
from planner.cost.factors import Factors, cluster_factors
from planner.cost.layers import LayerCosts
from planner.cost.block import block_kernel, block_times, runtime_train
from planner.cost.model import layer_costs_of
from planner.cost.probes import framework_overheads, parallel_probe, zero2_reduction
from planner.cost.stage import resident_memory, stage_memory, stage_times
from planner.cost.runtime import get_runtime
from planner.specs.estimate import GB, MEMORY_LABELS, Estimate, TimeBreakdown
from planner.specs.cluster import ClusterSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import Plan
from planner.specs.problems import MEMORY, Problem
from planner.specs.train import TrainSpec
from planner.specs.validate import plan_problems
from planner.specs.dtypes import activation_bytes

HOST_USABLE = 0.9
"""Share of a node's host memory offloaded states may take (the rest: OS, page cache, the
launcher, data loaders, pinned staging buffers)."""

ADAM_BYTES = {"fp32": 28.0, "mixed": 30.0}
"""Memory traffic of one Adam(W) update per parameter (memory-bound): read and write the fp32
weight (8), both fp32 moments (16), read the fp32 gradient (4); mixed precision also writes
the 16-bit copy of the weight (2)."""


def dp_comm(cluster: ClusterSpec, plan: Plan, engine: Engine, psi: tuple[int, ...], f: Factors,
            mb_compute: tuple[float, ...], backward: tuple[float, ...]) -> float:
    """Exposed gradient-sync seconds per step of ZeRO 0-2 (ZeRO-3: zero3_comm): the slowest
    stage's, from the engine's data-parallel collectives (planner.cost.engines) over each
    stage's DP route (planner.cost.comm.group_routes: hierarchical, per link class), bucket by bucket, and an offloaded
    optimizer's gradient copies to the host.

    A collective that DeepSpeed runs while backward still computes hides up to dp_overlap of
    itself behind that window (one micro-batch for per-micro-batch collectives, the last
    micro-batch's backward for per-step ones); the others are exposed in full (on a CPU all
    are: DeepSpeed's CPU accelerator runs collectives in line). ZeRO's
    volumes (Rajbhandari et al. 2020, sec. 7): 2 Psi for stages 0-2, 3 Psi for stage 3.
    """
    d = plan.dp
    offload = plan.offload_optimizer != "none"
    if d <= 1 and not offload:
        return 0.0
    links = comm.group_routes(cluster, plan, "dp")
    eff, m, ls = f.comm_efficiency, plan.grad_accum, f.latency_scale
    # the engine's collectives say whether they overlap (overlap_comm); on a CPU nothing does:
    # DeepSpeed's CPU accelerator has no streams (Stream() None, stream() a no-op context), so
    # every collective runs in line (measured: DP2 ZeRO-2's per-micro-batch reductions add their
    # whole time to each micro-batch beyond the first, planner/profiler/engine.py measure_parallel)
    hide = 0.0 if cluster.device.kind == "cpu" else f.dp_overlap
    # ZeRO-0 flattens up to FALLBACK_BUCKET elements per all-reduce; ZeRO-1/2 reduce and gather
    # reduce_bucket_size / allgather_bucket_size elements per collective
    bucket = engines.FALLBACK_BUCKET if plan.zero == 0 else plan.bucket_elements
    rt = get_runtime(plan.runtime)
    grad_bytes = 4.0 if rt.grad_reduce_fp32 and plan.precision in ("bf16", "fp8") else None
    gather_in_forward = rt.param_gather_overlap and plan.overlap_comm
    worst = 0.0
    for i, n in enumerate(psi):
        nb = max(1, math.ceil(n / bucket))
        # collectives sharing one overlap window hide at most dp_overlap x that window together
        windows: dict[tuple[str, bool], float] = {}
        for c in engine.collectives if d > 1 else ():
            nbytes = grad_bytes if grad_bytes and c.kind != "all_gather" else c.bytes
            t = nb * comm.ROUTE_COLLECTIVES[c.kind](n * nbytes / nb, d, links[i], eff, ls, f.network_efficiency)
            key = ("forward", True) if gather_in_forward and c.kind == "all_gather" else (c.per, c.overlap)
            windows[key] = windows.get(key, 0.0) + t
        if offload:
            # the reduced gradient partition crosses to the host (stage 2 every micro-batch,
            # stage 1 at the boundary), asynchronously while backward still computes
            key = ("micro_batch" if plan.zero == 2 else "step", plan.overlap_comm and plan.pp == 1)
            windows[key] = windows.get(key, 0.0) + zero.host_copy(cluster, n * activation_bytes(plan.precision) / d)
        sync = 0.0
        for (per, overlap), total in windows.items():
            # a step's collective hides behind the last micro-batch's backward; the parameter
            # gather of runtime.param_gather_overlap behind the next step's first forward
            span = {"micro_batch": mb_compute[i], "step": backward[i],
                    "forward": max(mb_compute[i] - backward[i], 0.0)}[per]
            window = span if overlap else 0.0
            sync += max(total - hide * min(total, window), 0.0) * (m if per == "micro_batch" else 1)
        worst = max(worst, sync)
    return worst


def optimizer_time(cluster: ClusterSpec, plan: Plan, engine: Engine, psi: tuple[int, ...],
                   f: Factors) -> float:
    """Adam is memory-bound (ADAM_BYTES per parameter it updates); the engine updates all of
    the stage's parameters or, when it shards the optimizer, 1/dp (MiCS: 1/mics_shard) of
    them. Offloaded: DeepSpeedCPUAdam on the host (planner.cost.zero.offload_step_time). A
    profiled CPU with an optimizer probe (planner/specs/step.py optimizer) counts its measured
    seconds per parameter instead (time-shared by the oversubscription, optimizer_scale)."""
    if plan.offload_optimizer != "none":
        return zero.offload_step_time(cluster, plan, max(psi), activation_bytes(plan.precision), f)
    n = max(psi) / (plan.zero_shard if engine.optimizer_sharded else 1)
    probe = cluster.device.step.optimizer.get(plan.precision) if cluster.device.kind == "cpu" else None
    if probe is not None:  # a profiled CPU: the executor's optimizer step measured per parameter
        return n * probe.param_s * f.optimizer_scale
    per_param = ADAM_BYTES["fp32" if plan.precision == "fp32" else "mixed"]
    return n * per_param / (cluster.device.hbm_bandwidth_gbps * 1e9) * f.optimizer_scale


def zero3_comm(model: ModelSpec, cluster: ClusterSpec, plan: Plan, f: Factors, lc: LayerCosts, bt,
               recomputed: int) -> zero.Zero3Time:
    """ZeRO-3's exposed gathers and reductions per step (planner.cost.zero): the blocks'
    forward / backward compute and the embedding's and output layer's (1/3 forward, 2/3
    backward) are the windows its collectives hide behind."""
    first, last = lc.first_stage_time - lc.first_stage_tp, lc.last_stage_time - lc.last_stage_tp
    thr = plan.persistence_elements or params.persistence_threshold(model)
    us = zero.units(model, plan, bt.forward + bt.tp_fwd, bt.backward + bt.tp_bwd, (first / 3.0, 2.0 * first / 3.0),
                    (last / 3.0, 2.0 * last / 3.0), recomputed, thr)
    if get_runtime(plan.runtime).flat_parameters:
        us = zero.flat_units(us)
    return zero.zero3_time(cluster, plan, us, f, activation_bytes(plan.precision))


def p2p_times(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, plan: Plan,
              f: Factors) -> tuple[float, ...]:
    """Seconds of one micro-batch's point-to-point traffic at each pipeline boundary: the
    activations forward and their gradient back, b s h each (b s h / t under sequence
    parallelism), sent by every rank of the stage (DeepSpeed sends each TP rank's full tensor).
    A boundary crosses nodes exactly when the rank layout puts the two stages on different
    nodes (planner.cost.comm.cross_node_boundaries). On a profiled CPU with the 2-process probe,
    a boundary inside a node costs nothing here: its sends are in the pipe schedule's
    per-micro-batch cost (planner.cost.probes.framework_overheads)."""
    e = activation_bytes(plan.precision)
    nbytes = train.seq_len * plan.micro_batch * model.hidden * e / (plan.tp if plan.sequence_parallel else 1)
    cross = comm.cross_node_boundaries(cluster.gpus_per_node, plan.dp, plan.tp, plan.pp)
    probed = parallel_probe(cluster, plan) is not None

    def boundary(crosses: bool) -> float:
        if probed and not crosses:  # in the pipe probe's per-micro-batch cost
            return 0.0
        return 2.0 * comm.p2p_time(nbytes, cluster, crosses, f.comm_efficiency, f.network_efficiency)
    return tuple(boundary(x) for x in cross)


def estimate(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, plan: Plan) -> Estimate:
    """Predict step time and per-device memory of `plan`. Never raises for an illegal or
    oversized plan: those come back with feasible=False and the reasons."""
    train = runtime_train(train, plan)
    rt = get_runtime(plan.runtime)
    reasons = plan_problems(model, cluster, train, plan) + runtime.problems(rt, plan)
    f = cluster_factors(cluster, plan.runtime, plan)
    # context parallelism: every term below for the cp-free equivalent (planner.cost.longctx),
    # the FLOPs and tokens for the plan as given
    full_plan, full_train = plan, train
    plan, train = longctx.local(plan, train)
    bt = block_times(model, cluster, train, plan, f, (full_plan.cp, full_plan.cp_kind))
    lc = layer_costs_of(model, cluster, train, plan, f, bt)
    engine = engines.engine_for(plan)
    layers = plan.layers_per_stage(model.layers)
    ckpt = plan.checkpointed_per_stage(model.layers)
    m, v, p = plan.grad_accum, plan.interleave, plan.pp
    mb_overhead, step_overhead = framework_overheads(cluster, plan, f)

    times = stage_times(lc, layers, ckpt, mb_overhead)
    slow = max(range(p), key=lambda i: times[i])
    steady, bubble = pipeline.pipeline_time(tuple(times), m, v)
    par = parallel_probe(cluster, plan)
    if par is not None and p > 1:  # the share of fill and drain this CPU's pipe step shows (measured)
        bubble *= par.pipe_bubble
    # point-to-point: the slowest boundary sets the steady-state pace (v x as many sends when
    # interleaved); filling and draining the pipe crosses every boundary once each way
    p2p = p2p_times(model, cluster, train, plan, f)
    pp_comm = m * v * max(p2p, default=0.0)
    if rt.p2p_overlap and p > 1:
        # Megatron-Core overlaps steady-state sends with the next micro-batch's compute (one
        # chunk's share of the stage's time); fill and drain (the bubble's sends) stay exposed
        pp_comm = m * v * max(max(p2p) - min(times) / v, 0.0)
    bubble += sum(p2p)

    psi = tuple(lc.stage_psi(i, p, n)[0] for i, n in enumerate(layers))
    backward = tuple(n * (bt.backward + bt.tp_bwd) for n in layers)
    if plan.zero == 3:
        z3 = zero3_comm(model, cluster, plan, f, lc, bt, ckpt[0])
        dp_sync, zero_gather = z3.sync, z3.gather
    else:
        dp_sync, zero_gather = dp_comm(cluster, plan, engine, psi, f, tuple(times), backward), 0.0
        dp_sync += zero2_reduction(cluster, plan, max(psi))
    opt = optimizer_time(cluster, plan, engine, psi, f)
    if model.moe is not None:  # the experts' own gradient sync and optimizer step (planner.cost.moe)
        e_sync, e_opt = moe.expert_sync_and_step(model, cluster, plan, layers, f, backward, activation_bytes(plan.precision),
                                                 engines.engine_for(moe.expert_plan(plan)).optimizer_sharded)
        dp_sync, opt = dp_sync + e_sync, opt + e_opt

    time = _breakdown(lc, bt, plan, layers[slow], ckpt[slow], slow == 0, slow == p - 1, m)
    time = TimeBreakdown(**{**time, "pp_comm": pp_comm, "bubble": bubble, "dp_sync": dp_sync,
                            "zero_gather": zero_gather, "optimizer": opt,
                            "overhead": step_overhead + m * mb_overhead})
    step = time.total

    mem = stage_memory(plan, lc, layers, ckpt, f.memory_fragmentation, resident_memory(cluster.device.kind))
    # live tensor bytes as an allocator counts them: whole buffers, no allowance (Estimate.allocated_memory)
    allocated = tuple(dataclasses.replace(mb, overhead=0.0)
                      for mb in stage_memory(plan, lc, layers, ckpt, 0.0, resident=False))
    cap = cluster.memory_bytes
    for i, mb in enumerate(mem):
        if mb.total > cap:
            parts = mb.to_gb()
            big = max(parts, key=parts.get)
            reasons.append(Problem("memory", f"{MEMORY}:{big}", f"stage {i} needs {mb.total / GB:.1f} GB > "
                                   f"{cap / GB:.1f} GB: {MEMORY_LABELS[big]} {parts[big]:.1f} GB"))
            break
    host = nvme = 0.0
    if plan.offload_optimizer != "none" or plan.offload_params != "none":  # nothing leaves the device otherwise
        host = max(engines.host_bytes(plan, *lc.stage_psi(i, p, n), largest=lc.largest) for i, n in enumerate(layers))
        nvme = max(engines.host_bytes(plan, *lc.stage_psi(i, p, n), location="nvme", largest=lc.largest)
                   for i, n in enumerate(layers))
    ranks = cluster.gpus_per_node
    if host and cluster.device.kind != "cpu" and cluster.host.cpu_memory_gb and \
            host * ranks > cluster.host.cpu_memory_gb * 1e9 * HOST_USABLE:
        reasons.append(Problem("--cpu-mem-gb", "host-memory", f"offloaded states need {host * ranks / GB:.0f} GB of "
                               f"host memory per node > {cluster.host.cpu_memory_gb * HOST_USABLE:.0f} GB usable of "
                               f"{cluster.host.cpu_memory_gb:.0f} GB", "offload less, use NVMe, or more nodes",
                               detail="--cpu-mem-gb"))
    if nvme and cluster.host.nvme_gb and nvme * ranks > cluster.host.nvme_gb * 1e9:
        reasons.append(Problem("--nvme-gb", "nvme-capacity", f"offloaded states need {nvme * ranks / GB:,.0f} GB of "
                               f"NVMe per node > {cluster.host.nvme_gb:,.0f} GB", "offload less, or more nodes",
                               detail="--nvme-gb"))

    # forward share of each stage's micro-batch time (the rest is backward + recompute)
    fwd_share = []
    for i, (n, t_i) in enumerate(zip(layers, times)):
        fw = n * (bt.forward + bt.tp_fwd) + (lc.first_stage_time / 3.0 if i == 0 else 0.0) \
            + (lc.last_stage_time / 3.0 if i == p - 1 else 0.0)
        fwd_share.append((fw, max(t_i - fw, 0.0)))

    world = full_plan.world_size
    train = full_train
    tokens = train.global_batch * train.seq_len
    model_flops = moe.model_flops_per_sequence(model, train.seq_len) * train.global_batch
    hw_flops = model_flops + hardware_extra_flops(model, cluster, train, full_plan, ckpt)
    peak = cluster.device.peak_flops(plan.precision) or cluster.device.peak_flops("fp32")
    denom = step * world
    return Estimate(
        feasible=not reasons, problems=tuple(reasons), step_time_s=step, time=time,
        tokens_per_s=tokens / step, tflops_per_gpu=model_flops / denom / 1e12, mfu=model_flops / (denom * peak),
        hfu=hw_flops / (denom * peak), stage_memory=tuple(mem), capacity_bytes=cap,
        bubble_fraction=pipeline.bubble_fraction(p, m, v), model_flops_per_step=model_flops,
        hardware_flops_per_step=hw_flops, stage_times=tuple(fwd_share), host_memory_bytes=host,
        nvme_bytes=nvme, headroom_bytes=f.memory_overhead_gb * GB, allocated_memory=allocated)


def _breakdown(lc: LayerCosts, bt, plan: Plan, n: int, r: int, first: bool, last: bool, m: int) -> dict[str, float]:
    """The slowest stage's m micro-batches split into forward, backward, recompute and TP
    communication (the embedding's and the output layer's compute 1/3 forward, 2/3 backward)."""
    first_c = lc.first_stage_time - lc.first_stage_tp if first else 0.0
    last_c = lc.last_stage_time - lc.last_stage_tp if last else 0.0
    selective = n * bt.selective if plan.recompute == "selective" else 0.0  # no full checkpointing then
    return {
        "forward": m * (n * bt.forward + (first_c + last_c) / 3.0),
        "backward": m * (n * bt.backward + 2.0 * (first_c + last_c) / 3.0),
        "recompute": m * (r * (bt.forward + bt.tp_fwd) + selective),
        "tp_comm": m * (n * (bt.tp_fwd + bt.tp_bwd - bt.a2a_fwd - bt.a2a_bwd) + (lc.first_stage_tp if first else 0.0)
                        + (lc.last_stage_tp if last else 0.0)),
        "a2a_comm": m * n * (bt.a2a_fwd + bt.a2a_bwd),
    }


def hardware_extra_flops(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, plan: Plan,
                         ckpt: tuple[int, ...]) -> float:
    """FLOPs the hardware runs beyond the model FLOPs (Korthikanti et al. 2022, sec. 6: HFU
    counts recomputation): full recompute re-runs checkpointed blocks' forward; selective re-runs
    the attention core; flash's backward recomputes QK^T in every block; the padded vocabulary's
    extra output columns (forward and backward)."""
    s = train.seq_len
    full = sum(ckpt) * moe.block_forward_flops(model, s)  # ckpt is all zeros unless recompute is full
    selective = model.layers * compute.block_gemms(model, s, 1, 1)[1] if plan.recompute == "selective" else 0.0
    flash = model.layers * compute.flash_recompute_flops(model, s, 1) \
        if recomputes_scores(block_kernel(model, cluster, train)) else 0.0
    padding = 3.0 * (compute.logits_forward_flops(model, s, 1, plan.tp) * plan.tp
                     - compute.logits_forward_flops(model, s, 1))
    return (full + selective + flash + padding) * train.global_batch
