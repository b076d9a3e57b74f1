"""`--exhaustive`: evaluate every legal outer point of the space (the ground truth Optuna is
checked against). Each point gets the exact inner solvers, so this covers every legal plan
of the space up to the (provably optimal) stage split and checkpoint placement.

pruned_sweep returns the same top plans, in the same order, while fully estimating only the
points that might be among them (planner.search.bounds; docs/search.md)."""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable

from planner.search.bounds import Bounds
from planner.search.evaluate import Evaluator, Trial, best_of
from planner.search.space import Space
from planner.specs.validate import runtime_problems


def exhaustive(space: Space, evaluate: Evaluator,
               progress: Callable[[int, int], None] | None = None) -> list[Trial]:
    points = list(space.points())
    trials = []
    for i, outer in enumerate(points):
        trials.append(evaluate(outer, "exhaustive"))
        if progress is not None and i % 256 == 255:
            progress(i + 1, len(points))
    if progress is not None:
        progress(len(points), len(points))
    return trials


PRUNED = ("rules", "memory", "micro-batch", "throughput")
"""Why a (point, precision) was not estimated (Sweep.pruned keys):

- rules: its row's plan breaks a rule of the runtime (planner.specs.validate.runtime_problems:
  DeepSpeed has no interleaved schedule, no ring attention, no MiCS), so it is never feasible;
- memory: the memory lower bound (Bounds.memory_lower) exceeds the device;
- micro-batch: a smaller micro-batch of its row already fits no stage split, and memory grows
  with the micro-batch (the premise of the Optuna scan, optuna_search.evaluate_shape);
- throughput: its tokens/s upper bound (Bounds.tokens_upper) is below the top-th fastest
  distinct feasible plan found so far."""


@dataclass(slots=True)
class Sweep:
    """A pruned exhaustive sweep: the trials it estimated and what it skipped, by reason."""

    trials: list[Trial]
    """One per outer point with at least one precision estimated, in the space's order."""
    points: int
    """Outer points in the space."""
    candidates: int
    """(point, precision) pairs: points x the precisions the evaluator searches."""
    estimated: int = 0
    pruned: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PRUNED, 0))


def pruned_sweep(space: Space, evaluate: Evaluator, top: int = 10,
                 progress: Callable[[int, int], None] | None = None) -> Sweep:
    """Every legal (point, precision) either estimated or discarded by a bound that proves it
    is not among the `top` fastest distinct feasible plans, so that rank(sweep.trials)[:top]
    equals rank(exhaustive(...))[:top], order included.

    Rows (one ZeRO / variant / EP / CP / SP / schedule choice of a shape, every micro-batch,
    smallest first) are visited in decreasing order of their best tokens/s upper bound, so
    the top plans are found early and the rest fall below the bound; once a row's best upper
    bound is below the top-th plan found, so are all the rows after it."""
    bounds = Bounds(space.model, space.cluster, space.train, evaluate.runtime)
    precisions = evaluate.precisions
    rows = []  # (best upper bound, order, precision, [(upper bound, index, outer)])
    index = 0
    for shape in space.shapes():
        for row in space.outers(shape):
            if not row:
                continue
            ranked = []
            for outer in row:
                ranked.append((index, outer))
                index += 1
            for j, precision in enumerate(precisions):
                cells = [(bounds.tokens_upper(o, precision), i, o) for i, o in ranked]
                rows.append((max(c[0] for c in cells), len(rows), precision, cells))
    sweep = Sweep(trials=[], points=index, candidates=index * len(precisions))
    rows.sort(key=lambda r: (-r[0], r[1]))
    capacity = evaluate.capacity
    best: list[float] = []  # the top fastest distinct feasible plans' tokens/s (a min-heap)
    seen: set = set()
    done: dict[int, list[Trial]] = {}
    rule_checked: dict[tuple, bool] = {}
    pruned = sweep.pruned

    def bar() -> float:
        return best[0] if len(best) >= top else 0.0

    for visited, (upper, _, precision, cells) in enumerate(rows):
        if progress is not None and visited % 256 == 0:
            progress(visited, len(rows))
        if upper < bar():
            pruned["throughput"] += sum(len(r[3]) for r in rows[visited:])
            break
        head = cells[0][2]
        if not evaluate.megatron_features:
            key = (head, precision)
            if key not in rule_checked:
                rule_checked[key] = bool(runtime_problems(head.plan(precision, runtime=evaluate.runtime), evaluate.model))
            if rule_checked[key]:
                pruned["rules"] += len(cells)
                continue
        if bounds.memory_lower(head, precision) > capacity:
            pruned["memory"] += len(cells)
            continue
        for n, (ub, i, outer) in enumerate(cells):
            if ub < bar():
                pruned["throughput"] += 1
                continue
            trial = evaluate.evaluate_in(outer, precision, "exhaustive")
            sweep.estimated += 1
            done.setdefault(i, []).append(trial)
            if trial.estimate is None:  # no split fits: nor with any larger micro-batch
                pruned["micro-batch"] += len(cells) - n - 1
                break
            if trial.feasible and trial.plan not in seen:
                seen.add(trial.plan)
                if len(best) < top:
                    heapq.heappush(best, trial.tokens_per_s)
                elif trial.tokens_per_s > best[0]:
                    heapq.heapreplace(best, trial.tokens_per_s)
    if progress is not None:
        progress(len(rows), len(rows))
    order = {p: j for j, p in enumerate(precisions)}
    sweep.trials = [best_of(sorted(done[i], key=lambda t: order[t.plan.precision])) for i in sorted(done)]
    return sweep
