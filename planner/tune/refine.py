"""The closed loop behind `planner search --refine K`: run the top K plans for a few steps,
refit the factors to what they measured, re-rank every feasible plan, record the error
before and after in refine.json.

    result = refine("reports/glm", k=4, steps=5)     # -> dict, also written to refine.json

Each plan runs in its own run directory reports/<name>/refine/plan-<i>/ (plan.json,
estimate.json, then the executor's ds_config.json and metrics.json), so `planner calibrate`
and `planner report` can read them again later.
"""
from __future__ import annotations

import csv
import dataclasses
from pathlib import Path
from typing import Any, Callable

from planner import dsconfig
from planner.calibrate.core import apply, calibrate
from planner.calibrate.runs import MeasuredRun
from planner.cost import estimate
from planner.errors import PlannerError, SpecError
from planner.rundir import atomic_write_json, load_run, plan_document
from planner.search.trials import plan_from_row
from planner.specs.plan import Plan

def top_plans(trials_csv: Path, k: int, picks: tuple[int, ...] = ()) -> list[tuple[int, Plan, float]]:
    """The k fastest distinct feasible plans by predicted step time: (trial, plan, predicted s).

    The order is the search's table (planner.search.evaluate.rank: ties by less memory), so
    `picks` -- 1-based positions in it, `--refine-plans` -- name the plans of its # column.
    """
    try:
        rows = list(csv.DictReader(trials_csv.open()))
    except FileNotFoundError:
        raise SpecError("trials.csv", f"{trials_csv} does not exist", "run `planner search` first") from None
    feasible = [r for r in rows if str(r.get("feasible")).lower() == "true" and r.get("step_time_s")]
    feasible.sort(key=lambda r: (float(r["step_time_s"]), float(r.get("peak_memory_gb") or 0.0)))
    out, seen = [], set()
    want = max(picks) if picks else k
    for r in feasible:
        plan = plan_from_row(r)
        key = repr(sorted(plan.to_dict().items()))
        if key in seen:
            continue
        seen.add(key)
        out.append((int(r["trial"]), plan, float(r["step_time_s"])))
        if len(out) == want:
            break
    if not picks:
        return out
    if want > len(out):
        raise SpecError("--refine-plans", f"names plan {want}, but the search ranked {len(out)} distinct feasible "
                        "plans", f"name positions 1-{len(out)} of the ranking (the # column of the plans table)")
    return [out[i - 1] for i in picks]


def _executor_run(run_dir: Path, steps: int, warmup: int) -> dict[str, Any]:
    from planner.runtime.train.launch import run_plan
    return run_plan(run_dir, steps=steps, warmup=warmup)


