"""The heuristic plan Optuna starts from (enqueued as its first trial).

Megatron-LM's rule of thumb (Narayanan et al. 2021, arXiv 2104.04473, sec. 3.3 "Takeaway #1
and #2"): tensor parallelism up to the devices of a node, pipeline parallelism only as far as
needed to fit the model, data parallelism for the rest; small micro-batches; here with ZeRO-1
(optimizer states sharded over DP at no extra traffic), selective recompute (where the
attention kernel stores its scores; with flash, no recompute first) and sequence
parallelism wherever TP > 1 (Korthikanti et al. 2022; the executor's TP layers run it). The
smallest PP whose solved plan fits wins.
"""
from __future__ import annotations

from planner.search.evaluate import Evaluator
from planner.search.space import Shape, Space


def heuristic(space: Space, evaluate: Evaluator) -> Shape:
    layouts = space.require_nonempty()
    tp = max(t for t, _, _ in layouts)
    fallback: Shape | None = None
    # selective recompute where it saves memory (an eager attention core), else none first
    for recompute in ("selective" if "selective" in space.recompute_modes() else "none", "full"):
        for t, pp, dp in sorted((x for x in layouts if x[0] == tp), key=lambda x: x[1]):
            shape = Shape(tp=t, pp=pp, dp=dp, recompute=recompute)
            fallback = fallback or shape
            sp = max(space.sequence_parallel(t))
            outer = shape.outer(1, space.train.global_batch // dp, sp, zero=1 if dp > 1 else 0)
            if evaluate(outer, "heuristic").feasible:
                return shape
    assert fallback is not None
    return fallback
