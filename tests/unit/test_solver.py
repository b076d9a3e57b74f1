"""planner/calibrate/solver.py, the package's one fitter: hand-computed optima of the relative
error it minimises, its bounds, its linear form and its held-out loop."""
from __future__ import annotations

import math

import numpy as np
import pytest

from planner.calibrate import solver


def test_one_constant_on_log_relative_error_is_the_geometric_mean():
    """min (log(c/1))^2 + (log(c/2))^2 -> log c = (log 1 + log 2) / 2: c = sqrt(2) (a fit on
    absolute error would give 1.5, on p/m - 1 would give 1.2)."""
    f = solver.fit_relative(lambda v: [v["c"], v["c"]], [1.0, 2.0], [solver.Log("c")], {"c": 1.0}, lam=0.0)
    assert f.values["c"] == pytest.approx(math.sqrt(2), rel=1e-6)


def test_the_ridge_holds_an_undetermined_factor_at_its_prior():
    """pred = a x b: one observation cannot tell a from b; the ridge splits the log error evenly
    between them (a = b = sqrt(4 / (1 x 1)) = 2 from priors 1, 1)."""
    f = solver.fit_relative(lambda v: [v["a"] * v["b"]], [4.0], [solver.Log("a"), solver.Log("b")],
                            {"a": 1.0, "b": 1.0}, lam=1e-6)
    assert f.values["a"] == pytest.approx(2.0, rel=1e-3) and f.values["b"] == pytest.approx(2.0, rel=1e-3)
    held = solver.fit_relative(lambda v: [3.0], [4.0], [solver.Log("a")], {"a": 1.7}, lam=1e-3)
    assert held.values["a"] == pytest.approx(1.7, rel=1e-6)  # nothing depends on it: stays


def test_bounds_and_caps_hold():
    b = solver.Bounded("s", 0.5, 4.0)
    f = solver.fit_relative(lambda v: [v["s"]], [10.0], [b], {"s": 1.0}, lam=0.0)
    assert 3.9 < f.values["s"] <= 4.0 and b.at_bound(f.values["s"])
    a = solver.Additive("t", 0.01, cap=0.05)
    assert a.value(a.to_z(0.2)) == 0.05 and a.value(-3.0) == pytest.approx(0.03)
    g = solver.fit_relative(lambda v: [1.0 + v["t"]], [1.02], [a], {"t": 0.0}, lam=0.0)
    assert g.values["t"] == pytest.approx(0.02, abs=1e-6)
    assert solver.Logit("f").value(solver.Logit("f").to_z(0.3)) == pytest.approx(0.3)
    assert solver.Softplus("g", 2.0).value(solver.Softplus("g", 2.0).to_z(0.5)) == pytest.approx(0.5)


def test_the_polish_and_the_seeds_find_the_lower_corner():
    """|log(c)| + 1 has a kink at c = 1 where LM's forward differences stall; the Nelder-Mead
    polish and a second seed reach the same optimum."""
    f = solver.fit_relative(lambda v: [math.exp(abs(math.log(v["c"]))) * 2.0], [2.0], [solver.Log("c")],
                            {"c": 3.0}, lam=0.0, polish=True, seeds=(0, 1))
    assert f.values["c"] == pytest.approx(1.0, abs=1e-3)


def test_linear_relative_fits_and_clamps():
    # pred = x0 * 1 + x1 * t; measured = 2 + 3 t exactly -> (2, 3)
    t = np.array([1.0, 2.0, 4.0])
    cols = np.stack([np.ones(3), t], axis=1)
    x = solver.linear_relative(cols, 2 + 3 * t, np.ones(3), np.array([1.0, 1.0]), [0, 1], may_be_zero=[0])
    assert x == pytest.approx([2.0, 3.0])
    # measured falls with t: the free slope comes out negative; not allowed to be 0 -> keeps 1.0,
    # the intercept is refitted against (measured - t): rows 9, 6, 0 over measured 10, 8, 4:
    # min sum (x0 / m - r / m)^2 with r = m - t -> x0 = sum(r / m^2) / sum(1 / m^2)
    m = np.array([10.0, 8.0, 4.0])
    x = solver.linear_relative(cols, m, np.ones(3), np.array([1.0, 1.0]), [0, 1], may_be_zero=[0])
    r = m - t
    assert x[1] == 1.0 and x[0] == pytest.approx(float(np.sum(r / m ** 2) / np.sum(1 / m ** 2)))
    # the intercept may be 0: it is, when it would come out negative
    x = solver.linear_relative(cols, 3 * t - 0.5, np.ones(3), np.array([1.0, 1.0]), [0, 1],
                               may_be_zero=[0])
    assert x[0] == 0.0 and x[1] > 0


def _mean_of_others(i: int) -> float:
    data = [1.0, 2.0, 6.0]
    rest = data[:i] + data[i + 1:]
    return sum(rest) / len(rest)


def test_leave_out_predicts_each_group_from_the_others():
    assert solver.leave_out([0, 1, 2], _mean_of_others) == {0: 4.0, 1: 3.5, 2: 1.5}
    assert solver.leave_out([0, 1, 2], _mean_of_others, jobs=2) == {0: 4.0, 1: 3.5, 2: 1.5}
