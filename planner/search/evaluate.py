"""Evaluate one outer point: exact inner solvers, then the cost model.

An outer point (space.Outer) is completed into a Plan by the stage-partition solver (and,
for recompute=full, the fewest checkpointed blocks per stage), then estimated. An outer
point no partition can fit is a value too: Trial.feasible is False, with the memory it would
need at least (never an exception, never a silent drop).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from planner.cost import estimate, layer_costs
from planner.cost.longctx import local
from planner.cost.runtime import get_runtime
from planner.search.checkpoint import StageModel
from planner.search.partition import NoFit, solve
from planner.search.space import Outer
from planner.specs.estimate import GB, Estimate
from planner.specs.hardware import ClusterSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import Plan
from planner.specs.problems import Problem
from planner.specs.validate import runtime_problems
from planner.specs.train import TrainSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class Trial:
    """One evaluated plan."""

    outer: Outer
    plan: Plan
    """The completed plan (uniform split when no partition fits)."""
    estimate: Estimate | None
    """None when the solvers proved that no stage split fits (see `reason`)."""
    feasible: bool
    problems: tuple[Problem, ...] = ()
    """Why not feasible (planner/specs/problems.py)."""
    needs_bytes: float
    """Peak bytes per device: the estimate's, or the least any split would need."""
    capacity_bytes: float
    source: str = "exhaustive"

    @property
    def reason(self) -> str:
        """The problems' sentences joined by "; " (trials.csv "reason")."""
        return "; ".join(p.line for p in self.problems)

    @property
    def reason_code(self) -> str:
        """The first problem's code (trials.csv "reason_code")."""
        return self.problems[0].code if self.problems else ""

    @property
    def tokens_per_s(self) -> float:
        return self.estimate.tokens_per_s if self.feasible and self.estimate else 0.0

    @property
    def needs_gb(self) -> float:
        return self.needs_bytes / GB


class Evaluator:
    """Evaluates outer points for one (model, cluster, train), remembering each result."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, *,
                 megatron_features: bool = False, runtime: str = "deepspeed") -> None:
        self.model, self.cluster, self.train = model, cluster, train
        self.runtime = "megatron-core" if megatron_features else runtime
        # DeepSpeed's own rules (no interleaving, no MiCS) apply to plans DeepSpeed runs
        self.megatron_features = self.runtime != "deepspeed"
        # fp8 is searched (scanned exactly beside bf16) where the runtime offers it on an FP8 GPU
        self.precisions = (train.precision,) + (
            ("fp8",) if train.precision == "bf16" and cluster.device.supports("fp8")
            and "fp8" in get_runtime(self.runtime).precisions else ())
        self.capacity = cluster.memory_bytes
        self.cache: dict[Outer, Trial] = {}

    def __call__(self, outer: Outer, source: str) -> Trial:
        hit = self.cache.get(outer)
        if hit is not None:
            return hit if hit.source == source else dataclasses.replace(hit, source=source)
        trial = self._evaluate(outer, source)
        self.cache[outer] = trial
        return trial

    def _evaluate(self, outer: Outer, source: str) -> Trial:
        """The outer point completed in each searched precision: the fastest that fits (else
        the first, with its reason)."""
        return best_of([self._evaluate_in(outer, source, p) for p in self.precisions])

    def evaluate_in(self, outer: Outer, precision: str, source: str) -> Trial:
        """The outer point completed in one precision (not cached: the pruned sweep,
        planner.search.exhaustive.pruned_sweep, evaluates precisions separately)."""
        return self._evaluate_in(outer, source, precision)

    def _evaluate_in(self, outer: Outer, source: str, precision: str) -> Trial:
        model, train = self.model, self.train
        base = outer.plan(precision, runtime=self.runtime)
        lc = layer_costs(model, self.cluster, train, base)
        full = outer.recompute == "full"
        # the stage model's ZeRO groups are those of the cp-free equivalent (dp x cp ranks)
        sol = solve(StageModel(self.cluster, local(base, train)[0], lc), model.layers, checkpoint=full)
        if isinstance(sol, NoFit):
            problems = ([] if self.megatron_features else runtime_problems(base, model)) + [sol.problem]
            return Trial(outer=outer, plan=base, estimate=None, feasible=False, problems=tuple(problems),
                         needs_bytes=sol.needs_bytes, capacity_bytes=self.capacity, source=source)
        plan = outer.plan(precision, stage_layers=sol.stage_layers,
                          recompute_layers=sol.checkpointed if full else (), runtime=self.runtime)
        if full and not any(sol.checkpointed):
            # nothing needs checkpointing: say so plainly (the same plan as recompute=none)
            plan = dataclasses.replace(plan, recompute="none", recompute_layers=())
        est = estimate(model, self.cluster, train, plan)
        problems = list(est.problems)
        if not self.megatron_features:
            problems = runtime_problems(plan, model) + problems
        return Trial(outer=outer, plan=plan, estimate=est, feasible=not problems, problems=tuple(problems),
                     needs_bytes=est.peak_memory_bytes, capacity_bytes=est.capacity_bytes, source=source)


def best_of(trials: list[Trial]) -> Trial:
    """One outer point's trial from its precisions' (in Evaluator.precisions order): the fastest
    that fits, else the first."""
    ok = [t for t in trials if t.feasible]
    return max(ok, key=lambda t: t.tokens_per_s) if ok else trials[0]


def rank(trials: list[Trial] | tuple[Trial, ...]) -> list[Trial]:
    """Feasible trials, distinct plans, fastest first (ties: less memory, then fewer devices idle)."""
    seen: set[Plan] = set()
    out = []
    for t in sorted((t for t in trials if t.feasible), key=lambda t: (-t.tokens_per_s, t.needs_bytes)):
        if t.plan in seen:
            continue
        seen.add(t.plan)
        out.append(t)
    return out


def pareto_front(trials: list[Trial] | tuple[Trial, ...]) -> list[Trial]:
    """Feasible plans no other plan beats on both throughput (higher) and peak memory (lower)."""
    front: list[Trial] = []
    best_mem = float("inf")
    for t in sorted(rank(trials), key=lambda t: (-t.tokens_per_s, t.needs_bytes)):
        if t.needs_bytes < best_mem:
            front.append(t)
            best_mem = t.needs_bytes
    return front