def refine(run_dir: str | Path, k: int, steps: int = 5, *, warmup: int = 1, profile: str | Path | None = None,
           picks: tuple[int, ...] = (), runner: Callable[[Path, int, int], dict[str, Any]] | None = None,
           echo: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Run the top `k` plans of run_dir/trials.csv (or the ranking's positions `picks`) for
    `steps` steps, refit, re-rank.

    Returns the refine.json document: per plan measured vs predicted before/after/held out,
    MAPE before and after, the fitted factors, the ranking before and after, and the path of
    the calibrated profile (run_dir/profile-calibrated.json).
    """
    from planner.specs.hardware import load_profile
    run = Path(run_dir)
    if k < 1:
        raise SpecError("--refine", f"must be >= 1, got {k}", "give how many top plans to run, e.g. --refine 4")
    _, model, cluster, train, doc = load_run(run)
    device = load_profile(profile) if profile else cluster.device
    runner = runner or _executor_run
    top = top_plans(run / "trials.csv", k, picks)
    runs: list[MeasuredRun] = []
    failures = []
    c = with_device(cluster, device)
    for i, (trial, plan, predicted) in enumerate(top):
        sub = run / "refine" / f"plan-{i}"
        prepare_plan_dir(sub, plan, model, c, train, doc, run)
        echo(f"refine {i + 1}/{len(top)}: {plan.describe()}")
        try:
            m = runner(sub, steps, warmup)
        except PlannerError as exc:
            failures.append({"trial": trial, "plan": plan.describe(), "error": exc.line()})
            echo(f"refine {i + 1}/{len(top)} failed: {exc.line()}")
            continue
        runs.append(MeasuredRun(path=str(sub), model=model, cluster=c, train=train, plan=plan,
                                step_time_s=float(m["step_time_s"]), peak_memory_gb=float(m["peak_memory_gb"])))
    return finish(run, runs, failures, k=k, steps=steps, warmup=warmup, device=device)


def with_device(cluster: Any, device: Any) -> Any:
    return dataclasses.replace(cluster, device=device, intra_node=device.intra_node, inter_node=device.inter_node)


def prepare_plan_dir(sub: Path, plan: Plan, model: Any, c: Any, train: Any, doc: dict[str, Any], run: Path) -> Any:
    """plan.json, estimate.json and this plan's own ds_config.json in `sub`; returns the estimate."""
    est = estimate(model, c, train, plan)
    atomic_write_json(sub / "plan.json", plan_document(plan, model, c, train, model_arg=doc["inputs"].get("model_arg", ""),
                                                       scale=doc["inputs"].get("scale"), command=f"refine {run}"))
    atomic_write_json(sub / "estimate.json", {"plan": plan.to_dict(), "estimate": est.to_json()})
    # this plan's own DeepSpeed config: a directory reused from an earlier search must not
    # keep the previous plan's config (the executor refuses a mismatch)
    atomic_write_json(sub / "ds_config.json", dsconfig.ds_config(plan, model, train, c))
    return est


def finish(run: Path, runs: list[MeasuredRun], failures: list[dict[str, Any]], *, k: int, steps: int, warmup: int,
           device: Any, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Refit the factors to `runs`, re-rank trials.csv, write profile-calibrated.json and refine.json."""
    if not runs:
        first = f"; the first: {failures[0]['plan']}: {failures[0]['error']}" if failures else ""
        raise SpecError("--refine", f"no plan ran successfully{first}",
                        "see each plan's launcher.log and metrics.json under refine/")
    _, model, cluster, train, _ = load_run(run)
    cal = calibrate(device, runs)
    ranking = _rerank(run, model, cluster, train, device, cal.device)
    out_profile = run / "profile-calibrated.json"
    base = _profile_json(device)
    atomic_write_json(out_profile, apply(base, cal))
    result = {"version": 1, "k": k, "steps": steps, "warmup": warmup, "profile_before": device.path,
              "profile_after": str(out_profile), "plans": cal.rows, "failures": failures,
              "summary": cal.summary, "factors": cal.factors, "ranking": ranking, **(extra or {})}
    atomic_write_json(run / "refine.json", result)
    return result


def _profile_json(device: Any) -> dict[str, Any]:
    import json
    if device.path and Path(device.path).exists():
        return json.loads(Path(device.path).read_text())
    raise SpecError("--profile", f"cannot find the file of profile {device.name}", "pass --profile PATH")


def _rerank(run: Path, model: Any, cluster: Any, train: Any, before: Any, after: Any) -> dict[str, Any]:
    """Every distinct feasible plan of trials.csv re-estimated with the fitted factors."""
    rows = top_plans(run / "trials.csv", 10 ** 9)
    scored = []
    c_b, c_a = with_device(cluster, before), with_device(cluster, after)
    for trial, plan, _ in rows:
        eb, ea = estimate(model, c_b, train, plan), estimate(model, c_a, train, plan)
        scored.append({"trial": trial, "plan": plan.describe(), "before_s": eb.step_time_s,
                       "after_s": ea.step_time_s, "feasible_after": ea.feasible})
    before_order = [s["trial"] for s in sorted(scored, key=lambda s: s["before_s"])]
    after_order = [s["trial"] for s in sorted((s for s in scored if s["feasible_after"]), key=lambda s: s["after_s"])]
    return {"before": before_order[:20], "after": after_order[:20],
            "best_before": before_order[0] if before_order else None,
            "best_after": after_order[0] if after_order else None, "plans": len(scored)}


__all__ = ["finish", "prepare_plan_dir", "refine", "top_plans", "with_device"]
