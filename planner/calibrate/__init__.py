"""Calibration: fit the cost model's named runtime factors to measured runs (pure Python; the
closed loop that produces the runs is planner/tune).

    from planner.calibrate import calibrate, load_measured
    cal = calibrate(profile, [load_measured(d) for d in run_dirs])
"""
from planner.calibrate.accuracy import mape, mape_of, rel_error
from planner.calibrate.core import Calibration, apply, calibrate
from planner.calibrate.runs import MeasuredRun, load_measured

__all__ = ["Calibration", "MeasuredRun", "apply", "calibrate", "load_measured", "mape", "mape_of", "rel_error"]
