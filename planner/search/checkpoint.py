"""Checkpoint placement: the fewest fully checkpointed blocks that let a stage fit.

Per-stage memory of one device (planner.cost.model.stage_memory, from the shared LayerCosts):

    mem(n, k) = states(n) + fixed + (1 + frag) * (acts(n, k) + logits + buckets(n))
    acts(n, k) = in_flight * ((n - k) * act + k * act_ckpt + first-stage extra) + work

Checkpointing a block trades `act - act_ckpt` bytes per in-flight micro-batch for one extra
forward (Chen et al. 2016, arXiv 1604.06174; Korthikanti et al. 2022, Table 2: a checkpointed
block keeps only its 2sbh input). mem falls linearly in k (after the one-block working set
that recomputation needs), so the fewest k that fits has a closed form, checked exactly
against the memory function. Which k blocks does not matter (identical blocks); the plan
checkpoints the first k of each stage (planner.specs.plan).
"""
from __future__ import annotations

import math

from planner.cost.factors import all_factors
from planner.cost.layers import LayerCosts
from planner.cost.model import bucket_bytes  # shared with the estimate so both agree exactly
from planner.specs.hardware import ClusterSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import Plan


class StageModel:
    """Time and memory of stage i holding n blocks, k of them checkpointed, for one outer plan.

    The same formulas as planner.cost.model.stage_times / stage_memory, with the per-stage
    constants precomputed so that the solvers can call them thousands of times cheaply."""

    __slots__ = ("pp", "lc", "frag1", "mb_overhead", "selective", "layer_psi", "first_psi", "last_psi",
                 "bucket_elems", "bucket_slope", "capacity", "saving")

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, plan: Plan, lc: LayerCosts) -> None:
        f = all_factors(cluster.device)
        self.pp = plan.pp
        self.lc = lc
        self.frag1 = 1.0 + f["memory_fragmentation"]
        # DeepSpeed's buckets hold min(bucket_elements, parameters) elements (cost.model.bucket_bytes)
        self.bucket_elems = float(plan.bucket_elements)
        self.bucket_slope = bucket_bytes(plan, 1.0)
        self.saving = [self.frag1 * f_i * (lc.block_act_bytes - lc.block_act_bytes_full_recompute)
                       for f_i in lc.in_flight]
        self.mb_overhead = f["microbatch_overhead_s"]
        self.selective = plan.recompute == "selective"
        t = plan.tp
        self.layer_psi = model.layer_params / t
        self.first_psi = model.embedding_params / t
        tied = model.vocab * model.hidden if model.tied_embeddings and plan.pp > 1 else 0
        self.last_psi = (model.output_params + tied) / t
        self.capacity = cluster.memory_bytes

    def bytes(self, i: int, n: int, k: int) -> float:
        lc = self.lc
        first, last = i == 0, i == self.pp - 1
        states = n * lc.block_state_bytes
        psi = n * self.layer_psi
        f = lc.in_flight[i]
        acts = f * ((n - k) * lc.block_act_bytes + k * lc.block_act_bytes_full_recompute)
        logits = 0.0
        if first:
            states += lc.first_stage_state_bytes
            psi += self.first_psi
            acts += f * lc.first_stage_act_bytes
        if last:
            states += lc.last_stage_state_bytes
            psi += self.last_psi
            logits = lc.last_stage_act_bytes
        if n > 0 and (k > 0 or self.selective):
            acts += lc.block_work_bytes
        buckets = (psi if psi < self.bucket_elems else self.bucket_elems) * self.bucket_slope
        return states + lc.fixed_bytes + self.frag1 * (acts + logits + buckets)

    def time(self, i: int, n: int, k: int) -> float:
        lc = self.lc
        t = (n - k) * lc.block_time + k * lc.block_time_full_recompute + self.mb_overhead
        if i == 0:
            t += lc.first_stage_time
        if i == self.pp - 1:
            t += lc.last_stage_time
        return t

    def fewest_checkpointed(self, i: int, n: int, allow: bool = True) -> int | None:
        """Fewest checkpointed blocks (0..n) for stage i with n blocks to fit; None when even
        checkpointing all n does not fit (or `allow` is False and none checkpointed does not)."""
        cap = self.capacity
        need = self.bytes(i, n, 0) - cap
        if need <= 0:
            return 0
        if not allow or n == 0:
            return None
        saving = self.saving[i]
        if saving <= 0:
            return None
        if self.bytes(i, n, n) > cap:
            return None
        k = min(n, max(1, math.ceil((self.bytes(i, n, 1) - cap) / saving) + 1))
        while k > 1 and self.bytes(i, n, k - 1) <= cap:
            k -= 1
        while self.bytes(i, n, k) > cap:
            k += 1
        return k
