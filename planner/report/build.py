"""write_report: a run directory -> one self-contained report.html.

Everything the page needs is inside it: CSS and the sorting script inline, figures as PNG
data URIs. A Content-Security-Policy in the page allows nothing from outside (no network,
no fonts, no scripts but the one whose hash it names), so even a string that escaped
escaping could not run. Jinja2 autoescapes every value.
"""
from __future__ import annotations

import base64
import datetime as _dt
import hashlib
import json
import math
import shlex
from importlib import metadata, resources
from pathlib import Path
from typing import Any, Callable

import jinja2
from markupsafe import Markup

from planner.errors import PlannerError, SpecError
from planner.report import analysis, cluster, fmt, plots, timeline
from planner.report import bill as bill_section
from planner.report import ladder as ladder_section
from planner.report.plan_text import distinct_labels
from planner.report.data import PLAN_FIELDS, RunData, load
from planner.rundir import atomic_write_text
from planner.specs import Plan

TOP_N = 10


def _resource(name: str) -> str:
    return resources.files("planner.report").joinpath(name).read_text(encoding="utf-8")


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(autoescape=True, undefined=jinja2.ChainableUndefined, trim_blocks=False)
    env.filters["min"] = lambda xs: min(xs)
    return env


def _plan(d: dict[str, Any] | None) -> Plan | None:
    try:
        return Plan.from_dict(d) if d else None
    except PlannerError:
        return None


