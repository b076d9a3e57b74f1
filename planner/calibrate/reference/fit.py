"""What `planner calibrate --reference` fits on DeepSpeed's published runs: one set of named
factors per GPU generation (never one per row), which factors (BASE_FACTORS plus every time factor
planner/cost/factors.py gained since, less PHYSICS), their bounds, and the fit itself through the
package's one fitter (planner/calibrate/solver.py fit_relative: Levenberg-Marquardt polished by
Nelder-Mead, several starts; leave-one-out refits warm-started at the full fit, in a fork pool).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from planner.calibrate.fit import ADDITIVE, FRACTIONS, with_factors
from planner.calibrate.reference.rows import Row, predict, unrepresented
from planner.calibrate.solver import Additive, Bounded, Logit, Param, fit_relative, leave_out, pmap
from planner.cost.factors import Factors, factor
from planner.specs import find_device
from planner.specs.hardware import DeviceProfile

BASE_FACTORS = ("compute_scale", "dp_overlap", "step_overhead_s", "microbatch_overhead_s")
"""Fitted per generation by default, plus every time factor planner/cost/factors.py gained after
this script was written (the ZeRO-3 fetch, offload ... factors) except PHYSICS."""
PHYSICS = ("comm_efficiency", "latency_scale")
"""Not fitted: communication is measured per link class (profiles/links/classes.json, the profiles'
per-step latencies: benchmarks/link_curves.py), so both stay at 1.0."""
CAPS = {"step_overhead_s": 0.05}
"""Additive factors that may not grow past a bound (issue 19 item 4: any remaining constant
<= 50 ms; the time it stood for is physics now)."""
KNOWN_FACTORS = frozenset({"compute_scale", "attention_scale", "elementwise_scale", "comm_efficiency", "dp_overlap",
                           "step_overhead_s", "microbatch_overhead_s", "optimizer_scale", "activation_scale",
                           "memory_overhead_gb", "memory_fragmentation"})
MEMORY_WORDS = ("memory", "fragmentation", "activation_scale", "_gb", "bytes")
UNITS = {"step_overhead_s": 0.01, "microbatch_overhead_s": 0.01, "zero3_fetch_overhead_s": 1e-4}
"""Scale of the additive factors (seconds; an unknown one 1e-4 s): the ridge costs lam x (value / unit)^2."""
LAM = 1e-4
"""Ridge weight toward the generation's anchor (fit_factors), per unit of transformed factor, on the scale
of the mean squared log error (a unit step of z costs 1e-4: 1% of a 1% MSLE): enough to hold a
factor the rows do not determine, too little to move one they do."""
FTOL, XTOL = 1e-9, 1e-7
"""Levenberg-Marquardt's stopping tolerances (relative cost change, step): far below the rows'
own uncertainty, far above what costs iterations for nothing."""
STARTS = 4
"""Starting points per generation's fit (leave-one-out refits warm-start from the full fit)."""
LOO_NM = 20
"""Nelder-Mead evaluations per factor in a leave-one-out refit (its start is already near)."""


PER_GENERATION = {"network_efficiency": ("A100",)}
"""Factors fitted only for the generations whose sources determine them. network_efficiency:
A100's network rows come from two sources on two fabrics (A: Omni-Path on Jean Zay, B:
InfiniBand on Azure), and leaving either out keeps it near (A: 3.5%, B: 6.9% leave-one-source-
out); V100's (A13, C, E) do not determine it: fitted on them it reaches 1.38 (a network faster
than stated) and leaving C out sends C's error to 470%. V100 keeps the measured class efficiency."""


def default_factor_names(gen: str | None = None) -> tuple[str, ...]:
    # in the factors' declared order (planner/cost/factors.py Factors): DEFAULTS iterates a
    # frozenset, whose order changes with PYTHONHASHSEED, and the order of the fitted names sets
    # Levenberg-Marquardt's path (the fit's last digits and its iteration count)
    new = tuple(n for n in Factors.names() if n not in KNOWN_FACTORS and n not in PHYSICS
                and not any(w in n for w in MEMORY_WORDS) and (gen in PER_GENERATION.get(n, (gen,))))
    return BASE_FACTORS + new


