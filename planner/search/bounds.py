"""Bounds that discard an outer point before its full estimate (the pruned exhaustive sweep,
planner.search.exhaustive.pruned_sweep; docs/search.md "Pruned exhaustive sweep").

Both bounds are computed from the cost model's own functions -- planner.cost.layer_costs and
planner.cost.stage.stage_bytes on a plan of the point -- never from copies of its formulas, so
they move with the cost terms. What they share between points (computed once per key, the
"shared per-stage terms") rests on two facts of the cost model that the unit tests check on
every point of small spaces (tests/unit/test_search_bounds.py):

- a block's time and the first and last stages' extra times do not depend on the ZeRO stage,
  its knobs and variants, the pipeline schedule or which blocks are checkpointed (those add
  their own terms to the step: gathers, syncs, the optimizer, recomputation);
- a device's model states (parameters, gradients, optimizer states) do not depend on the
  micro-batch, the recompute mode, sequence parallelism or the schedule.

**Step time, lower bound** (so tokens/s, upper bound). planner.cost.estimate's step is the
slowest stage's m micro-batches (planner.cost.pipeline.pipeline_time: m x t_max) plus the
fill and drain ((sum of stage times - t_max) / v) plus terms that are never negative
(point-to-point, DP sync, ZeRO-3 gathers, the optimizer) plus the step overhead. Stage i's
time with n_i blocks, r_i of them checkpointed, is at least its time with none checkpointed
(a checkpointed block costs one more forward); the sum over stages is the same for every
split, and the slowest stage takes at least the mean, at least ceil(L/p) blocks' worth, and at
least one block with the embedding or with the output layer. m t_max + (sum - t_max)/v grows
with t_max (m >= 1 >= 1/v), so the step is at least that expression at the smallest t_max.

**Peak memory, lower bound.** Some stage holds at least ceil(L/p) blocks and every stage at
least one; a stage's memory is at least its model states (planner.cost.stage.stage_bytes:
parameters, gradients and optimizer states, which grow with its blocks) plus the fixed
allowance. So the peak is at least max(the largest stage's states with one block, the
smallest stage's states with ceil(L/p) blocks) + the allowance, whatever the split,
checkpointing or micro-batch.
"""
from __future__ import annotations

import dataclasses
import math

from planner.cost import layer_costs
from planner.cost.engines import footprint
from planner.cost.factors import cluster_factors
from planner.cost.layers import LayerCosts
from planner.cost.longctx import local
from planner.cost.stage import resident_memory, stage_bytes, stage_times
from planner.search.space import Outer, Space
from planner.specs.cluster import ClusterSpec
from planner.specs.model import ModelSpec
from planner.specs.train import TrainSpec


class Bounds:
    """Step-time and memory lower bounds of outer points for one (model, cluster, train,
    runtime), with the per-key terms they share cached."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, runtime: str) -> None:
        self.model, self.cluster, self.train, self.runtime = model, cluster, train, runtime
        self.space = Space(model=model, cluster=cluster, train=train, runtime=runtime)
        f = cluster_factors(cluster, runtime)
        self.mb_overhead, self.step_overhead = f.microbatch_overhead_s, f.step_overhead_s
        self.tokens = train.global_batch * train.seq_len
        self._times: dict[tuple, tuple[float, float]] = {}
        self._states: dict[tuple, float] = {}

    def _layer_costs(self, outer: Outer, precision: str, **relaxed) -> tuple[LayerCosts, object]:
        plan = dataclasses.replace(outer, **relaxed).plan(precision, runtime=self.runtime)
        return layer_costs(self.model, self.cluster, self.train, plan), plan

    def step_lower(self, outer: Outer, precision: str) -> float:
        """Seconds per step that every plan completing `outer` in `precision` takes at least."""
        sel = outer.recompute == "selective"
        key = (outer.tp, outer.pp, outer.dp, outer.micro_batch, outer.sequence_parallel, outer.ep, outer.cp,
               outer.cp_kind, precision, sel)
        hit = self._times.get(key)
        if hit is None:
            zero = self.space.zero_stages(outer.pp)[0]
            lc, plan = self._layer_costs(outer, precision, zero=zero, variant=None, interleave=1,
                                         recompute="selective" if sel else "none")
            p, layers = outer.pp, self.model.layers
            even = tuple(layers // p + (i < layers % p) for i in range(p))
            total = sum(stage_times(lc, even, (0,) * p, self.mb_overhead))  # the same for every split
            slowest = max(total / p, math.ceil(layers / p) * lc.block_time + self.mb_overhead,
                          lc.block_time + lc.first_stage_time + self.mb_overhead,
                          lc.block_time + lc.last_stage_time + self.mb_overhead)
            hit = self._times[key] = (slowest, total)
        slowest, total = hit
        # m: the accumulation steps (context parallelism's cp-free plan keeps them: longctx.local)
        return outer.grad_accum * slowest + (total - slowest) / outer.interleave + self.step_overhead

    def tokens_upper(self, outer: Outer, precision: str) -> float:
        return self.tokens / self.step_lower(outer, precision)

    def memory_lower(self, outer: Outer, precision: str) -> float:
        """Peak bytes per device that every plan completing `outer` in `precision` needs at least."""
        v = outer.variant
        key = (outer.tp, outer.pp, outer.dp, outer.zero, v, outer.ep, outer.cp, outer.cp_kind, precision)
        hit = self._states.get(key)
        if hit is None:
            lc, plan = self._layer_costs(outer, precision, interleave=1, recompute="none")
            plan, _ = local(plan, self.train)
            fp = footprint(plan, resident_memory(self.cluster.device.kind), lc.largest)
            p, layers = plan.pp, self.model.layers

            def states(i: int, n: int) -> float:
                return sum(stage_bytes(fp, plan, lc, i, n, 0, 0.0)[:3])

            hit = self._states[key] = lc.fixed_bytes + max(
                max(states(i, 1) for i in range(p)), min(states(i, math.ceil(layers / p)) for i in range(p)))
        return hit
