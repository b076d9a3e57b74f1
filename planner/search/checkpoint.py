"""Checkpoint placement: the fewest fully checkpointed blocks that let a stage fit.

Per-stage memory of one device (planner.cost.stage.stage_bytes, from the shared LayerCosts and
the DeepSpeed engine's buffers, planner.cost.engines):

    mem(n, k) = states(n) + fixed + (1 + frag) * max(acts(n, k) + logits + backward buffers(n),
                                                     step buffers(n))
    acts(n, k) = in_flight * ((n - k) * act + k * act_ckpt + first-stage extra) + work

Checkpointing a block trades `act - act_ckpt` bytes per in-flight micro-batch for one extra
forward (Chen et al. 2016, arXiv 1604.06174; Korthikanti et al. 2022, Table 2: a checkpointed
block keeps only its 2sbh input). mem never rises with k (it falls linearly until the
optimizer step's buffers dominate, after the one-block working set that recomputation
needs), so the fewest k that fits is found by bisection on the exact memory function. Which k blocks does not matter (identical blocks); the plan
checkpoints the first k of each stage (planner.specs.plan).
"""
from __future__ import annotations

from planner.cost import engines, memory
from planner.cost.factors import cluster_factors
from planner.cost.layers import LayerCosts
from planner.cost.probes import framework_overheads
from planner.cost.stage import resident_memory
from planner.specs.cluster import ClusterSpec
from planner.specs.plan import Plan


class StageModel:
    """Time and memory of stage i holding n blocks, k of them checkpointed, for one outer plan.

    The same formulas as planner.cost.stage.stage_times / stage_bytes, with the per-stage
    constants precomputed so that the solvers can call them thousands of times cheaply."""

    __slots__ = ("fp8", "pp", "lc", "frag", "frag1", "mb_overhead", "capacity", "saving", "selective",
                 "stage_lin", "mins", "psi_of", "acts_of", "fixed", "owned", "dp")

    def __init__(self, cluster: ClusterSpec, plan: Plan, lc: LayerCosts) -> None:
        f = cluster_factors(cluster, plan.runtime, plan)
        self.pp = p = plan.pp
        # fp8's weight copies and amax histories (planner.cost.memory.fp8_bytes), per stage
        self.fp8 = (plan.precision == "fp8", plan.zero == 3, memory.fp8_param_gather(plan))
        self.lc = lc
        self.selective = plan.recompute == "selective"
        self.frag = f.memory_fragmentation
        self.frag1 = 1.0 + self.frag
        self.saving = [self.frag1 * f_i * (lc.block_act_bytes - lc.block_act_bytes_full_recompute)
                       for f_i in lc.in_flight]
        self.mb_overhead = framework_overheads(cluster, plan, f)[0]
        self.capacity = cluster.memory_bytes
        self.fixed = lc.fixed_bytes
        fp = engines.footprint(plan, resident_memory(cluster.device.kind), lc.largest)
        self.mins = fp.mins
        self.owned = fp.owned  # ZeRO-1's owned gradients: not linear in the blocks
        self.dp = plan.dp
        # per stage: the engine's linear quantities (held, held buckets, backward, backward
        # buckets, step) as slope x blocks + intercept; psi(n) and the activation constants
        lin: dict[int, tuple] = {}
        psi_of: dict[int, tuple] = {}
        for i in {0, p - 1, min(1, p - 1)}:  # inner stages differ only in their in-flight count
            psi0, small0 = lc.stage_psi(i, p, 0)
            psi_of[i] = (lc.block_psi, psi0)
            lin[i] = tuple((a * lc.block_psi + b * lc.block_small, a * psi0 + b * small0 + c) for a, b, c in fp.linear)
            # MoE: each block's routed experts, in their own ZeRO group (held from backward on)
            lin[i] = ((lin[i][0][0] + sum(lc.block_expert_bytes), lin[i][0][1]),) + lin[i][1:]
        inner = min(1, p - 1)
        self.stage_lin = [lin[i if i in (0, p - 1) else inner] for i in range(p)]
        self.psi_of = [psi_of[i if i in (0, p - 1) else inner] for i in range(p)]
        flight = lc.in_flight
        act, ckpt = lc.block_act_bytes, lc.block_act_bytes_full_recompute
        self.acts_of = [(flight[i] * act, flight[i] * ckpt, flight[i] * lc.first_stage_act_bytes if i == 0 else 0.0,
                         lc.last_stage_act_bytes if i == p - 1 else 0.0) for i in range(p)]

    def bytes(self, i: int, n: int, k: int) -> float:
        """planner.cost.stage.stage_bytes(...) summed, from the precomputed constants."""
        (s0, i0), (s1, i1), (s2, i2), (s3, i3), (s4, i4) = self.stage_lin[i]
        held, held_b, back, back_b, step = s0 * n + i0, s1 * n + i1, s2 * n + i2, s3 * n + i3, s4 * n + i4
        if self.mins or self.owned:
            slope, psi0 = self.psi_of[i]
            psi = slope * n + psi0
            q_vals = [held, held_b, back, back_b, step]
            for q, c, div, cap in self.mins:
                q_vals[q] += c * min(psi / div, cap)
            if self.owned:
                owned = self.lc.stage_owned(i, self.pp, n, self.dp)
                for q, c in self.owned:
                    q_vals[q] += c * owned
            held, held_b, back, back_b, step = q_vals
        act, act_ckpt, first, logits = self.acts_of[i]
        acts = (n - k) * act + k * act_ckpt + first
        if k > 0 or self.selective:
            acts += self.lc.block_work_bytes
        buckets = held_b + back_b
        backward = acts + logits + back
        if step > backward:
            buckets += step - backward
            back += step - backward
        fp8 = memory.fp8_bytes(n, self.lc.block_psi, self.fp8[1], self.fp8[2]) if self.fp8[0] else 0.0
        return held + back + acts + logits + self.fixed + fp8 + self.frag * (acts + logits + buckets)

    def time(self, i: int, n: int, k: int) -> float:
        lc = self.lc
        t = (n - k) * lc.block_time + k * lc.block_time_full_recompute + self.mb_overhead
        if i == 0:
            t += lc.first_stage_time
        if i == self.pp - 1:
            t += lc.last_stage_time
        return t

    def fewest_checkpointed(self, i: int, n: int, allow: bool) -> int | None:
        """Fewest checkpointed blocks (0..n) for stage i with n blocks to fit; None when even
        checkpointing all n does not fit (or `allow` is False and none checkpointed does not)."""
        cap = self.capacity
        if self.bytes(i, n, 0) <= cap:
            return 0
        if not allow or self.bytes(i, n, n) > cap:
            return None
        lo, hi = 1, n  # bytes(lo - 1) > cap >= bytes(hi); memory never rises with k: bisect
        while lo < hi:
            mid = (lo + hi) // 2
            if self.bytes(i, n, mid) <= cap:
                hi = mid
            else:
                lo = mid + 1
        return hi
