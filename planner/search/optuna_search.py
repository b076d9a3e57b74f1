"""Optuna TPE over the outer choices; the exact solvers complete each trial.

The space is conditional: the PP choices depend on TP, the micro-batch choices on DP, the
ZeRO stages on PP. Each conditional parameter gets a name that includes its condition
(e.g. ``micro_batch|dp=24``), so every name always has the same choices -- what Optuna's
categorical distributions require -- and TPE learns each branch separately.

The sampler is seeded and the heuristic plan is enqueued first (``study.enqueue_trial``).
Infeasible trials score 0 tokens/s and report their memory excess as a constraint
(TPESampler ``constraints_func``), so TPE learns where the memory wall is. The study lives in
any Optuna storage (SQLite in the run directory by default); its name is derived from the
inputs, so rerunning the same search resumes the same study: ``n_trials`` is the total the
study should reach, and the trials already in it are re-evaluated, not re-sampled.
"""
from __future__ import annotations

import hashlib
import json
import warnings
from typing import Any, Callable

import optuna

from planner.search.evaluate import Evaluator, Trial
from planner.search.space import Outer, Space
from planner.specs.plan import RECOMPUTE

SPACE_VERSION = 1
"""Bump when parameter names or choices change, so old studies are not mixed with new ones."""


def study_name(space: Space) -> str:
    key = json.dumps({"model": space.model.to_dict(), "cluster": space.cluster.to_dict(),
                      "train": space.train.to_dict(), "max_interleave": space.max_interleave,
                      "space_version": SPACE_VERSION}, sort_keys=True, default=str)
    return f"{space.model.name}-{space.cluster.world_size}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"


def suggest(trial: optuna.Trial, space: Space, layouts: list[tuple[int, int, int]]) -> Outer:
    """Draw one legal outer point (every branch only offers legal values)."""
    tp = trial.suggest_categorical("tp", sorted({t for t, _, _ in layouts}))
    pp = trial.suggest_categorical(f"pp|tp={tp}", sorted(p for t, p, _ in layouts if t == tp))
    dp = space.cluster.world_size // (tp * pp)
    return _complete(space, tp, pp, dp, trial.suggest_categorical)


def _complete(space: Space, tp: int, pp: int, dp: int, pick: Callable[[str, Any], Any]) -> Outer:
    zero = pick("zero" if pp == 1 else "zero|pp>1", list(space.zero_stages(pp)))
    mb = pick(f"micro_batch|dp={dp}", space.micro_batches(dp))
    ga = space.train.global_batch // (dp * mb)
    recompute = pick("recompute", list(RECOMPUTE))
    sps = space.sequence_parallel(tp)
    sp = pick("sequence_parallel", [False, True]) if len(sps) > 1 else False
    vs = space.interleaves(pp, ga)
    v = pick(f"interleave|pp={pp}", vs) if len(vs) > 1 else 1
    return Outer(tp=tp, pp=pp, dp=dp, zero=zero, micro_batch=mb, grad_accum=ga, recompute=recompute,
                 sequence_parallel=sp, interleave=v)


def params_of(outer: Outer, space: Space) -> dict[str, Any]:
    """The Optuna parameters that make `suggest` return `outer` (for enqueue_trial)."""
    out: dict[str, Any] = {"tp": outer.tp, f"pp|tp={outer.tp}": outer.pp}

    def pick(name: str, choices: Any) -> Any:
        value = {"zero": outer.zero, "zero|pp>1": outer.zero, "recompute": outer.recompute,
                 "sequence_parallel": outer.sequence_parallel}.get(name)
        if name.startswith("micro_batch|"):
            value = outer.micro_batch
        elif name.startswith("interleave|"):
            value = outer.interleave
        out[name] = value
        return value

    _complete(space, outer.tp, outer.pp, outer.dp, pick)
    return out


def outer_from_params(params: dict[str, Any], space: Space) -> Outer:
    tp = params["tp"]
    pp = params[f"pp|tp={tp}"]
    return _complete(space, tp, pp, space.cluster.world_size // (tp * pp), lambda name, choices: params[name])


def _constraints(frozen: optuna.trial.FrozenTrial) -> tuple[float]:
    return (float(frozen.user_attrs.get("excess_gb", 0.0)),)


def optuna_search(space: Space, evaluate: Evaluator, start: Outer, *, n_trials: int = 200, seed: int = 0,
                  storage: str | optuna.storages.BaseStorage | None = None, study_name_: str | None = None,
                  progress: Callable[[int, int], None] | None = None) -> tuple[list[Trial], optuna.Study]:
    """Run (or resume) the study until it holds `n_trials` trials or the space is exhausted.

    Returns every trial of the study (earlier runs included), evaluated, in trial order."""
    layouts = space.require_nonempty()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler = optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True,
                                             constraints_func=_constraints, n_startup_trials=20)
    study = optuna.create_study(storage=storage, study_name=study_name_ or study_name(space),
                                sampler=sampler, direction="maximize", load_if_exists=True)
    study.set_user_attr("space_size", space.size())
    study.enqueue_trial(params_of(start, space), skip_if_exists=True)
    total = space.size()
    seen: set[Outer] = set()
    done = [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE]
    for t in done:
        seen.add(outer_from_params(t.params, space))
    remaining = max(0, n_trials - len(done))

    def objective(trial: optuna.Trial) -> float:
        outer = suggest(trial, space, layouts)
        seen.add(outer)
        result = evaluate(outer, "heuristic" if outer == start else "optuna")
        trial.set_user_attr("feasible", result.feasible)
        trial.set_user_attr("peak_memory_gb", result.needs_gb)
        trial.set_user_attr("excess_gb", 0.0 if result.feasible else max(1e-3, (result.needs_bytes
                                                                                  - result.capacity_bytes) / 1e9))
        trial.set_user_attr("reason", result.reason)
        trial.set_user_attr("plan", result.plan.to_dict())
        return result.tokens_per_s

    def callback(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        if progress is not None:
            progress(min(trial.number + 1, n_trials), n_trials)
        if len(seen) >= total:
            study.stop()

    if remaining and len(seen) < total:
        study.optimize(objective, n_trials=remaining, callbacks=[callback], gc_after_trial=False)
    trials = []
    for t in study.get_trials(deepcopy=False):
        if t.state != optuna.trial.TrialState.COMPLETE:
            continue
        outer = outer_from_params(t.params, space)
        source = "heuristic" if outer == start else "optuna"
        trials.append(evaluate(outer, source))
    return trials, study
