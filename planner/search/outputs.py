"""What `planner search` writes into a run directory (one writer for the CLI, the sample
report and the benchmarks, so what they start is what a user would start)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from planner.rundir import atomic_write_json, atomic_write_text, plan_document
from planner.specs.estimate import Estimate


def estimate_summary(est: Estimate) -> dict[str, Any]:
    keys = ("feasible", "reasons", "step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "hfu", "peak_memory_gb",
            "capacity_gb", "bubble_fraction")
    j = est.to_json()
    return {k: j[k] for k in keys}


def write_outputs(run_dir: Path, result, model, cluster, train, *, scale: str | None, model_arg: str,
                  command: str, top: int) -> list[str]:
    """A search's run directory, every file through a temporary file and a rename: plan.json
    (the pick, with the inputs that reproduce it), estimate.json (its estimate, the
    conventional baseline, the top plans and the Pareto front), ds_config.json, launch.sh,
    the hostfile for several nodes, and trials.csv (every evaluated point). Returns the names
    written. Used by `planner search`, report/sample.py and benchmarks/plans_start.py."""
    from planner import dsconfig
    from planner.search.trials import write_trials
    best = result.best
    plan, est = best.plan, best.estimate
    written = []

    def put(name: str, data: Any, mode: int | None = None) -> None:
        if isinstance(data, str):
            atomic_write_text(run_dir / name, data, mode)
        else:
            atomic_write_json(run_dir / name, data)
        written.append(name)

    put("plan.json", plan_document(plan, model, cluster, train, scale=scale, model_arg=model_arg, command=command))
    base = result.baseline
    baseline: dict[str, Any] = {"plan": result.baseline_plan.to_dict(), "description": result.baseline_plan.describe()}
    if base.feasible:
        baseline["estimate"] = base.to_json()
    else:
        baseline.update(fits=False, needs_gb=base.peak_memory_gb, reasons=list(base.reasons))
    put("estimate.json", {
        "plan": plan.to_dict(), "description": plan.describe(), "estimate": est.to_json(), "baseline": baseline,
        "search": {"method": result.method, "trials": result.distinct, "rows": len(result.trials),
                   "space_size": result.space_size,
                   "wall_s": result.wall_s, "study_name": result.study_name},
        "top": [{"plan": t.plan.to_dict(), "description": t.plan.describe(), "estimate": estimate_summary(t.estimate)}
                for t in result.ranked[:top]],
        "pareto_front": [{"plan": t.plan.to_dict(), "tokens_per_s": t.tokens_per_s, "peak_memory_gb": t.needs_gb}
                         for t in result.front]})
    put("ds_config.json", dsconfig.ds_config(plan, model, train, cluster))
    put("launch.sh", dsconfig.launch_script(plan, model, train, cluster, str(run_dir)), 0o755)
    host = dsconfig.hostfile(cluster)
    if host:
        put("hostfile", host)
    from planner.search.evaluate import Trial
    base_trial = Trial(outer=best.outer, plan=result.baseline_plan, estimate=base, feasible=base.feasible,
                       reason="; ".join(base.reasons), needs_bytes=base.peak_memory_bytes,
                       capacity_bytes=base.capacity_bytes, source="baseline")
    rows = list(enumerate(result.trials)) + [(len(result.trials), base_trial)]
    write_trials(run_dir / "trials.csv", rows)
    written.append("trials.csv")
    return written
