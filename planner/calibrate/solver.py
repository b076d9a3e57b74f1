"""Levenberg-Marquardt nonlinear least squares (numpy only; scipy is not a dependency).

Levenberg 1944, Marquardt 1963; the scaled damping diag(J^T J) and the accept/reject rule
follow Nocedal & Wright, "Numerical Optimization" (2nd ed.), section 10.3. The Jacobian is
taken by forward differences, which is enough for the smooth, cheap cost model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np


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
    """Minimise 0.5 ||fun(x)||^2 from x0."""
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
