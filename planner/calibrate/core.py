"""`planner calibrate`: fit the factors, report residuals, write them into the profile."""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from planner.calibrate.accuracy import mape_of
from planner.calibrate.fit import (MEMORY_FACTORS, TIME_FACTORS, fit_group, layer_observations, predict_layer,
                                   predict_memory, predict_time, with_factors)
from planner.calibrate.runs import MeasuredRun
from planner.errors import SpecError
from planner.specs.hardware import DeviceProfile, profile_from_dict


def pct(fraction: float | None) -> float:
    """A MAPE (accuracy.mape, a fraction) in percent; NaN where there was nothing to compare."""
    return float("nan") if fraction is None else 100.0 * fraction


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibration:
    device: DeviceProfile
    """The profile with the fitted factors."""
    factors: dict[str, float]
    rows: list[dict[str, Any]]
    """Per run: measured, predicted before, after (in-sample) and held out, time and memory."""
    layer_rows: list[dict[str, Any]]
    summary: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"factors": self.factors, "runs": self.rows, "layers": self.layer_rows, "summary": self.summary}


def calibrate(device: DeviceProfile, runs: list[MeasuredRun], *, use_layers: bool = True) -> Calibration:
    """Fit step-time and memory factors of `device` to `runs` (and its own per-block timings)."""
    if not runs:
        raise SpecError("RUN_DIRS", "no measured runs given", "pass run directories that `planner run` completed")
    layers = layer_observations(device) if use_layers else []
    extra = [(lambda d, o=o: predict_layer(d, o), o.time_s) for o in layers]
    tfit, t_held = fit_group(device, TIME_FACTORS, runs, lambda r: r.step_time_s, predict_time, extra)
    mfit, m_held = fit_group(device, MEMORY_FACTORS, runs, lambda r: r.peak_memory_gb, predict_memory)
    factors = {**tfit.factors, **mfit.factors}
    after = with_factors(device, factors)
    rows = []
    for r, th, mh in zip(runs, t_held, m_held):
        rows.append({"run": r.path, "plan": r.plan.describe(), "world_size": r.plan.world_size,
                     "step_time_s": {"measured": r.step_time_s, "before": predict_time(device, r),
                                     "after": predict_time(after, r), "held_out": th},
                     "peak_memory_gb": {"measured": r.peak_memory_gb, "before": predict_memory(device, r),
                                        "after": predict_memory(after, r), "held_out": mh}})
    layer_rows = [{"micro_batch": o.micro_batch, "seq": o.seq, "measured_s": o.time_s,
                   "before_s": predict_layer(device, o), "after_s": predict_layer(after, o)} for o in layers]

    def col(key: str, which: str) -> list[float]:
        return [row[key][which] for row in rows]

    summary = {
        "runs": len(runs), "layer_points": len(layers),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "step_time_mape_pct": {w: pct(mape_of(col("step_time_s", w), col("step_time_s", "measured")))
                               for w in ("before", "after", "held_out")},
        "memory_mape_pct": {w: pct(mape_of(col("peak_memory_gb", w), col("peak_memory_gb", "measured")))
                            for w in ("before", "after", "held_out")},
        "layer_time_mape_pct": {w: pct(mape_of([x[f"{w}_s"] for x in layer_rows], [x["measured_s"] for x in layer_rows]))
                                for w in ("before", "after")},
        "lambda": {"time": tfit.lam, "memory": mfit.lam},
        "sensitivity": {**tfit.sensitivity, **mfit.sensitivity},
        "undetermined": sorted(n for n, s in {**tfit.sensitivity, **mfit.sensitivity}.items() if s < 1e-3),
        "method": "Levenberg-Marquardt on log(predicted/measured) with a ridge to the defaults; ridge weight by "
                  "leave-one-out cross-validation; held_out = each run predicted by a fit without it",
    }
    return Calibration(device=after, factors=factors, rows=rows, layer_rows=layer_rows, summary=summary)


def apply(profile_data: dict[str, Any], cal: Calibration) -> dict[str, Any]:
    """The profile JSON with the fitted factors, their sources and the fit's residuals."""
    data = dict(profile_data)
    data["factors"] = {**data.get("factors", {}), **cal.factors}
    data["builtin"] = False
    sources = dict(data.get("sources", {}))
    n = cal.summary["runs"]
    for name in cal.factors:
        sources[f"factors.{name}"] = (f"fitted by planner calibrate to {n} measured run(s)"
                                      + (" and the profiler's block timings" if cal.layer_rows else "")
                                      + f" on {cal.summary['date']}"
                                      + (" (not determined by these runs: stays near its default)"
                                         if name in cal.summary["undetermined"] else ""))
    data["sources"] = sources
    data["measured"] = {**data.get("measured", {}), "calibration": cal.to_dict()}
    profile_from_dict(data, str(data.get("name")))
    return data
