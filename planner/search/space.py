"""The legal plan space: every outer choice DeepSpeed can run for a model, cluster and batch.

Outer choices (what Optuna or the exhaustive sweep decides): TP and PP degrees (DP follows,
DP x TP x PP = devices), ZeRO stage, micro-batch (accumulation follows: micro-batch x
accumulation x DP = global batch, exactly), recompute mode (selective only where the attention
kernel stores its scores), sequence parallelism and the
pipeline schedule (1F1B, or interleaved with v chunks per stage). The inner choices -- stage
boundaries and which layers are checkpointed -- are solved exactly per outer point
(planner/search/partition.py, checkpoint.py).

Rules (DESIGN.md "What DeepSpeed can actually run", planner.specs.validate.plan_problems):
TP inside a node and dividing heads, KV groups and the FFN; PP at most the layers; ZeRO 2-3
only without pipeline parallelism; interleaving needs accumulation divisible by PP and at
least one layer per chunk; sequence parallelism needs TP > 1 and seq_len divisible by TP.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Iterator

from planner.cost.attention import selective_saves_memory
from planner.cost.runtime import get_runtime
from planner.errors import SpecError
from planner.specs.cluster import ClusterSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import RECOMPUTE, Plan
from planner.specs.train import TrainSpec
from planner.specs.validate import plan_problems

LONG_SEQUENCE = 16384
"""Space.context_parallel "auto" offers context parallelism from this sequence length: the
shortest the DeepSpeed-Ulysses paper (Jacobs et al. 2023, arXiv 2309.14509, Fig. 2: 8k-256k on
GPT 1.2B-30B) and Megatron-Core's long-context recipes split; below it the cp axis only
multiplies the space (pass context_parallel="on" to search it anyway)."""
MAX_INTERLEAVE = 4
"""Largest number of virtual chunks per stage the space offers. The interleaved bubble is
(p-1)/(v m) (Narayanan et al. 2021, sec. 2.2.2) while point-to-point traffic grows with v;
beyond 4 the remaining gain is under 1/20 of the 1F1B bubble. A Space argument."""


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


BUCKETS = (50_000_000, 200_000_000)
"""reduce_bucket_size choices (elements) for ZeRO 1-3: DeepSpeed's 5e8 default is left out (a
GPU rarely has the memory to spare), 5e7 is the Megatron-DeepSpeed recipes' value; larger
buckets mean fewer collectives, each paying its latency (planner.cost.zero), for memory."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ZeroVariant:
    """The ZeRO knobs of one outer point beyond the stage (planner.specs.plan field names)."""

    bucket_elements: int = BUCKETS[0]
    overlap_comm: bool = True
    live_elements: int = 0
    """stage3_max_live_parameters and stage3_max_reuse_distance (0: the bucket size)."""
    offload_optimizer: str = "none"
    offload_params: str = "none"
    hpz: int = 1
    quantized_weights: bool = False
    quantized_gradients: bool = False
    mics_shard: int = 0

    def plan_fields(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


PLAIN = ZeroVariant()
LIVE = 1_000_000_000
"""The larger stage3_max_live_parameters / stage3_max_reuse_distance the search offers
(DeepSpeed's default): more gathered weights kept, so a recomputed block's backward need not
gather them again (planner.cost.zero.reuse_gathers)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Outer:
    """One point of the outer space; the inner solvers complete it into a Plan."""

    tp: int
    pp: int
    dp: int
    zero: int
    micro_batch: int
    grad_accum: int
    recompute: str
    """none, selective or full (full: the checkpoint solver picks how many layers per stage)."""
    sequence_parallel: bool
    interleave: int
    """1 = 1F1B; v > 1 = interleaved with v chunks per stage."""
    variant: "ZeroVariant" = None  # type: ignore[assignment]
    """DeepSpeed's ZeRO knobs and variants (None: plain ZeRO, default buckets)."""
    ep: int = 1
    """Expert-parallel size (MoE models)."""
    cp: int = 1
    """Context-parallel degree; dp here is the data-parallel degree without it (shape.dp / cp)."""
    cp_kind: str = "ulysses"

    def plan(self, precision: str, stage_layers: tuple[int, ...] = (),
             recompute_layers: tuple[int, ...] = (), runtime: str = "deepspeed") -> Plan:
        v = self.variant or PLAIN
        return Plan(runtime=runtime, dp=self.dp, tp=self.tp, pp=self.pp, zero=self.zero, micro_batch=self.micro_batch,
                    grad_accum=self.grad_accum, recompute=self.recompute, sequence_parallel=self.sequence_parallel,
                    schedule="interleaved" if self.interleave > 1 else "1f1b", interleave=self.interleave,
                    precision=precision, stage_layers=stage_layers, recompute_layers=recompute_layers,
                    ep=self.ep, cp=self.cp, cp_kind=self.cp_kind, **v.plan_fields())

    @property
    def shape(self) -> "Shape":
        return Shape(tp=self.tp, pp=self.pp, dp=self.dp, recompute=self.recompute)


@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    """The parallel layout and recompute mode -- what one Optuna trial decides. The cheap
    remaining choices (ZeRO stage, sequence parallelism, schedule, micro-batch) are scanned
    exactly per shape."""

    tp: int
    pp: int
    dp: int
    """Ranks per (TP, PP) cell: the data-parallel degree times the context-parallel one."""
    recompute: str

    def outer(self, micro_batch: int, grad_accum: int, sequence_parallel: bool = False,
              interleave: int = 1, zero: int = 0, variant: ZeroVariant | None = None, ep: int = 1, cp: int = 1,
              cp_kind: str = "ulysses") -> Outer:
        return Outer(tp=self.tp, pp=self.pp, dp=self.dp // cp, zero=zero, micro_batch=micro_batch,
                     grad_accum=grad_accum, recompute=self.recompute, sequence_parallel=sequence_parallel,
                     interleave=interleave, variant=variant if variant is not None and variant != PLAIN else None,
                     ep=ep, cp=cp, cp_kind=cp_kind)


@dataclass(frozen=True, slots=True, kw_only=True)
class Space:
    model: ModelSpec
    cluster: ClusterSpec
    train: TrainSpec
    max_interleave: int = MAX_INTERLEAVE
    megatron_features: bool = False
    """Let interleaved 1F1B be chosen (Megatron-LM runtimes). Off, it is still evaluated but
    marked infeasible for DeepSpeed (planner.specs.validate.runtime_problems)."""
    context_parallel: str = "auto"
    """Offer cp > 1 (Ulysses and ring): on, off, or auto = on from LONG_SEQUENCE tokens."""
    runtime: str = "deepspeed"
    """The runtime the plans run on (planner.cost.runtime): its ZeRO stages, whether it has TP,
    PP and DeepSpeed's ZeRO variants bound the space."""

    def layouts(self) -> list[tuple[int, int, int]]:
        """Legal (tp, pp, dp) triples, checked with planner.specs.validate.plan_problems."""
        return self._layouts(self.train)

    def _layouts(self, train: TrainSpec) -> list[tuple[int, int, int]]:
        world, batch = self.cluster.world_size, train.global_batch
        out = []
        rt = get_runtime(self.runtime)
        for tp in divisors(self.cluster.gpus_per_node):  # tp divides the node, so the world too
            if tp > 1 and not rt.tensor_parallel:
                continue
            for pp in divisors(world // tp):
                if pp > 1 and not rt.pipeline:
                    continue
                dp = world // (tp * pp)
                if pp > self.model.layers or batch % dp:
                    continue
                probe = Plan(dp=dp, tp=tp, pp=pp, micro_batch=batch // dp, grad_accum=1, precision=train.precision)
                if not plan_problems(self.model, self.cluster, train, probe):
                    out.append((tp, pp, dp))
        return out

    def recompute_modes(self) -> tuple[str, ...]:
        """none and full always; selective (checkpoint the attention core) only where the
        attention kernel stores its scores, i.e. where it saves memory
        (planner.cost.attention.selective_saves_memory): with flash it would cost time for
        nothing."""
        train = self.train
        if get_runtime(self.runtime).attention != "plan":
            train = dataclasses.replace(train, attention=get_runtime(self.runtime).attention)
        if selective_saves_memory(self.model, train, self.cluster.device.kind):
            return RECOMPUTE
        return tuple(r for r in RECOMPUTE if r != "selective")

    def zero_stages(self, pp: int) -> tuple[int, ...]:
        """0-3 without a pipeline, 0-1 with one, those the runtime has; ZeRO-3 is not modelled for
        MoE (validate.moe_problems)."""
        stages = (0, 1, 2, 3) if pp == 1 else (0, 1)
        return tuple(z for z in stages if z in get_runtime(self.runtime).zero_stages
                     and not (z == 3 and self.model.moe is not None))

    def zero_options(self, pp: int, dp: int, tp: int = 1) -> list[tuple[int, ZeroVariant]]:
        """(ZeRO stage, variant) pairs to scan for a layout (README "ZeRO variants"):

        - every stage with the default buckets; stages 1-3 also with 4x larger buckets (fewer
          collectives, more memory) and with overlap_comm off (one reduce bucket instead of
          two, the reduction no longer hidden) when data parallel; ZeRO-3 also with 1e9 live
          parameters and reuse distance (fewer gathers under recompute, more memory);
        - optimizer offload to the host (stages 1-3; ZeRO-Offload) and, for ZeRO-3, optimizer
          and parameters on the host (ZeRO-Infinity), on NVMe too when the cluster has it --
          GPU clusters with known host numbers only;
        - ZeRO-3 across nodes: hpZ over the node's ranks, full ZeRO++ (hpZ + qwZ + qgZ), and
          MiCS sharding over one node.
        """
        out: list[tuple[int, ZeroVariant]] = []
        gpu = self.cluster.device.kind != "cpu"
        host = self.cluster.host
        offload = gpu and host.can_offload
        g = self.cluster.gpus_per_node // tp
        across = dp > g > 1 and self.cluster.nodes > 1
        for z in self.zero_stages(pp):
            out.append((z, PLAIN))
            if z == 0 or self.runtime != "deepspeed":  # the variants are DeepSpeed's
                continue
            if dp > 1:
                out.append((z, ZeroVariant(bucket_elements=BUCKETS[1])))
                out.append((z, ZeroVariant(overlap_comm=False)))
            if offload:
                out.append((z, ZeroVariant(offload_optimizer="cpu")))
            if z < 3:
                continue
            out.append((z, ZeroVariant(live_elements=LIVE)))
            if offload:
                out.append((z, ZeroVariant(offload_optimizer="cpu", offload_params="cpu")))
                if host.nvme_gbps:
                    out.append((z, ZeroVariant(offload_optimizer="nvme")))
                    out.append((z, ZeroVariant(offload_optimizer="nvme", offload_params="nvme")))
            if across and dp % g == 0:
                out.append((z, ZeroVariant(hpz=g)))
                out.append((z, ZeroVariant(hpz=g, quantized_weights=True, quantized_gradients=True)))
                out.append((z, ZeroVariant(mics_shard=g)))
        return out

    def interleaves(self, pp: int, dp: int) -> list[int]:
        """Chunks per stage: 1 (1F1B), or 2..max_interleave when some accumulation is divisible
        by pp (with micro-batch 1 the accumulation is global_batch/dp; a larger micro-batch only
        divides it further) and every chunk keeps a layer."""
        if pp == 1 or (self.train.global_batch // dp) % pp:
            return [1]
        return [1] + list(range(2, min(self.max_interleave, self.model.layers // pp) + 1))

    def context_options(self, tp: int, ranks: int) -> list[tuple[int, str]]:
        """(cp, kind) pairs for a (TP, PP) cell of `ranks` ranks: cp = 1, and with context
        parallelism on, every cp > 1 dividing the ranks that leaves a batch divisible by the
        remaining data-parallel degree, as Ulysses where cp x tp divides the heads and KV groups
        and as ring where 2 cp divides the sequence (planner.specs.validate.context_problems)."""
        out = [(1, "ulysses")]
        mode, m, s = self.context_parallel, self.model, self.train.seq_len
        if mode == "off" or (mode == "auto" and s < LONG_SEQUENCE) or m.linear_attention:
            return out
        for c in divisors(ranks)[1:]:
            if self.train.global_batch % (ranks // c):
                continue
            if m.heads % (c * tp) == 0 and m.kv_heads % (c * tp) == 0 and s % c == 0:
                out.append((c, "ulysses"))
            if s % (2 * c) == 0:
                out.append((c, "ring"))
        return out

    def expert_options(self, dp: int, zero: int) -> list[int]:
        """Expert-parallel sizes: 1, and for a MoE model every divisor of gcd(experts, dp)
        (ZeRO-3 is not modelled with MoE: validate.moe_problems)."""
        if self.model.moe is None or zero == 3:
            return [1]
        return divisors(math.gcd(self.model.moe.experts, dp))

    def sequence_parallel(self, tp: int) -> tuple[bool, ...]:
        return (False, True) if tp > 1 and self.train.seq_len % tp == 0 else (False,)

    def shapes(self) -> Iterator[Shape]:
        """Every legal shape, in a fixed order."""
        for tp, pp, dp in self.layouts():
            for rc in self.recompute_modes():
                yield Shape(tp=tp, pp=pp, dp=dp, recompute=rc)

    def outers(self, shape: Shape) -> list[list[Outer]]:
        """The shape's legal outer points: one list per (ZeRO, sequence parallel, interleave),
        each with every legal micro-batch, smallest first (interleaving needs the accumulation
        divisible by pp)."""
        out = []
        for cp, kind in self.context_options(shape.tp, shape.dp):
            dp = shape.dp // cp
            per_rank = self.train.global_batch // dp
            for zero, variant in self.zero_options(shape.pp, dp, shape.tp):
                for ep in self.expert_options(dp, zero):
                    for sp in self.sequence_parallel(shape.tp):
                        for v in self.interleaves(shape.pp, dp):
                            row = []
                            for mb in divisors(per_rank):
                                ga = per_rank // mb
                                if v == 1 or ga % shape.pp == 0:
                                    row.append(shape.outer(mb, ga, sp, v, zero, variant, ep, cp, kind))
                            out.append(row)
        return out

    def points(self) -> Iterator[Outer]:
        """Every legal outer point."""
        for shape in self.shapes():
            for row in self.outers(shape):
                yield from row

    def size(self) -> int:
        return sum(1 for _ in self.points())

    def require_nonempty(self) -> list[tuple[int, int, int]]:
        """The legal layouts, or one SpecError line saying why there are none and what to change."""
        layouts = self.layouts()
        if layouts:
            return layouts
        world, batch = self.cluster.world_size, self.train.global_batch
        probe = Plan(dp=world, micro_batch=max(1, batch // world), precision=self.train.precision)
        problems = [p for p in plan_problems(self.model, self.cluster, self.train, probe)
                    if p.code not in ("global-batch", "world-size")]
        if problems:
            raise SpecError("plan space", f"no legal plan: {problems[0].line}", "change the inputs named above")
        any_batch = dataclasses.replace(self.train, global_batch=world)
        dps = sorted({dp for _, _, dp in self._layouts(any_batch)})
        raise SpecError("--global-batch", f"{batch} is not divisible by any legal data-parallel degree "
                        f"({', '.join(map(str, dps[:12]))})",
                        f"use a multiple of {dps[0]}, e.g. {dps[0] * max(1, -(-batch // dps[0]))}")
