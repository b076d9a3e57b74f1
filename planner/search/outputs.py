"""What `planner search` and `planner estimate --write` write into a run directory (one
writer for the CLI, the sample report and the benchmarks, so what they start is what a user
would start).

A run directory holds one plan. Measurements of an earlier plan (metrics.json, verify.json,
checkpoints, ...) are moved to RUN_DIR/previous/<timestamp>/ before a new plan is written,
so the report never shows one plan's measurements as another's (`set_aside`).
"""
from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path
from typing import Any

from planner.rundir import atomic_write_json, atomic_write_text, plan_document
from planner.search.bill import default_spec, search_bill
from planner.specs.estimate import Estimate
from planner.specs.plan import Plan

MEASUREMENTS = ("metrics.json", "verify.json", "verify", ".ranks", "checkpoints", "debug", "logs",
                "refine.json", "refine", "profile-calibrated.json")
"""What running a plan leaves in its run directory (planner run / verify / search --refine)."""
SEARCH_FILES = ("trials.csv", "study.db", "report.html")
"""What a search leaves that a plan given by hand (`planner estimate --write`) does not replace."""
PREVIOUS = "previous"


def set_aside(run_dir: Path, names: tuple[str, ...] = MEASUREMENTS) -> tuple[Path | None, list[str]]:
    """Move the `names` present in run_dir into run_dir/previous/<UTC timestamp>/ (a rename
    each: nothing is copied or lost). Returns (that directory or None, the names moved)."""
    present = [n for n in names if (run_dir / n).exists() or (run_dir / n).is_symlink()]
    if not present:
        return None, []
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    dest = run_dir / PREVIOUS / stamp
    n = 1
    while dest.exists():
        n += 1
        dest = run_dir / PREVIOUS / f"{stamp}-{n}"
    dest.mkdir(parents=True)
    for name in present:
        os.replace(run_dir / name, dest / name)
    return dest, present


def set_aside_line(dest: Path | None, moved: list[str]) -> str | None:
    """The one line a command prints after set_aside (None when nothing moved)."""
    if dest is None:
        return None
    return f"moved {', '.join(moved)} of the previous plan to {dest}/ (they measured another plan)"


def estimate_summary(est: Estimate) -> dict[str, Any]:
    keys = ("feasible", "reasons", "step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "hfu", "peak_memory_gb",
            "capacity_gb", "bubble_fraction")
    j = est.to_json()
    return {k: j[k] for k in keys}


def baseline_section(plan: Plan, est: Estimate, train) -> dict[str, Any]:
    """estimate.json "baseline": the exact plan, its global batch, and its estimate or why it does not fit."""
    from planner.search.baseline import baseline_note
    out: dict[str, Any] = {"plan": plan.to_dict(), "description": plan.describe(),
                           "global_batch": plan.global_batch}
    note = baseline_note(plan, train)
    if note:
        out["note"] = note
    if est.feasible:
        out["estimate"] = est.to_json()
    else:
        out.update(fits=False, needs_gb=est.peak_memory_gb, reasons=list(est.reasons))
    return out


def loader_choice(plan: Plan, est: Estimate, model, cluster, train) -> dict[str, Any]:
    """DataLoader workers, pinned memory and prefetch depth for the plan (planner/data/loader.py:
    one micro-batch's production, measured here on the synthetic stream, against the plan's
    predicted compute per micro-batch). plan.json records it; `planner run` uses it unless
    --data-workers is given."""
    from planner.data.corpus import DataSpec
    from planner.data.batching import Layout, Rows
    from planner.data.loader import choose_loader, loader_record
    rows = Rows(DataSpec(seq_len=train.seq_len, vocab=model.vocab), "dynamic")
    layout = Layout(plan.micro_batch, plan.grad_accum, plan.dp)
    settings = choose_loader(rows, layout, device="cpu" if cluster.device.kind == "cpu" else "cuda",
                             step_time_s=est.step_time_s if est.feasible else None,
                             ranks_per_host=cluster.gpus_per_node)
    return loader_record(settings)


def variant_section(plan: Plan, est: Estimate, model, cluster, train) -> dict[str, Any]:
    """estimate.json "variant_comparison" for a model variant (docs/variants.md): the same plan
    for the base model and the variant, figure by figure with the ratio (what `planner estimate`
    prints and the report shows side by side); {} for a model without a variant."""
    if not getattr(model, "variant_label", ""):
        return {}
    from planner.specs.compare import comparison_doc, training_comparison
    from planner.cost import estimate
    base = model.base()
    rows = training_comparison(base, estimate(base, cluster, train, plan), model, est)
    return {"variant_comparison": comparison_doc(model, rows, description=model.describe())}


