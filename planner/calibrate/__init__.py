"""Calibration: fit the cost model's named runtime factors to measured runs, and the closed loop.

    from planner.calibrate import calibrate, load_measured, refine
    cal = calibrate(profile, [load_measured(d) for d in run_dirs])
    result = refine("reports/glm", k=4, steps=5)        # planner search --refine K
"""
from planner.calibrate.core import Calibration, apply, calibrate, mape
from planner.calibrate.runs import MeasuredRun, load_measured

__all__ = ["Calibration", "MeasuredRun", "apply", "calibrate", "load_measured", "mape", "refine"]


def refine(*args, **kwargs):  # noqa: ANN002, ANN003 - lazy: the executor imports torch
    """See planner.calibrate.refine.refine."""
    from planner.calibrate.refine import refine as _refine
    return _refine(*args, **kwargs)
