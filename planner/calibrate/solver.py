"""The package's one fitter: named factors fitted by least squares on relative error, inside
bounds, and the held-out loop that reports how well a fit predicts what it did not see.

Every factor fit in planner calls this module: the training calibration on measured runs
(planner/calibrate/fit.py), the per-generation fit on DeepSpeed's published runs
(planner/calibrate/reference/, `planner calibrate --reference`), and the serving factors
(planner/serve/calibrate.py). numpy only; scipy is not a dependency.

- `fit_relative`: a model's factors, each mapped to an unconstrained z by its parametrisation
  (Log, Logit, Softplus, Bounded, Additive: the bounds), minimising
  0.5 (sum (w log(pred/meas))^2 + lam |z - z_prior|^2): Levenberg-Marquardt
  (`least_squares`), optionally polished by Nelder-Mead (`nelder_mead`) where the cost model's
  max/min kinks stop LM at a corner, from one or more starting points.
- `linear_relative`: the same problem when the prediction is linear in the factors (the
  serving step time once each max() side is known): weighted linear least squares on relative
  error with lower bounds (a coefficient that comes out negative is 0 or keeps its value).
- `line_relative`: the two-coefficient case, a straight line y = slope x + intercept on relative
  error with the intercept kept >= 0 (the profiler's block scale/overhead and its alpha-beta
  collective fit, benchmarks/link_curves.py's fit of vidur's NCCL curves).
- `golden_section`: a 1-D minimiser for a loss that is not a sum of squares
  (benchmarks/fidelity.py: a runtime's compute_scale minimising the mean per-source MAPE).
- `leave_out`: each group (a run, a row, a source) held out in turn, refitted without it and
  predicted; `pmap` runs the refits in a fork pool.

Levenberg 1944, Marquardt 1963; the scaled damping diag(J^T J) and the accept/reject rule
follow Nocedal & Wright, "Numerical Optimization" (2nd ed.), section 10.3. The Jacobian is
taken by forward differences, which is enough for the smooth, cheap cost model. Nelder & Mead
1965 with the standard coefficients of Lagarias et al. 1998. Golden-section search: Kiefer 1953
("Sequential minimax search for a maximum").
"""
from __future__ import annotations

import concurrent.futures as cf
import math
import multiprocessing
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence, TypeVar

import numpy as np

K = TypeVar("K", bound=Hashable)

# --- the numerics ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Solution:
    x: np.ndarray
    cost: float
    """0.5 * sum of squared residuals at x."""
    iterations: int
    converged: bool
    jacobian: np.ndarray


def jacobian(fun: Callable[[np.ndarray], np.ndarray], x: np.ndarray, r: np.ndarray) -> np.ndarray:
    j = np.empty((r.size, x.size))
    for i in range(x.size):
        step = 1e-6 * max(1.0, abs(x[i]))
        xp = x.copy()
        xp[i] += step
        j[:, i] = (fun(xp) - r) / step
    return j


def least_squares(fun: Callable[[np.ndarray], np.ndarray], x0: np.ndarray, *, max_iter: int = 200,
                  ftol: float = 1e-12, xtol: float = 1e-10) -> Solution:
    """Minimise 0.5 ||fun(x)||^2 from x0 (Levenberg-Marquardt)."""
    x = np.asarray(x0, dtype=float).copy()
    r = fun(x)
    cost = 0.5 * float(r @ r)
    lam = 1e-3
    j = jacobian(fun, x, r)
    for it in range(1, max_iter + 1):
        a = j.T @ j
        g = j.T @ r
        damp = lam * np.diag(np.maximum(np.diag(a), 1e-12))
        try:
            dx = np.linalg.solve(a + damp, -g)
        except np.linalg.LinAlgError:
            dx = np.linalg.lstsq(a + damp, -g, rcond=None)[0]
        r_new = fun(x + dx)
        cost_new = 0.5 * float(r_new @ r_new)
        if np.isfinite(cost_new) and cost_new < cost:
            done = (cost - cost_new) <= ftol * max(cost, 1e-300) or np.linalg.norm(dx) <= xtol * (xtol + np.linalg.norm(x))
            x, r, cost = x + dx, r_new, cost_new
            lam = max(lam / 3.0, 1e-12)
            j = jacobian(fun, x, r)
            if done:
                return Solution(x, cost, it, True, j)
        else:
            lam *= 4.0
            if lam > 1e12:
                return Solution(x, cost, it, True, j)
    return Solution(x, cost, max_iter, False, j)