BOUNDS = {"compute_scale": (0.5, 4.0), "attention_scale": (0.25, 8.0), "elementwise_scale": (0.25, 8.0),
          "comm_efficiency": (0.05, 1.0 / 0.9), "latency_scale": (0.05, 50.0), "cpu_adam_scale": (0.2, 5.0),
          "optimizer_scale": (0.25, 8.0)}
"""Physical ranges of the multipliers. comm_efficiency may reach 1/0.9: the links here are
stated at 0.825-0.9 of their line rate (the profiles take 0.9), so 1/0.9 is about the line rate."""


def transform(name: str, device: DeviceProfile) -> Param:
    """logit for dp_overlap (as planner.calibrate.fit does); multipliers bounded to BOUNDS (an
    unknown one to 1/20..20 x its value); seconds and factors that sit at 0 additive (value =
    unit x |z|: planner.calibrate.fit's softplus has slope ~1e-3 at 0, where these start, and the
    ridge would then hold them there whatever the rows say). The parametrisations are
    planner/calibrate/solver.py's."""
    v = factor_value(device, name)
    if name in FRACTIONS:
        return Logit(name)
    if name in ADDITIVE or v <= 0 or name.endswith(("_s", "_us", "_ms", "_gb")):
        return Additive(name, UNITS.get(name, 1e-4 if name.endswith("_s") else 1.0), CAPS.get(name, math.inf))
    lo, hi = BOUNDS.get(name, (v / 20.0, v * 20.0))
    return Bounded(name, min(lo, v / 1.01), max(hi, v * 1.01))


def factor_value(device: DeviceProfile, name: str) -> float:
    return factor(device, name)


@dataclass(frozen=True, slots=True, kw_only=True)
class Fit:
    factors: dict[str, float]
    sensitivity: dict[str, float]
    """Mean |d log(prediction) / d z| over the fitted rows at the solution (z: the transformed
    factor: logit of its place between its bounds for multipliers, logit for fractions,
    value / unit for seconds)."""
    determination: dict[str, float]
    """How much the rows rather than the ridge set each factor: info / (info + lam), info the
    rows' curvature of the mean squared log error along z (sum of squared Jacobian entries).
    Below 0.5 the ridge decides: the rows do not determine the factor and it stays near the
    anchor."""
    msle: float
    cost: float
    """The minimised objective: 0.5 (MSLE + lam |z - z_anchor|^2)."""
    iterations: int
    at_bound: list[str] = dataclasses.field(default_factory=list)
    """Multipliers that ended at a bound of BOUNDS (the rows push them past what is physical)."""


def fit_factors(rows: Sequence[Row], device: DeviceProfile, names: Sequence[str], *, lam: float = LAM,
                start: Mapping[str, float] | None = None, starts: int = 1, perturbations: Sequence[int] = (),
                nm_evals: int = 0, predictor: Callable[[Row, DeviceProfile], float] = predict,
                anchor: Mapping[str, float] | None = None) -> Fit:
    """One set of `names` for all `rows` (one generation): minimise mean log(pred/meas)^2 +
    lam |z - z_anchor|^2 by Levenberg-Marquardt (planner/calibrate/solver.py) polished by
    Nelder-Mead, from `start` (default: the anchor) and from more points drawn uniformly within
    +-2 of it in z (seeds 1 .. starts - 1, or `perturbations`; seed 0 is `start` itself); the
    lowest cost wins (the cost model's max/min kinks leave corners and shallow local minima).
    `anchor`: the values the ridge pulls toward and the bounds are drawn around, by name (the
    generation's `anchor` in profiles/reference/deepspeed-rows.json); a name it lacks takes the
    profile's value. With a fixed anchor the fit does not depend on what the profile holds, so
    `planner calibrate --reference` run on the factors it wrote returns them."""
    device = with_factors(device, {n: float(anchor[n]) for n in names if n in (anchor or {})})
    tr = [transform(n, device) for n in names]
    meas = np.array([r.measured for r in rows])
    scale = 1.0 / math.sqrt(len(rows))
    fit = fit_relative(lambda v: [predictor(r, with_factors(device, v)) for r in rows], meas, tr,
                       {n: factor_value(device, n) for n in names}, start=start, lam=lam, weight=scale,
                       seeds=list(perturbations) or list(range(starts)), polish=True, nm_evals=nm_evals,
                       ftol=FTOL, xtol=XTOL)
    sol, values = fit.solution, fit.values
    after = with_factors(device, values)
    r = scale * np.log(np.array([max(predictor(x, after), 1e-30) for x in rows]) / meas) / scale
    jac = sol.jacobian[:len(rows)]
    sens = np.abs(jac).mean(axis=0) / scale
    info = (jac ** 2).sum(axis=0)
    at_bound = [t.name for t in tr if isinstance(t, Bounded) and t.at_bound(values[t.name])]
    return Fit(factors=values, sensitivity={n: float(x) for n, x in zip(names, sens)},
               determination={n: float(i / (i + lam)) if i + lam > 0 else 0.0 for n, i in zip(names, info)},
               msle=float(np.mean(r ** 2)), cost=sol.cost, iterations=fit.iterations, at_bound=at_bound)


