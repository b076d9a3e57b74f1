"""Search: the legal plan space, exact inner solvers, Optuna over the outer choices."""
from planner.search.baseline import conventional_baseline
from planner.search.evaluate import Evaluator, Trial, pareto_front, rank
from planner.search.space import Outer, Space

__all__ = ["Evaluator", "Outer", "Space", "Trial", "conventional_baseline", "pareto_front", "rank"]
