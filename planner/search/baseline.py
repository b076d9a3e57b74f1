"""The conventional baseline every plan is compared against.

Plain data parallelism over every device, ZeRO-0, no recompute, no TP/PP, and the largest
micro-batch that fits (accumulation makes up the rest of the global batch). This is what a
user gets from DeepSpeed without planning, and what `planner verify` runs for real.
"""
from __future__ import annotations

from planner.cost import estimate
from planner.search.space import divisors
from planner.specs.estimate import Estimate
from planner.specs.hardware import ClusterSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import Plan
from planner.specs.train import TrainSpec


def conventional_baseline(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec,
                          precision: str | None = None) -> tuple[Plan, Estimate]:
    """(plan, estimate) of the baseline. When nothing fits, the micro-batch-1 plan and its
    infeasible estimate (its reasons say why; its peak memory says how much it would need)."""
    precision = precision or train.precision  # the cost model reads the plan's precision
    dp = cluster.world_size
    if train.global_batch % dp:
        # not expressible as plain DP over every device: the estimate carries plan_problems' reason
        plan = Plan(dp=dp, micro_batch=1, grad_accum=max(1, train.global_batch // dp), precision=precision)
        return plan, estimate(model, cluster, train, plan)
    per_rank = train.global_batch // dp
    best: tuple[Plan, Estimate] | None = None
    first: tuple[Plan, Estimate] | None = None
    for mb in divisors(per_rank):             # memory grows with the micro-batch: stop at the first miss
        plan = Plan(dp=dp, micro_batch=mb, grad_accum=per_rank // mb, precision=precision)
        est = estimate(model, cluster, train, plan)
        first = first or (plan, est)
        if not est.feasible:
            break
        best = (plan, est)
    return best or first  # type: ignore[return-value]