_STATE: dict[str, Any] = {}
"""What the pool's workers read: per generation its fitted rows, device, factor names, lam and
(for leave-one-out) the full fit to start from. Set before the pool forks."""


def _task(task: tuple[str, str, int]) -> Any:
    kind, gen, i = task
    g = _STATE[gen]
    if kind == "start":  # one starting point of the generation's full fit
        return fit_factors(g["fitted"], g["device"], g["names"], lam=g["lam"], perturbations=(i,), anchor=g["anchor"])
    rows = [r for j, r in enumerate(g["fitted"]) if j != i]  # leave row i out, warm-start at the full fit
    f = fit_factors(rows, g["device"], g["names"], lam=g["lam"], start=g["start"], nm_evals=LOO_NM * len(g["names"]),
                    anchor=g["anchor"])
    return predict(g["fitted"][i], with_factors(g["device"], f.factors)), f.factors


def fit_generations(meta: Mapping[str, Any], rows: Sequence[Row], *, factor_names: Mapping[str, Sequence[str]] | None,
                    lam: float, loo: bool, jobs: int, starts: int) -> tuple[dict[str, dict[str, Any]],
                                                                            dict[str, list[Fit]], dict]:
    """Per generation of `meta`: its rows, the variants the cost model misses, the rows fitted,
    the names, and the best of `starts` fits (the state _task reads); every start's fit; and,
    with `loo`, each fitted row's (held-out prediction, factors) keyed ("loo", gen, i)."""
    _STATE.clear()
    for gen, ginfo in meta["generations"].items():
        device, _ = find_device(ginfo["profile"])
        grows = [r for r in rows if r.gen == gen]
        missing = {r.id: unrepresented(r, device) for r in grows}
        fitted = [r for r in grows if r.fit and not (r.needs_variant and missing[r.id])]
        _STATE[gen] = {"device": device, "rows": grows, "missing": missing, "fitted": fitted, "lam": lam,
                       "names": tuple((factor_names or {}).get(gen, default_factor_names(gen))),
                       "anchor": dict(ginfo.get("anchor", {}))}
    fits: dict[str, list[Fit]] = {}
    for (_, gen, _), f in zip(tasks := [("start", g, k) for g in _STATE for k in range(starts)],
                              pmap(_task, tasks, jobs)):
        fits.setdefault(gen, []).append(f)
    for gen in _STATE:
        _STATE[gen]["fit"] = min(fits[gen], key=lambda f: f.cost)
        _STATE[gen]["start"] = _STATE[gen]["fit"].factors
    loo_tasks = [("loo", g, i) for g in _STATE for i in range(len(_STATE[g]["fitted"]))] if loo else []
    return _STATE, fits, leave_out(loo_tasks, _task, jobs=jobs)
