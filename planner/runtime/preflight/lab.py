"""What a measured comparison (`planner verify`, `planner ladder --measure`, the benchmarks) needs
before it runs, checked up front so that a prediction never silently comes from another
machine's figures: each problem is one line naming what is missing and how to regenerate it
(planner.errors.SpecError; the CLI exits 2).

- the run directory's profile (plan.json inputs.cluster.profile) must exist here: run_dir
  loading falls back to the built-in profile of the same device name otherwise;
- a measured CPU profile must have been measured on this kind of machine (its
  measured.environment: CPU model and core count);
- a measured profile must hold a GEMM curve for every precision the comparison predicts (the
  baseline's fp32 and the plan's): a missing one would silently borrow another precision's;
- a metrics.json must be of this planner's version (planner.runtime.observe.metrics.VERSION).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from planner.errors import SpecError

REPROFILE = "run `planner profile` on this machine and re-plan with `planner search --profile <it>`"


def check_profile(path: str | None, precisions: tuple[str, ...], where: str) -> None:
    """`path` (a profile named by a run directory, None: the built-in one) is usable here for
    predictions in `precisions`."""
    if not path:
        return
    p = Path(path)
    if not p.exists():
        raise SpecError(where, f"names profile {path}, which does not exist on this machine (planned elsewhere?); "
                               "the predictions would silently come from the built-in profile", REPROFILE)
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SpecError(str(p), f"cannot be read as a profile ({exc})", REPROFILE) from None
    if data.get("builtin", True):
        return
    env = (data.get("measured") or {}).get("environment") or {}
    if env.get("kind") == "cpu":
        from planner.profiler.device import cpu_name
        here, cores = cpu_name(), os.cpu_count()
        if (env.get("cpu") and here and env["cpu"] != here) or (env.get("cpu_count") and env["cpu_count"] != cores):
            raise SpecError(str(p), f"was measured on another machine ({env.get('cpu')}, {env.get('cpu_count')} "
                                    f"cores; this one: {here}, {cores} cores)", REPROFILE)
    # the profiled precision's curve is gemm_efficiency itself (planner/profiler/write.py), the
    # others' are gemm_efficiency_by_precision
    options = (data.get("measured") or {}).get("options") or {}
    curves = set(data.get("gemm_efficiency_by_precision") or {}) | {options.get("precision")}
    for prec in precisions:
        if prec not in curves:
            raise SpecError(str(p), f"has no {prec} GEMM curve (gemm_efficiency_by_precision.{prec}), which the "
                                    f"{prec} plan's prediction needs", "re-run `planner profile` (it measures the "
                                    "profiled precision and fp32) and re-plan with it")
    if env.get("kind") == "cpu":  # the step probes the CPU step model composes (planner/specs/step.py)
        block = (data.get("step") or {}).get("block") or {}
        for prec in precisions:
            if prec not in block:
                raise SpecError(str(p), f"has no step probe of the {prec} block (step.block.{prec}), which the "
                                        f"{prec} plan's CPU step time needs", "re-run `planner profile` (it times "
                                        "the executor's block in the profiled precision and fp32) and re-plan with it")


def check_run_dir(run: Path, precisions: tuple[str, ...]) -> None:
    """The run directory's profile (plan.json inputs.cluster.profile), as check_profile."""
    try:
        doc = json.loads((run / "plan.json").read_text())
        path = doc["inputs"]["cluster"].get("profile")
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
        return  # load_run reports an unreadable plan.json itself
    check_profile(path, precisions, f"{run / 'plan.json'}: inputs.cluster.profile")


def check_metrics(metrics: dict[str, Any], where: str) -> dict[str, Any]:
    """`metrics` (a metrics.json) is of this planner's version; returns it."""
    from planner.runtime.observe.metrics import VERSION
    got = metrics.get("version") if isinstance(metrics, dict) else None
    if got != VERSION:
        raise SpecError(where, f"is metrics.json version {got!r}, this planner reads {VERSION} (model states by "
                               "class, the allocated peak)", "regenerate it: `planner run RUN_DIR` (benchmarks: "
                               "run without --reuse)")
    return metrics