def write_plan_files(run_dir: Path, plan: Plan, est: Estimate, model, cluster, train, *, baseline_plan: Plan,
                     baseline: Estimate, scale: str | None, model_arg: str, command: str,
                     extra: dict[str, Any] | None = None) -> list[str]:
    """The files of one plan, each through a temporary file and a rename: plan.json (the plan,
    with the inputs that reproduce it), estimate.json (its estimate, the conventional baseline,
    and `extra`), ds_config.json, launch.sh, and the hostfile for several nodes (a stale one
    is removed on one node). Moves earlier measurements aside first (set_aside). Returns the
    names written."""
    from planner import dsconfig
    set_aside(run_dir)
    written: list[str] = []

    def put(name: str, data: Any, mode: int | None = None) -> None:
        if isinstance(data, str):
            atomic_write_text(run_dir / name, data, mode)
        else:
            atomic_write_json(run_dir / name, data)
        written.append(name)

    doc = plan_document(plan, model, cluster, train, scale=scale, model_arg=model_arg, command=command)
    doc["loader"] = loader_choice(plan, est, model, cluster, train)
    put("plan.json", doc)
    put("estimate.json", {"plan": plan.to_dict(), "description": plan.describe(), "estimate": est.to_json(),
                          "baseline": baseline_section(baseline_plan, baseline, train),
                          **variant_section(plan, est, model, cluster, train), **(extra or {})})
    put("ds_config.json", dsconfig.ds_config(plan, model, train, cluster))
    put("launch.sh", dsconfig.launch_script(plan, model, train, cluster, str(run_dir)), 0o755)
    host = dsconfig.hostfile(cluster)
    if host:
        put("hostfile", host)
    else:
        (run_dir / "hostfile").unlink(missing_ok=True)
    return written


def write_outputs(run_dir: Path, result, model, cluster, train, *, scale: str | None, model_arg: str,
                  command: str, top: int, bill: dict[str, Any] | None = None) -> list[str]:
    """A search's run directory: write_plan_files for the pick (estimate.json also holds the
    search's counts, the top plans and the Pareto front) and trials.csv (every evaluated
    point, then the baseline). `bill` is estimate.json's "bill" (planner/search/bill.py; None:
    the bill with no cost flags). Returns the names written. Used by `planner search`,
    report/sample.py and benchmarks/plans_start.py."""
    from planner.search.evaluate import Trial
    from planner.search.trials import write_trials
    best = result.best
    extra = {
        "search": {"method": result.method, "trials": result.distinct, "rows": len(result.trials),
                   "space_size": result.space_size, "wall_s": result.wall_s, "study_name": result.study_name,
                   **({"pruned": result.pruned} if getattr(result, "pruned", None) is not None else {})},
        "top": [{"plan": t.plan.to_dict(), "description": t.plan.describe(), "estimate": estimate_summary(t.estimate)}
                for t in result.ranked[:top]],
        "pareto_front": [{"plan": t.plan.to_dict(), "tokens_per_s": t.tokens_per_s, "peak_memory_gb": t.needs_gb}
                         for t in result.front]}
    if bill is None:
        bill = search_bill(default_spec(model, cluster), result, model, cluster, "throughput")[1]
    extra["bill"] = bill
    written = write_plan_files(run_dir, best.plan, best.estimate, model, cluster, train,
                               baseline_plan=result.baseline_plan, baseline=result.baseline, scale=scale,
                               model_arg=model_arg, command=command, extra=extra)
    base = result.baseline
    base_trial = Trial(outer=best.outer, plan=result.baseline_plan, estimate=base, feasible=base.feasible,
                       problems=base.problems, needs_bytes=base.peak_memory_bytes,
                       capacity_bytes=base.capacity_bytes, source="baseline")
    rows = list(enumerate(result.trials)) + [(len(result.trials), base_trial)]
    write_trials(run_dir / "trials.csv", rows)
    written.append("trials.csv")
    return written


def write_estimate(run_dir: Path, plan: Plan, est: Estimate, model, cluster, train, *, scale: str | None,
                   model_arg: str, command: str, extra: dict[str, Any] | None = None) -> list[str]:
    """`planner estimate --write`: the run directory of a plan the user gave, with the same
    files a search writes for its pick (write_plan_files) and a two-row trials.csv (the plan
    and the baseline, so the report's table compares them). A previous search's trials.csv,
    study.db and report.html are moved aside with the measurements: they explain another pick."""
    from planner.search.baseline import conventional_baseline
    from planner.search.evaluate import Trial
    from planner.search.trials import write_trials
    set_aside(run_dir, MEASUREMENTS + SEARCH_FILES)
    bplan, base = conventional_baseline(model, cluster, train)
    written = write_plan_files(run_dir, plan, est, model, cluster, train, baseline_plan=bplan, baseline=base,
                               scale=scale, model_arg=model_arg, command=command, extra=extra)
    rows = [(0, Trial(outer=None, plan=plan, estimate=est, feasible=est.feasible,  # type: ignore[arg-type]
                      problems=est.problems, needs_bytes=est.peak_memory_bytes,
                      capacity_bytes=est.capacity_bytes, source="estimate")),
            (1, Trial(outer=None, plan=bplan, estimate=base, feasible=base.feasible,  # type: ignore[arg-type]
                      problems=base.problems, needs_bytes=base.peak_memory_bytes,
                      capacity_bytes=base.capacity_bytes, source="baseline"))]
    write_trials(run_dir / "trials.csv", rows)
    written.append("trials.csv")
    return written