def nelder_mead(f: Callable[[np.ndarray], float], x0: np.ndarray, *, step: float = 0.3, max_evals: int = 0,
                tol: float = 1e-10) -> tuple[np.ndarray, float, int]:
    """Minimise f from x0 with the Nelder-Mead simplex (reflection 1, expansion 2, contraction
    1/2, shrink 1/2). Returns (x, f(x), evaluations); stops after max_evals (default 40 x
    dimensions) or when the simplex's values agree within tol."""
    n = len(x0)
    max_evals = max_evals or 40 * n
    pts = [np.asarray(x0, dtype=float)] + [x0 + step * np.eye(n)[i] for i in range(n)]
    vals = [f(p) for p in pts]
    evals = n + 1
    while evals < max_evals:
        order = np.argsort(vals)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if vals[-1] - vals[0] <= tol * max(abs(vals[0]), 1e-30):
            break
        centre = np.mean(pts[:-1], axis=0)
        xr = centre + (centre - pts[-1])
        fr = f(xr)
        evals += 1
        if fr < vals[0]:
            xe = centre + 2.0 * (centre - pts[-1])
            fe = f(xe)
            evals += 1
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = centre + 0.5 * ((xr if fr < vals[-1] else pts[-1]) - centre)
            fc = f(xc)
            evals += 1
            if fc < min(fr, vals[-1]):
                pts[-1], vals[-1] = xc, fc
            else:
                pts = [pts[0]] + [pts[0] + 0.5 * (p - pts[0]) for p in pts[1:]]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
                evals += n
    i = int(np.argmin(vals))
    return pts[i], vals[i], evals


# --- parametrisations: a factor's value <-> an unconstrained z (the bounds) -------------------


def _softplus(z: float) -> float:
    return z + math.log1p(math.exp(-z)) if z > 0 else math.log1p(math.exp(z))


def _softplus_inv(v: float) -> float:
    return v + math.log(-math.expm1(-v)) if v < 30 else v


class Log:
    """A positive multiplier: value = exp(z)."""

    kind = "log"

    def __init__(self, name: str) -> None:
        self.name = name

    def to_z(self, v: float) -> float:
        return math.log(v)

    def value(self, z: float) -> float:
        return math.exp(max(min(z, 50.0), -50.0))


class Logit:
    """A fraction in (0, 1): value = sigmoid(z)."""

    kind = "logit"

    def __init__(self, name: str) -> None:
        self.name = name

    def to_z(self, v: float) -> float:
        v = min(max(v, 1e-4), 1 - 1e-4)
        return math.log(v / (1 - v))

    def value(self, z: float) -> float:
        return 1 / (1 + math.exp(-max(min(z, 50.0), -50.0)))


class Softplus:
    """A non-negative term (seconds, GB) that may be 0: value = unit x softplus(z), whose slope
    does not vanish near 0 as a log's would (an overhead started at ~0 in log space never grows)."""

    kind = "softplus"

    def __init__(self, name: str, unit: float) -> None:
        self.name, self.unit = name, unit

    def to_z(self, v: float) -> float:
        return _softplus_inv(max(v / self.unit, 1e-3))

    def value(self, z: float) -> float:
        return float(self.unit * _softplus(max(min(z, 50.0), -50.0)))


