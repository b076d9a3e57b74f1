"""The straight-line fits and the 1-D search, pinned at their edge cases by hand (issue 21: one
fitter, planner/calibrate/solver.py line_relative and golden_section, which every one of them
calls; the pins were written against the four separate fitters before they moved onto it). Each value below is computed by hand in the comment beside it; weights are 1 / measured
(least squares on relative error), so the through-origin slope of y = s x is
sum(x / y) / sum((x / y)^2) = sum(x y w^2) / sum((x w)^2).

- the profiler's scale/overhead line (measured block seconds = scale x predicted + overhead),
- the profiler's alpha-beta collective fit (t = alpha + beta x bytes),
- benchmarks/link_curves.py's fit of vidur's NCCL curves (t = a + S c / B),
- benchmarks/fidelity.py's golden-section search of a runtime's compute_scale.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from planner.calibrate.solver import golden_section, line_relative
from planner.profiler.fit import fit_alpha_beta
from planner.profiler.steps import fit_line

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import link_curves  # noqa: E402

# --- scale / overhead --------------------------------------------------------------------------


def test_line_exact():
    # 3 = 2*1 + 1, 5 = 2*2 + 1, 9 = 2*4 + 1
    assert fit_line([1.0, 2.0, 4.0], [3.0, 5.0, 9.0]) == pytest.approx((2.0, 1.0), rel=1e-12)


def test_line_one_point_goes_through_the_origin():
    assert fit_line([2.0], [5.0]) == (pytest.approx(2.5, rel=1e-12), 0.0)


def test_line_negative_overhead_refits_through_the_origin():
    # exact line 2x - 1: overhead < 0, so slope = (1*1/1 + 2*3/9) / (1/1 + 4/9) = (15/9) / (13/9) = 15/13
    assert fit_line([1.0, 2.0], [1.0, 3.0]) == (pytest.approx(15 / 13, rel=1e-12), 0.0)


def test_line_all_equal_x_goes_through_the_origin():
    # slope and overhead cannot be told apart: (2*3/9 + 2*5/25) / (4/9 + 4/25) = (16/15) / (136/225) = 30/17
    assert fit_line([2.0, 2.0], [3.0, 5.0]) == (pytest.approx(30 / 17, rel=1e-12), 0.0)


def test_line_falling_slope_refits_through_the_origin():
    # exact line -x + 4: slope <= 0, so (1*3/9 + 2*2/4) / (1/9 + 4/4) = (4/3) / (10/9) = 1.2
    assert fit_line([1.0, 2.0], [3.0, 2.0]) == (pytest.approx(1.2, rel=1e-12), 0.0)


@pytest.mark.parametrize("pred,meas", [([], []), ([1.0], [1.0, 2.0])])
def test_line_needs_matching_non_empty_lists(pred, meas):
    with pytest.raises(ValueError):
        fit_line(pred, meas)


# --- alpha-beta (the profiler) -------------------------------------------------------------------


def test_alpha_beta_exact():
    # alpha 10 us, beta 1 ns per byte: 1e3 B -> 11 us, 1e6 B -> 1010 us
    fit = fit_alpha_beta("send_recv", 2, [1e3, 1e6], [1.1e-5, 1.01e-3])
    assert fit.alpha_s == pytest.approx(1e-5, rel=1e-9) and fit.beta_s_per_byte == pytest.approx(1e-9, rel=1e-9)
    assert fit.max_rel_error < 1e-9 and fit.points == 2


def test_alpha_beta_negative_alpha_is_clamped_and_beta_refitted():
    # exact line 2S - 1: alpha 0, beta = (1/1 + 2/3) / (1 + 4/9) = 15/13; errors 2/13 and (9/13)/3 = 3/13
    fit = fit_alpha_beta("send_recv", 2, [1.0, 2.0], [1.0, 3.0])
    assert fit.alpha_s == 0.0 and fit.beta_s_per_byte == pytest.approx(15 / 13, rel=1e-12)
    assert fit.max_rel_error == pytest.approx(3 / 13, rel=1e-12)


def test_alpha_beta_falling_times_keep_alpha_and_take_beta_from_the_largest_message():
    # exact line -S + 4: alpha 4 >= 0 is kept; beta = max(2 - 4, 1e-12) / 2
    fit = fit_alpha_beta("send_recv", 2, [1.0, 2.0], [3.0, 2.0])
    assert fit.alpha_s == pytest.approx(4.0, rel=1e-12) and fit.beta_s_per_byte == pytest.approx(5e-13, rel=1e-9)


def test_alpha_beta_all_equal_sizes():
    # one size: only alpha + 2 beta is determined, = (1/3 + 1/5) / (1/9 + 1/25) = 60/17 (the
    # relative least-squares constant); the error is largest at t = 5: (25/17) / 5 = 5/17.
    # The split goes through the origin, alpha 0 and beta 30/17, as the profiler's block line
    # does (line_relative). Before the move this fit split it by lstsq's minimum norm (alpha
    # 12/17, beta 24/17), which depends on the units of bytes and seconds: the one change the
    # move made, on a sweep of one message size that the profiler never runs.
    fit = fit_alpha_beta("send_recv", 2, [2.0, 2.0], [3.0, 5.0])
    assert fit.predict(2.0) == pytest.approx(60 / 17, rel=1e-12)
    assert fit.max_rel_error == pytest.approx(5 / 17, rel=1e-12)
    assert fit.alpha_s == 0.0 and fit.beta_s_per_byte == pytest.approx(30 / 17, rel=1e-12)


def test_alpha_beta_needs_two_points():
    with pytest.raises(ValueError):
        fit_alpha_beta("send_recv", 2, [1.0], [1.0])


# --- alpha-beta (benchmarks/link_curves.py) ------------------------------------------------------


@pytest.mark.parametrize("kind,n,c", [("send_recv", 2, 1.0), ("all_reduce", 2, 1.0), ("all_reduce", 4, 1.5)])
def test_link_curve_exact(kind, n, c):
    # t = 10 us + S c / B, c = 2(n-1)/n for an all-reduce: B = c / (1 ns per byte)
    a, bw, mape = link_curves.alpha_beta([(1000, 1.1e-5), (1_000_000, 1.01e-3)], kind, n)
    assert a == pytest.approx(1e-5, rel=1e-9) and bw == pytest.approx(c * 1e9, rel=1e-9) and mape < 1e-9


def test_link_curve_negative_latency_is_clamped():
    # exact line 2S - 1. Before the move link_curves kept a = -1 s, B = 0.5 B/s (MAPE 0); it is
    # the profiler's fit now: a = 0, 1/B = 15/13, errors 2/13 and 3/13, MAPE 5/26. No vidur curve
    # has a negative latency (benchmarks/link_curves.py's table is unchanged by the move).
    a, bw, mape = link_curves.alpha_beta([(1, 1.0), (2, 3.0)], "send_recv", 2)
    assert a == 0.0 and bw == pytest.approx(13 / 15, rel=1e-12) and mape == pytest.approx(5 / 26, rel=1e-12)


def test_line_relative_returns_a_falling_slope_as_fitted():
    # each caller decides what a slope <= 0 means (the block line: through the origin; alpha-beta:
    # beta from the largest message): exact line -x + 4
    assert line_relative([1.0, 2.0], [3.0, 2.0]) == (pytest.approx(-1.0, rel=1e-9), pytest.approx(4.0, rel=1e-9))
    with pytest.raises(ValueError):
        line_relative([], [])


# --- the 1-D search (benchmarks/fidelity.py fit_runtime) -----------------------------------------


def test_golden_one_step_by_hand():
    # [0, 1], g = (sqrt 5 - 1) / 2: probes 1 - g and g; f(x) = x is lower at 1 - g, so hi = g; the
    # midpoint of [0, g] is g / 2 = (sqrt 5 - 1) / 4
    assert golden_section(lambda x: x, 0.0, 1.0, iters=1) == pytest.approx((math.sqrt(5) - 1) / 4, rel=1e-12)


def test_golden_finds_an_inner_minimum_and_a_bound():
    # 40 steps shrink the bracket by g^40 ~ 4.3e-9
    assert golden_section(lambda x: (x - 0.3) ** 2, 0.0, 1.0) == pytest.approx(0.3, abs=1e-8)
    assert golden_section(lambda x: -x, math.log(0.5), math.log(2.0)) == pytest.approx(math.log(2.0), abs=1e-8)
