"""Optuna TPE over the outer choices; the exact solvers complete each trial.

The parallel layout is one categorical parameter ``layout`` ("tp4-pp8") over the legal
(TP, PP) pairs, so its choices never change within a study, as Optuna requires.
Each trial picks a shape: the parallel layout (TP x PP, one categorical) and the recompute
mode. Exact inner searches then choose the ZeRO stage, sequence parallelism and the schedule
(all tried), the micro-batch (a scan, smallest first, stopping where memory runs out), the
stage boundaries and the checkpointed blocks.
The sampler is seeded and the heuristic plan is enqueued first (``study.enqueue_trial``).
Infeasible trials score 0 tokens/s and report their memory excess as a constraint
(``trial.set_constraint``), so TPE learns where the memory wall is. The study lives in
any Optuna storage (SQLite in the run directory by default); its name is derived from the
inputs, so rerunning the same search resumes the same study: ``n_trials`` is the total the
study should reach, and the trials already in it are re-evaluated, not re-sampled.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Callable

import optuna

from planner.search.evaluate import Evaluator, Trial
from planner.search.space import Shape, Space

SPACE_VERSION = 2
"""Bump when parameter names or choices change, so old studies are not mixed with new ones."""


def study_name(space: Space) -> str:
    key = json.dumps({"model": space.model.to_dict(), "cluster": space.cluster.to_dict(),
                      "train": space.train.to_dict(), "max_interleave": space.max_interleave,
                      "megatron_features": space.megatron_features, "runtime": space.runtime,
                      "space_version": SPACE_VERSION}, sort_keys=True, default=str)
    return f"{space.model.name}-{space.cluster.world_size}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"


def suggest(trial: optuna.Trial, space: Space, layouts: list[tuple[int, int, int]]) -> Shape:
    """Draw one legal shape (every branch only offers legal values)."""
    layout = trial.suggest_categorical("layout", [_layout_name(t, p) for t, p, _ in layouts])
    tp, pp = _parse_layout(layout)
    return _complete(space, tp, pp, trial.suggest_categorical)


def _layout_name(tp: int, pp: int) -> str:
    return f"tp{tp}-pp{pp}"


def _parse_layout(name: str) -> tuple[int, int]:
    tp, pp = name.split("-")
    return int(tp[2:]), int(pp[2:])


def _complete(space: Space, tp: int, pp: int, pick: Callable[[str, Any], Any]) -> Shape:
    dp = space.cluster.world_size // (tp * pp)
    recompute = pick("recompute", list(space.recompute_modes()))
    return Shape(tp=tp, pp=pp, dp=dp, recompute=recompute)


def params_of(shape: Shape, space: Space) -> dict[str, Any]:
    """The Optuna parameters that make `suggest` return `shape` (for enqueue_trial)."""
    out: dict[str, Any] = {"layout": _layout_name(shape.tp, shape.pp)}
    values = {"recompute": shape.recompute}

    def pick(name: str, choices: Any) -> Any:
        out[name] = values[name]
        return out[name]

    _complete(space, shape.tp, shape.pp, pick)
    return out


def shape_from_params(params: dict[str, Any], space: Space) -> Shape:
    tp, pp = _parse_layout(params["layout"])
    return _complete(space, tp, pp, lambda name, choices: params[name])


def evaluate_shape(space: Space, evaluate: Evaluator, shape: Shape, source: str) -> list[Trial]:
    """The exact inner scan over micro-batches, smallest first. Memory grows with the
    micro-batch, so after the first one no stage split can fit, none of the larger can."""
    out = []
    for row in space.outers(shape):
        for outer in row:
            trial = evaluate(outer, source)
            out.append(trial)
            if trial.estimate is None:      # the solvers proved it cannot fit
                break
    return out


def optuna_search(space: Space, evaluate: Evaluator, start: Shape, *, n_trials: int, seed: int,
                  storage: str | optuna.storages.BaseStorage | None = None, study_name_: str | None = None,
                  progress: Callable[[int, int], None] | None = None) -> tuple[list[Trial], optuna.Study]:
    """Run (or resume) the study until it holds `n_trials` trials or every shape was tried.

    Returns every plan the study's trials evaluated (earlier runs included), in trial order."""
    layouts = space.require_nonempty()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=10)
    study = optuna.create_study(storage=storage, study_name=study_name_ or study_name(space),
                                sampler=sampler, direction="maximize", load_if_exists=True)
    study.enqueue_trial(params_of(start, space), skip_if_exists=True)
    total = sum(1 for _ in space.shapes())
    done = [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE]
    seen = {shape_from_params(t.params, space) for t in done}
    remaining = max(0, n_trials - len(done))

    def objective(trial: optuna.Trial) -> float:
        shape = suggest(trial, space, layouts)
        seen.add(shape)
        results = evaluate_shape(space, evaluate, shape, "heuristic" if shape == start else "optuna")
        best = max(results, key=lambda r: (r.feasible, r.tokens_per_s, -r.needs_bytes))
        # infeasible: 0 tokens/s, and the memory excess as a constraint TPE learns from
        trial.set_constraint("memory_excess_gb", 0.0 if best.feasible else
                             max(1e-3, (best.needs_bytes - best.capacity_bytes) / 1e9))
        trial.set_user_attr("best", {"micro_batch": best.plan.micro_batch, "feasible": best.feasible,
                                     "peak_memory_gb": best.needs_gb, "reason": best.reason})
        return best.tokens_per_s

    def callback(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        if progress is not None:
            progress(min(trial.number + 1, n_trials), n_trials)
        if len(seen) >= total:
            study.stop()

    if remaining and len(seen) < total:
        study.optimize(objective, n_trials=remaining, callbacks=[callback])
    # Polish: TPE lands near the optimum on flat landscapes but not always on it. Enqueue the
    # untried neighbours of the best shape as further trials until none is left (hill climbing).
    while len(seen) < total:
        best = _best_shape(study, space)
        if best is None:
            break
        todo = [n for n in neighbours(best, layouts, space) if n not in seen]
        if not todo:
            break
        for n in todo:
            study.enqueue_trial(params_of(n, space), skip_if_exists=True)
        study.optimize(objective, n_trials=len(todo))
    trials: list[Trial] = []
    for t in study.get_trials(deepcopy=False):
        if t.state == optuna.trial.TrialState.COMPLETE:
            shape = shape_from_params(t.params, space)
            trials += evaluate_shape(space, evaluate, shape, "heuristic" if shape == start else "optuna")
    return trials, study


def _best_shape(study: optuna.Study, space: Space) -> Shape | None:
    done = [t for t in study.get_trials(deepcopy=False)
            if t.state == optuna.trial.TrialState.COMPLETE and t.value is not None and t.value > 0]
    if not done:
        return None
    return shape_from_params(max(done, key=lambda t: t.value).params, space)


def neighbours(shape: Shape, layouts: list[tuple[int, int, int]], space: Space) -> list[Shape]:
    """Shapes one step away: every recompute mode on the same layout; every other PP at the
    same TP (stage balance makes throughput jagged in PP, so all of them); TP halved or
    doubled at the same PP or the same DP; each layout with every recompute mode."""
    legal = {(t, p): d for t, p, d in layouts}
    modes = space.recompute_modes()
    out = [Shape(tp=shape.tp, pp=shape.pp, dp=shape.dp, recompute=r) for r in modes]
    moves = [(shape.tp, p) for t, p in legal if t == shape.tp]
    for t in (shape.tp // 2, shape.tp * 2):
        moves += [(t, shape.pp), (t, shape.pp * shape.tp // t if t else 0)]
    for t, p in moves:
        if (t, p) in legal and (t, p) != (shape.tp, shape.pp):
            out += [Shape(tp=t, pp=p, dp=legal[(t, p)], recompute=r) for r in modes]
    return out