class Bounded:
    """A multiplier kept inside (lo, hi): value = exp(log lo + (log hi - log lo) sigmoid(z))."""

    kind = "bounded"

    def __init__(self, name: str, lo: float, hi: float) -> None:
        self.name, self.lo, self.hi = name, math.log(lo), math.log(hi)

    def to_z(self, v: float) -> float:
        u = (math.log(v) - self.lo) / (self.hi - self.lo)
        u = min(max(u, 1e-4), 1 - 1e-4)
        return math.log(u / (1 - u))

    def value(self, z: float) -> float:
        z = max(min(z, 50.0), -50.0)
        return math.exp(self.lo + (self.hi - self.lo) / (1 + math.exp(-z)))

    def at_bound(self, v: float, within: float = 0.01) -> bool:
        return min(abs(math.log(v) - self.lo), abs(math.log(v) - self.hi)) < within


class Additive:
    """A non-negative term (seconds) that starts at 0: value = unit x |z|, capped. Its slope does
    not vanish at 0 (Softplus's is ~1e-3 there, and a ridge then holds the factor at 0 whatever
    the observations say)."""

    kind = "additive"

    def __init__(self, name: str, unit: float, cap: float = math.inf) -> None:
        self.name, self.unit, self.cap = name, unit, cap

    def to_z(self, v: float) -> float:
        return min(max(v, 0.0), self.cap) / self.unit

    def value(self, z: float) -> float:
        return min(self.unit * abs(z), self.cap)


Param = Log | Logit | Softplus | Bounded | Additive


# --- the nonlinear fit ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fitted:
    values: dict[str, float]
    """The fitted factor values by name."""
    solution: Solution
    """The best start's solution (x in z; jacobian of every residual: weighted observations, then the ridge)."""
    iterations: int
    """LM iterations and Nelder-Mead evaluations over every start."""


def fit_relative(predict: Callable[[dict[str, float]], Sequence[float]], measured: Sequence[float],
                 params: Sequence[Param], prior: dict[str, float], *, start: dict[str, float] | None = None,
                 lam: float, weight: float = 1.0, seeds: Sequence[int] = (0,), polish: bool = False,
                 nm_evals: int = 0, ftol: float = 1e-12, xtol: float = 1e-10) -> Fitted:
    """Factors `params` (by name) minimising 0.5 (sum (weight log(pred / meas))^2 + lam
    |z - z(prior)|^2), pred = predict(values) for every observation. Levenberg-Marquardt from
    `start` (default `prior`) and, for each further seed k, from a point drawn uniformly within
    +-2 of it in z (numpy default_rng(k)); with `polish`, each LM result is walked off a corner by
    Nelder-Mead (`nm_evals` evaluations, default 40 per factor) and LM restarted there. The
    lowest cost wins. The ridge keeps a factor the observations do not determine at its prior
    (Tikhonov regularisation)."""
    meas = np.asarray(measured, dtype=float)
    z_prior = np.array([p.to_z(prior[p.name]) for p in params])
    z0 = z_prior if start is None else np.array([p.to_z(start[p.name]) for p in params])
    ridge = math.sqrt(lam)

    def values(z: np.ndarray) -> dict[str, float]:
        return {p.name: p.value(zi) for p, zi in zip(params, z)}

    def resid(z: np.ndarray) -> np.ndarray:
        pred = np.array([max(v, 1e-30) for v in predict(values(z))])
        return np.concatenate([weight * np.log(pred / meas), ridge * (z - z_prior)])

    def solve(z: np.ndarray) -> Solution:
        first = least_squares(resid, z, ftol=ftol, xtol=xtol)
        if not polish:
            return first
        z2, c2, evals = nelder_mead(lambda x: 0.5 * float(resid(x) @ resid(x)), first.x, max_evals=nm_evals)
        if c2 >= first.cost * (1 - 1e-6):
            return _with_iterations(first, first.iterations + evals)
        last = least_squares(resid, z2, ftol=ftol, xtol=xtol)
        best = min((first, last), key=lambda x: x.cost)
        return _with_iterations(best, first.iterations + evals + last.iterations)

    sols = [solve(z0 if k == 0 else z0 + np.random.default_rng(k).uniform(-2.0, 2.0, len(params))) for k in seeds]
    sol = min(sols, key=lambda x: x.cost)
    return Fitted(values=values(sol.x), solution=sol, iterations=sum(x.iterations for x in sols))


def _with_iterations(s: Solution, iterations: int) -> Solution:
    return Solution(s.x, s.cost, iterations, s.converged, s.jacobian)


