"""The conventional baseline every plan is compared against.

Plain data parallelism over every device, ZeRO-0, no recompute, no TP/PP, and the largest
micro-batch that fits (accumulation makes up the rest of the global batch). This is what a
user gets from DeepSpeed without planning, and what `planner verify` runs for real (in fp32,
with padded static batches: the source article's baseline, see TARGETS_SOURCE).

The baseline is always a legal plan on the cluster: world = dp x tp x pp (dp = every device)
and dp x micro-batch x accumulation = its global batch. When the user's global batch does
not split over every device (GLM-130B's 4,224 sequences on 768 GPUs), plain DP cannot train
it; the baseline then trains the next larger global batch that does (4,608 = 768 x 6) and
says so (`baseline_note`). Tokens/s and memory per GPU, the two figures compared, do not
depend on how many micro-batches a step accumulates.
"""
from __future__ import annotations

import dataclasses

from planner.cost import estimate
from planner.search.space import divisors
from planner.specs.estimate import Estimate
from planner.specs.cluster import ClusterSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import Plan
from planner.specs.train import TrainSpec

TARGETS_SOURCE = ("the source article's table: 12,000 -> 36,000 tokens/s (3x) and 48 -> 32 GB per GPU "
                  "(one third less) against a baseline of fp32, plain DP, ZeRO-0, padded static batches")
"""Where the 3x-throughput and one-third-less-memory targets come from (report and verify say it)."""


def baseline_global_batch(cluster: ClusterSpec, train: TrainSpec) -> int:
    """The global batch plain DP over every device can train: the user's when it splits over
    the devices, else the next multiple of the device count."""
    world = cluster.world_size
    return -(-train.global_batch // world) * world


def baseline_train(cluster: ClusterSpec, train: TrainSpec) -> TrainSpec:
    """`train` with the baseline's global batch (unchanged when the user's splits)."""
    gb = baseline_global_batch(cluster, train)
    return train if gb == train.global_batch else dataclasses.replace(train, global_batch=gb)


def baseline_note(plan: Plan, train: TrainSpec) -> str:
    """One sentence when the baseline trains another global batch than the user's, else ""."""
    if plan.global_batch == train.global_batch:
        return ""
    return (f"the baseline trains a global batch of {plan.global_batch:,} sequences: {train.global_batch:,} does "
            f"not split over {plan.dp:,} data-parallel ranks, so plain DP over every device takes the next "
            f"multiple ({plan.dp:,} x {plan.global_batch // plan.dp})")


def conventional_baseline(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec,
                          precision: str | None = None) -> tuple[Plan, Estimate]:
    """(plan, estimate) of the baseline, a legal plan (see the module docstring). When nothing
    fits, the micro-batch-1 plan and its infeasible estimate (its reasons say why; its peak
    memory says how much it would need)."""
    precision = precision or train.precision  # the cost model reads the plan's precision
    dp = cluster.world_size
    btrain = baseline_train(cluster, train)
    per_rank = btrain.global_batch // dp
    best: tuple[Plan, Estimate] | None = None
    first: tuple[Plan, Estimate] | None = None
    for mb in divisors(per_rank):             # memory grows with the micro-batch: stop at the first miss
        plan = Plan(dp=dp, micro_batch=mb, grad_accum=per_rank // mb, precision=precision)
        est = estimate(model, cluster, btrain, plan)
        first = first or (plan, est)
        if not est.feasible:
            break
        best = (plan, est)
    return best or first  # type: ignore[return-value]