def _figures(run: RunData, top: list[dict[str, Any]], head: dict[str, Any]) -> tuple[dict[str, str], dict[str, str], dict[str, Any]]:
    """Every figure; one that cannot be drawn becomes a note, never a failed report."""
    img: dict[str, str] = {}
    errors: dict[str, str] = {}
    extra: dict[str, Any] = {}
    cap = float(run.estimate.get("capacity_gb") or math.nan)

    def attempt(key: str, fn: Callable[[], Any]) -> Any:
        try:
            out = fn()
        except Exception as exc:  # a figure is an explanation, not the product: say what failed
            errors[key] = f"This figure could not be drawn ({type(exc).__name__}: {exc})."
            return None
        if isinstance(out, tuple):
            img[key] = out[0]
            return out[1]
        img[key] = out
        return None

    base = head.get("baseline")
    base_pt = {"peak_memory_gb": base["needs_gb"], "tokens_per_s": base["tokens_per_s"]} if base and base["fits"] else None
    if run.trials is not None and not run.trials.empty:
        # one point (and one count in the legend) per distinct plan, as the caption counts them
        extra["reason_counts"] = attempt("frontier", lambda: plots.frontier(distinct_trials(run.trials), run.estimate,
                                                                          base_pt, cap)) or {}

    plan_rows = [r for r in top if r["kind"] == "plan"]
    others = [r for r in plan_rows if not r["chosen"]][:3]
    base_plan = None
    if run.baseline:
        try:
            base_plan = Plan.from_dict(run.baseline.get("plan", {}))
        except PlannerError:
            base_plan = None
    groups = [{"label": "chosen\n" + analysis.short_label(run.plan), "stages": run.estimate.get("stage_memory_gb") or
               [run.estimate.get("memory_breakdown_gb", {})]}]
    written = {json.dumps(t.get("plan"), sort_keys=True): t.get("estimate") for t in run.top}
    for r in others:
        full = written.get(json.dumps(r["plan_dict"], sort_keys=True)) or {}
        stages = full.get("stage_memory_gb") if isinstance(full.get("stage_memory_gb"), list) else None
        groups.append({"label": f"#{int(r['rank'])}" + ("" if stages else " (peak stage)") + "\n" + r["short"],
                       "stages": stages or [r["mem"]]})
    if base:
        best = run.baseline.get("estimate") if run.baseline else None
        stages = best.get("stage_memory_gb") if isinstance(best, dict) else None
        groups.append({"label": "baseline\n" + (analysis.short_label(base_plan) if base_plan else "?"),
                       "stages": stages or [],
                       "needs_gb": base["needs_gb"]})
    # tied plans share a rank and may share a short label: each label says what sets its plan apart
    group_plans = [run.plan] + [_plan(r["plan_dict"]) for r in others] + ([base_plan] if base else [])
    for g, lab in zip(groups, distinct_labels([g["label"] for g in groups], group_plans)):
        g["label"] = lab
    attempt("memory", lambda: plots.memory_stacks(groups, cap))

    shown = [r for r in plan_rows if not r["chosen"]][:5]
    rows = [{"label": "chosen", "time": run.estimate.get("time_breakdown_s") or {}}]
    rows += [{"label": f"#{int(r['rank'])} {r['short'].replace(chr(10), ' ')}", "time": r["time"]} for r in shown]
    for row, lab in zip(rows[1:], distinct_labels([r["label"] for r in rows[1:]], [_plan(r["plan_dict"]) for r in shown])):
        row["label"] = lab
    if base and base["fits"] and run.baseline and isinstance(run.baseline.get("estimate"), dict):
        rows.append({"label": "baseline", "time": run.baseline["estimate"].get("time_breakdown_s") or {}})
    attempt("time", lambda: plots.time_breakdown(rows))

    layers = run.plan.layers_per_stage(run.model.layers)
    extra["gantt"] = attempt("gantt", lambda: timeline.gantt(run.estimate, layers, run.plan.grad_accum, run.plan.schedule))
    if run.study is not None:
        attempt("history", lambda: plots.history(run.study.history, run.study.direction))
        if run.study.importances:
            attempt("importances", lambda: plots.importances(run.study.importances))
    extra["cluster_info"] = attempt("cluster", lambda: cluster.draw_cluster(run.plan, run.cluster.gpus_per_node,
                                                                             run.cluster.nodes))
    if run.metrics is not None:
        attempt("measured", lambda: plots.measured_vs_predicted(run.metrics, cap))
        if run.metrics.get("loss") or run.metrics.get("step_times_s"):
            attempt("loss", lambda: plots.loss_curve(run.metrics))
    extra["bill"] = bill_section.section(run.bill)
    if extra["bill"] and extra["bill"]["points"]:
        attempt("bill", lambda: bill_section.pareto_figure(extra["bill"]["points"]))
    extra["ladder"] = ladder_section.load(run.run_dir)
    if extra["ladder"] and "rows" in extra["ladder"]:
        lad = extra["ladder"]
        try:
            img.update(ladder_section.figures(lad))
        except Exception as exc:  # as above: a figure that cannot be drawn is a note
            errors["ladder_throughput"] = f"This figure could not be drawn ({type(exc).__name__}: {exc})."
    return img, errors, extra


def _nan_to_none(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in records]


def distinct_trials(trials: Any) -> Any:
    """trials.csv with each distinct plan once and without the baseline row (trials.csv lists a
    plan again when Optuna proposes it again)."""
    df = trials[trials["source"] != "baseline"] if "source" in trials.columns else trials
    return df.drop_duplicates([f for f in PLAN_FIELDS if f in df.columns])


def distinct_plans(trials: Any) -> tuple[int, int]:
    """(plans evaluated, of them feasible), counting each distinct plan once and not the
    baseline row: the count `planner search` prints (SearchResult.distinct) and estimate.json's
    search.trials, and the counts in the frontier's legend."""
    if trials is None or trials.empty:
        return 0, 0
    df = distinct_trials(trials)
    return len(df), int(df["feasible"].sum())