# --- the linear fit ---------------------------------------------------------------------------


def linear_relative(cols: np.ndarray, measured: np.ndarray, weights: np.ndarray, x: np.ndarray,
                    free: Sequence[int], may_be_zero: Sequence[int]) -> np.ndarray:
    """x minimising sum (weights (cols @ x / measured - 1))^2 over the `free` coefficients, the
    others held at `x`'s values. A free coefficient that comes out negative (or 0 where it may
    not be) leaves the free set and the rest is refitted: one in `may_be_zero` becomes 0, any
    other keeps its value in `x`. Returns the new coefficients."""
    x_now, out = x.astype(float).copy(), x.astype(float).copy()
    free = list(free)
    n = cols.shape[1]
    while free:
        fixed = [j for j in range(n) if j not in free]
        rhs = measured - cols[:, fixed] @ x_now[fixed]
        a = cols[:, free] / measured[:, None] * weights[:, None]
        sol, *_ = np.linalg.lstsq(a, rhs / measured * weights, rcond=None)
        bad = [free[k] for k, v in enumerate(sol) if v < 0 or (v == 0 and free[k] not in may_be_zero)]
        if not bad:
            out[free] = sol
            break
        for j in bad:
            if j in may_be_zero:
                x_now[j] = out[j] = 0.0
        free = [j for j in free if j not in bad]
    return out


def line_relative(x: Sequence[float], y: Sequence[float], *, through_origin: bool = False) -> tuple[float, float]:
    """(slope, intercept) of y = slope x + intercept minimising sum ((slope x + intercept) / y - 1)^2
    (least squares on relative error: small and large y count alike), the intercept kept >= 0.
    Where it comes out negative, where the points cannot tell slope from intercept (one point,
    every x equal) or with `through_origin`, the intercept is 0 and the slope is the line's
    through the origin, sum(x / y) / sum((x / y)^2). The slope is returned as fitted: it may be
    <= 0 where y falls with x, and each caller says what that means for its line."""
    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if xs.size == 0 or xs.shape != ys.shape:
        raise ValueError("line_relative needs matching, non-empty lists")
    r = xs / ys
    if not through_origin and np.unique(xs).size >= 2:
        (slope, intercept), *_ = np.linalg.lstsq(np.stack([r, 1.0 / ys], axis=1), np.ones_like(ys), rcond=None)
        if intercept >= 0:
            return float(slope), float(intercept)
    return float(np.sum(r) / np.sum(r * r)), 0.0


def golden_section(f: Callable[[float], float], lo: float, hi: float, iters: int = 40) -> float:
    """The x in [lo, hi] minimising a unimodal f: each step keeps the part of the bracket on
    the lower of the two probes at the golden ratio; returns the final bracket's midpoint (40
    steps shrink it by 0.618^40 ~ 4e-9)."""
    g = (5 ** 0.5 - 1) / 2
    for _ in range(iters):
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        if f(a) < f(b):
            hi = b
        else:
            lo = a
    return (lo + hi) / 2


# --- held out ---------------------------------------------------------------------------------


def pmap(fn: Callable[[Any], Any], items: Sequence[Any], jobs: int) -> list[Any]:
    """map over a fork pool of `jobs` processes (serially for one job or where fork is missing);
    `fn` must be a module-level function (it is pickled by name)."""
    if jobs > 1 and len(items) > 1 and "fork" in multiprocessing.get_all_start_methods():
        with cf.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            return list(pool.map(fn, items))
    return [fn(x) for x in items]


def leave_out(groups: Sequence[K], fit_and_predict: Callable[[K], Any], *, jobs: int = 1) -> dict[K, Any]:
    """Each group (a run, a row, a source) held out in turn: {group: fit_and_predict(group)},
    where fit_and_predict fits on everything but the group and predicts it. This is the honest
    accuracy figure (leave-one-out; leave-one-source-out where the groups are sources: a user's
    cluster is always a new source)."""
    groups = list(groups)
    return dict(zip(groups, pmap(fit_and_predict, groups, jobs)))
