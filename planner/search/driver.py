"""One search, start to finish: space -> (Optuna | exhaustive) -> ranked plans + baseline.

Pure library code: no printing and no files except the Optuna storage the caller names.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from planner.errors import SpecError
from planner.search.baseline import conventional_baseline
from planner.search.evaluate import Evaluator, Trial, pareto_front, rank
from planner.search.exhaustive import exhaustive as run_exhaustive, pruned_sweep
from planner.search.heuristic import heuristic
from planner.search.space import Space
from planner.specs.estimate import GB, Estimate
from planner.specs.hardware import ClusterSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import Plan
from planner.specs.train import TrainSpec
from planner.specs.validate import runtime_problems

Progress = Callable[[int, int], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchResult:
    method: str
    """optuna or exhaustive."""
    trials: tuple[Trial, ...]
    """Every evaluated plan, in evaluation order (an Optuna rerun includes earlier trials)."""
    ranked: tuple[Trial, ...]
    """Feasible distinct plans, fastest first."""
    baseline_plan: Plan
    baseline: Estimate
    space_size: int
    wall_s: float
    study_name: str = ""
    pruned: dict[str, int] | None = None
    """A pruned exhaustive sweep's discarded (point, precision) pairs by reason
    (planner.search.exhaustive.PRUNED); None when every point was estimated or Optuna searched."""

    @property
    def best(self) -> Trial:
        return self.ranked[0]

    @property
    def distinct(self) -> int:
        """Distinct plans evaluated: the one count of evaluated plans the CLI, estimate.json
        (search.trials) and the report show. trials lists an Optuna re-visit or a resumed
        study's rows again, and two points of the space can complete into the same plan (full
        recompute whose solver checkpoints no block is the no-recompute plan), so this is
        neither len(trials) nor the number of points visited."""
        return len({t.plan for t in self.trials})

    @property
    def front(self) -> list[Trial]:
        return pareto_front(self.trials)


def fits_nowhere(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, trials: list[Trial]) -> SpecError:
    """The one-line error when no plan fits. It names the leanest plan DeepSpeed can run (an
    interleaved or MiCS plan may need less, but nobody can start it) and, on a CPU cluster,
    the --scale that makes the model fit one."""
    runnable = [t for t in trials if not runtime_problems(t.plan, model)] or trials
    least = min(runnable, key=lambda t: t.needs_bytes)
    fix = "use more or larger devices, a shorter --seq-len, or a smaller model"
    if cluster.device.kind == "cpu" and not model.name.endswith("-tiny"):
        fix = (f"on a CPU machine use --scale tiny{'' if model.name.endswith('-small') else ' (or --scale small)'}: "
               "the same model family shrunk to run on CPUs; or a shorter --seq-len")
    why = f"needs {least.needs_bytes / GB:.1f} GB per device > {least.capacity_bytes / GB:.1f} GB"
    if least.needs_bytes <= least.capacity_bytes and least.reason:
        # it fits the device: what stops it is off the device (host memory, NVMe capacity)
        why = f"fits the device but {least.reason}"
        to_nvme = [t for t in runnable if t.needs_bytes <= t.capacity_bytes
                   and any(p.code == "nvme-capacity" for p in t.problems)]
        if to_nvme and least not in to_nvme:
            part = next(p for p in min(to_nvme, key=lambda t: t.needs_bytes).problems if p.code == "nvme-capacity")
            why += f"; with the states on NVMe instead, {part.line}"
        fix = "use more nodes, or a node with more host memory (--cpu-mem-gb) or NVMe (--nvme-gb)"
    return SpecError(
        "--model", f"{model.name} does not fit on {cluster.spec or cluster.world_size} with global batch "
        f"{train.global_batch} x {train.seq_len} tokens: the leanest plan DeepSpeed can run "
        f"({least.plan.describe()}) {why}", fix)


def search(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, *, exhaustive: bool = False,
           n_trials: int = 100, seed: int = 0, storage: object = None, progress: Progress | None = None,
           max_interleave: int | None = None, megatron_features: bool = False,
           runtime: str = "deepspeed", study_name: str | None = None,
           context_parallel: str = "auto", prune: int = 0) -> SearchResult:
    """Find the fastest plan that fits (the Optuna study `study_name` in `storage`; default
    a name derived from the inputs). Exhaustive with `prune` K > 0: the pruned sweep, the top K
    plans exact, only the points the bounds cannot discard estimated (docs/search.md). Raises
    SpecError (one line) when nothing fits anywhere.
    context_parallel: Space.context_parallel (on, off, or auto: from LONG_SEQUENCE tokens)."""
    t0 = time.perf_counter()
    extra = {} if max_interleave is None else {"max_interleave": max_interleave}
    if megatron_features:  # --megatron-features is the megatron-core runtime
        runtime = "megatron-core"
    space = Space(model=model, cluster=cluster, train=train, megatron_features=runtime == "megatron-core",
                  runtime=runtime, context_parallel=context_parallel, **extra)
    space.require_nonempty()
    evaluate = Evaluator(model, cluster, train, runtime=runtime)
    name = ""
    pruned = None
    if exhaustive and prune > 0:
        sweep = pruned_sweep(space, evaluate, top=prune, progress=progress)
        trials, pruned, method = sweep.trials, sweep.pruned, "exhaustive"
        if not any(t.feasible for t in trials):
            # nothing fits: the every-plan sweep finds the least memory any plan needs, to say so
            trials, pruned = run_exhaustive(space, evaluate), None
    elif exhaustive:
        trials = run_exhaustive(space, evaluate, progress)
        method = "exhaustive"
    else:
        from planner.search.optuna_search import optuna_search
        start = heuristic(space, evaluate)
        trials, study = optuna_search(space, evaluate, start, n_trials=n_trials, seed=seed,
                                      storage=storage, progress=progress,  # type: ignore[arg-type]
                                      study_name_=study_name)
        name = study.study_name
        method = "optuna"
        if not any(t.feasible for t in trials):
            # before saying "fits nowhere", make sure: the whole space is cheap to sweep
            everything = run_exhaustive(space, evaluate)
            if not any(t.feasible for t in everything):
                raise fits_nowhere(model, cluster, train, everything)
            trials = trials + [t for t in rank(everything)[:1]]
    ranked = rank(trials)
    if not ranked:
        raise fits_nowhere(model, cluster, train, trials)
    base_plan, base = conventional_baseline(model, cluster, train)
    return SearchResult(method=method, trials=tuple(trials), ranked=tuple(ranked), baseline_plan=base_plan,
                        baseline=base, space_size=space.size(), wall_s=time.perf_counter() - t0, study_name=name,
                        pruned=pruned)
