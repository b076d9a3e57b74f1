"""The one definition of a prediction's error and of MAPE, used by calibration, the runtime's
metrics.json, the ladder, the report and every benchmark (issue 21: one definition of each idea).

    rel_error(predicted, measured) = predicted / measured - 1   (+0.2: the estimate is 20% high)
    mape(errors) = mean |error| over the errors that exist      (a fraction: 0.05 is 5%)
"""
from __future__ import annotations

import math
from typing import Iterable


def rel_error(predicted: float | None, measured: float | None) -> float | None:
    """predicted / measured - 1; None where there is nothing to compare (either is missing,
    the prediction is not finite, or the measurement is 0)."""
    if predicted is None or measured is None or not math.isfinite(predicted) or measured == 0:
        return None
    return predicted / measured - 1.0


def mape(errors: Iterable[float | None]) -> float | None:
    """Mean absolute percentage error, as a fraction, of relative errors (rel_error's); None
    entries are skipped, None when none is left."""
    e = [abs(x) for x in errors if x is not None]
    return sum(e) / len(e) if e else None


def mape_of(predicted: Iterable[float | None], measured: Iterable[float | None]) -> float | None:
    """mape of rel_error over matched pairs."""
    return mape(rel_error(p, m) for p, m in zip(predicted, measured))
