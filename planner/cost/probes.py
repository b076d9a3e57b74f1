"""A profiled CPU's step probes (planner/specs/step.py) as the cost model charges them: the
engine's framework overheads per micro-batch and per step, the 2-process parallel probe, and
the block probe that scales a block's compute terms.

Pure Python (no torch, deepspeed or optuna).
"""
from __future__ import annotations

from planner.cost.factors import Factors, concurrency
from planner.specs.cluster import ClusterSpec
from planner.specs.plan import Plan


def framework_overheads(cluster: ClusterSpec, plan: Plan, f: Factors) -> tuple[float, float]:
    """(seconds per micro-batch per stage, seconds per step) of the runtime beyond the compute
    terms: the factors' microbatch_overhead_s and step_overhead_s, plus a profiled CPU's
    engine probe (planner/specs/step.py framework) of the plan's precision, time-shared by
    the oversubscription like compute; on 2 or more processes the 2-process probe's (Parallel):
    under a pipeline its pipe schedule's cost per micro-batch replaces the framework's, else
    its concurrency cost per micro-batch adds to it; with data parallelism (ZeRO 0-2) its
    per-step cost adds to the step's, under ZeRO-3 its ZeRO-3 costs per micro-batch and step."""
    fw = cluster.device.step.framework.get(plan.precision)
    if fw is None:
        return f.microbatch_overhead_s, f.step_overhead_s
    k = cluster.device.oversubscription(cluster.gpus_per_node) * concurrency(cluster, plan)
    mb, step = fw.microbatch_s, fw.step_s
    par = parallel_probe(cluster, plan)
    if par is not None:
        if plan.pp > 1:  # DeepSpeed's pipe schedule per micro-batch, sends included (p2p_times: none then)
            mb = par.pipe_microbatch_s
        else:  # ranks computing at once
            mb += par.microbatch_s
        if plan.dp > 1 and plan.zero < 3:
            step += par.dp_step_s
        if plan.dp > 1 and plan.zero == 3:
            mb, step = mb + par.zero3_microbatch_s, step + par.zero3_step_s
    return f.microbatch_overhead_s + mb * k, f.step_overhead_s + step * k


def parallel_probe(cluster: ClusterSpec, plan: Plan):
    """The profiled CPU's 2-process engine probe of the plan's precision (planner/specs/step.py
    Parallel) when the plan runs more than one process, or None."""
    if plan.world_size < 2 or cluster.device.kind != "cpu":
        return None
    return cluster.device.step.parallel.get(plan.precision)


def zero2_reduction(cluster: ClusterSpec, plan: Plan, psi: int) -> float:
    """Seconds per step a profiled CPU's DP ZeRO-2 costs beyond the cost model's terms
    (planner/specs/step.py Parallel.zero2_*): DeepSpeed's ZeRO-2 reduces the gradients of every
    micro-batch, ZeRO 0/1 once per step, so each micro-batch beyond the first adds one reduction
    of the stage's psi parameters, zero2_fixed_s + zero2_param_s x psi as measured (time-shared
    by the oversubscription like the other engine costs); 0 elsewhere."""
    par = parallel_probe(cluster, plan)
    if par is None or plan.zero != 2 or plan.dp < 2 or plan.grad_accum < 2:
        return 0.0
    k = cluster.device.oversubscription(cluster.gpus_per_node)
    return (plan.grad_accum - 1) * (par.zero2_fixed_s + par.zero2_param_s * psi) * k


def block_probe(cluster: ClusterSpec, plan: Plan):
    """The profiled CPU's block probe for the plan's precision (planner/specs/step.py), or None."""
    dev = cluster.device
    return dev.step.block_for(plan.precision if dev.supports(plan.precision) else "fp32")
