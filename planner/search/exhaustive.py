"""`--exhaustive`: evaluate every legal outer point of the space (the ground truth Optuna is
checked against). Each point gets the exact inner solvers, so this covers every legal plan
of the space up to the (provably optimal) stage split and checkpoint placement."""
from __future__ import annotations

from typing import Callable

from planner.search.evaluate import Evaluator, Trial
from planner.search.space import Space


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
