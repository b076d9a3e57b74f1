"""trials.csv: one row per evaluated plan (docs/CONTRACTS.md "trials.csv").

Columns: trial, source, every Plan field (tuples `;`-joined), feasible, reason, reason_code (the
first problem's code, planner/specs/problems.py), the Estimate scalars, time_<part> (seconds) and mem_<part> (GB, the peak stage). Plans the solvers proved
cannot fit have no estimate: their scalars are empty and peak_memory_gb is the least any
stage split would need.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import math
from pathlib import Path
from typing import Any, Iterable, Mapping

from planner.rundir import atomic_write_text
from planner.search.evaluate import Trial
from planner.specs.estimate import GB, MemoryBreakdown, TimeBreakdown
from planner.specs.plan import Plan

PLAN_FIELDS = [f.name for f in dataclasses.fields(Plan)]
SCALARS = ["step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "hfu", "peak_memory_gb", "capacity_gb",
           "bubble_fraction"]
TIME_FIELDS = [f"time_{f.name}" for f in dataclasses.fields(TimeBreakdown)]
MEM_FIELDS = [f"mem_{f.name}" for f in dataclasses.fields(MemoryBreakdown)]
COLUMNS = ["trial", "source", *PLAN_FIELDS, "feasible", "reason", "reason_code", *SCALARS, *TIME_FIELDS, *MEM_FIELDS]


def plan_cells(plan: Plan) -> dict[str, Any]:
    """A Plan as trials.csv cells: one per field, tuples `;`-joined."""
    return {name: ";".join(str(x) for x in value) if isinstance(value, list) else value
            for name, value in plan.to_dict().items()}


def plan_from_row(row: Mapping[str, Any]) -> Plan:
    """A trials.csv row back into a Plan: csv strings, or a frame's values (NaN where empty);
    each field read as its type (Plan's defaults say which); an empty cell keeps the default."""
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(Plan):
        v = row.get(f.name)
        if v is None or (isinstance(v, str) and not v.strip()) or (isinstance(v, float) and math.isnan(v)):
            continue
        if isinstance(f.default, bool):
            kw[f.name] = v if isinstance(v, bool) else str(v).strip().lower() in ("true", "1", "yes")
        elif isinstance(f.default, int):
            kw[f.name] = int(float(v))
        elif isinstance(f.default, tuple):
            kw[f.name] = tuple(int(x) for x in str(v).split(";") if x.strip())
        else:
            kw[f.name] = str(v)
    return Plan(**kw)


def row(number: int, trial: Trial) -> dict[str, Any]:
    out: dict[str, Any] = {"trial": number, "source": trial.source}
    out.update(plan_cells(trial.plan))
    out["feasible"] = trial.feasible
    out["reason"] = trial.reason
    out["reason_code"] = trial.reason_code
    est = trial.estimate
    out["peak_memory_gb"] = trial.needs_bytes / GB
    out["capacity_gb"] = trial.capacity_bytes / GB
    if est is not None:
        out.update(step_time_s=est.step_time_s, tokens_per_s=est.tokens_per_s, tflops_per_gpu=est.tflops_per_gpu,
                   mfu=est.mfu, hfu=est.hfu, bubble_fraction=est.bubble_fraction)
        out.update({f"time_{k}": v for k, v in est.time.to_dict().items()})
        out.update({f"mem_{k}": v for k, v in est.stage_memory[est.peak_stage].to_gb().items()})
    return out


def to_csv(trials: Iterable[tuple[int, Trial]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, restval="", lineterminator="\n")
    writer.writeheader()
    for number, trial in trials:
        writer.writerow(row(number, trial))
    return buf.getvalue()


def write_trials(path: str | Path, trials: Iterable[tuple[int, Trial]]) -> None:
    atomic_write_text(path, to_csv(trials))