def render(run: RunData, price_per_gpu_hour: float | None = None, train_tokens: float | None = None) -> str:
    """The page as a string."""
    head = analysis.headline(run, price_per_gpu_hour, train_tokens)
    top_df = analysis.top_plans(run, TOP_N)
    top = _nan_to_none(top_df.to_dict("records")) if not top_df.empty else []
    img, errors, extra = _figures(run, top, head)
    frac = head.get("memory_fraction")
    head["memory_fraction"] = frac if isinstance(frac, float) and math.isfinite(frac) else 0.0
    script = _resource("sort.js")
    digest = base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode("ascii")
    study = None
    if run.study is not None:
        h = run.study.history
        study = {"name": run.study.name, "direction": run.study.direction, "n_trials": len(h),
                 "n_complete": int((h["state"] == "COMPLETE").sum()),
                 "n_feasible": int(((h["state"] == "COMPLETE") & h["feasible"]).sum()),
                 "importance_note": run.study.importance_note}
    trials = run.trials
    evaluated, feasible = distinct_plans(trials)
    run_dir = run.run_dir
    inputs = run.doc.get("inputs", {}) if isinstance(run.doc.get("inputs"), dict) else {}
    try:
        version = metadata.version("planner")
    except metadata.PackageNotFoundError:
        version = "dev"
    context = {
        "version": version, "model": run.model, "plan": run.plan, "train": run.train, "cluster": run.cluster,
        "cluster_text": f"{run.cluster.world_size} x {run.cluster.device.name}",
        "device_name": run.cluster.device.name, "gpus_per_node": run.cluster.gpus_per_node,
        "run_dir": str(run_dir.resolve()), "run_arg": shlex.quote(str(run_dir)),
        "generated": _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "head": head, "base": head.get("baseline"), "measured_ratios": head.get("measured_ratios"),
        "notes": list(run.notes), "top": top, "img": img, "fig_errors": errors,
        "n_trials": evaluated, "n_feasible": feasible,
        "reason_counts": extra.get("reason_counts") or {}, "gantt": extra.get("gantt"),
        "cluster_info": extra.get("cluster_info"), "study": study, "search": run.search,
        "metrics": run.metrics, "verify": run.verify, "f": fmt, "ladder": extra.get("ladder"),
        "variant": run.variant, "bill": extra.get("bill"),
        "search_command": str(inputs.get("command") or ""), "model_arg": str(inputs.get("model_arg") or ""),
        "profile_path": str(inputs.get("profile") or run.cluster.device.path or "built-in"),
        "launch": run.launch, "launch_path": str(run_dir / "launch.sh"), "has_hostfile": run.files.get("hostfile"),
        "hostfile_path": str(run_dir / "hostfile"), "ds_config": run.ds_config,
        "ds_config_path": str((run_dir / "ds_config.json").resolve()),
        "ds_config_text": json.dumps(run.ds_config, indent=2) if run.ds_config is not None else "",
        "files": run.files, "script": Markup(script), "script_hash": f"sha256-{digest}",
    }
    template = _environment().from_string(_resource("template.html.j2"))
    return template.render(**context)


def write_report(run_dir: str | Path, price_per_gpu_hour: float | None = None,
                 train_tokens: float | None = None) -> Path:
    """Build run_dir/report.html from the files in the run directory; returns its path."""
    if price_per_gpu_hour is not None and not (isinstance(price_per_gpu_hour, (int, float))
                                               and math.isfinite(price_per_gpu_hour) and price_per_gpu_hour >= 0):
        raise SpecError("--price-per-gpu-hour", f"must be a number >= 0, got {price_per_gpu_hour!r}",
                        "give dollars per GPU-hour, e.g. 2.5")
    if train_tokens is not None and not (isinstance(train_tokens, (int, float)) and math.isfinite(train_tokens)
                                         and train_tokens > 0):
        raise SpecError("--train-tokens", f"must be a positive number, got {train_tokens!r}",
                        "give the number of training tokens, e.g. 4e11")
    run = load(run_dir)
    html = render(run, price_per_gpu_hour, train_tokens)
    out = run.run_dir / "report.html"
    atomic_write_text(out, html)
    return out
