"""`planner estimate`: parse -> load specs -> planner.cost.estimate for the plan the user gives -> print."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from planner.search.bill import estimate_bill
from planner.cli.common import (bill_options, common_inputs, comparison_table, load_bill, load_inputs,
                                 variant_option)
from planner.cli.plan_options import build_plan, plan_fields, plan_options
from planner.errors import SpecError
from planner.rundir import check_writable
from planner.report.plan_text import headroom_gb, headroom_text, host_bytes_per_rank, host_memory_text, plan_memory_flag
from planner.search.outputs import MEASUREMENTS, SEARCH_FILES, set_aside, set_aside_line, write_estimate
from planner.specs.estimate import GB, Estimate
from planner.specs.plan import Plan
from planner.specs.validate import plan_problems, runtime_problems
from planner.specs.compare import comparison_doc, training_comparison
from planner.cli.common import command_line, console, fp8_offered, runtimes_for


@click.command()
@common_inputs
@variant_option
@bill_options
@plan_options
@click.option("--runtime", default="deepspeed", show_default=True, metavar="NAME",
              help="deepspeed, megatron-core or fsdp (docs/runtimes.md); only deepspeed plans can be --write'n "
                   "and run here.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--write", "write_dir", default=None, metavar="DIR", type=click.Path(path_type=Path),
              help="Also write DIR as a run directory for this plan (plan.json, estimate.json with the baseline, "
                   "ds_config.json, launch.sh, hostfile on several nodes), the files `planner search` writes "
                   "for its pick; then `planner run DIR` or `planner export DIR`.")
@click.pass_context
def estimate(ctx: click.Context, **kw: Any) -> None:
    """Predict step time, throughput and per-GPU memory of a plan you give."""
    from planner.cost import estimate as cost_estimate
    command = command_line(ctx)
    scale, model_arg, write_dir = kw["scale"], kw["model_arg"], kw["write_dir"]
    if write_dir is not None and write_dir.exists() and not write_dir.is_dir():
        raise SpecError("--write", f"{write_dir} is not a directory", "give a directory path (it is created)")
    if write_dir is not None:
        check_writable(write_dir, "--write")
    model, cluster, train = load_inputs(kw)
    spec = load_bill(kw, model, cluster)
    tp, pp, mb, cp = kw["tp"], kw["pp"], kw["micro_batch"], kw["cp"]
    for flag, v in (("--tp", tp), ("--pp", pp), ("--micro-batch", mb), ("--interleave", kw["interleave"]),
                    ("--ep", kw["ep"]), ("--cp", cp)):
        if v < 1:
            raise SpecError(flag, f"must be a positive integer, got {v}", "give 1 or more")
    world = cluster.world_size
    if world % (tp * pp * cp):
        raise SpecError("--tp/--pp/--cp", f"tp {tp} x pp {pp} x cp {cp} = {tp * pp * cp} does not divide the "
                        f"{world} devices", f"choose degrees whose product divides {world}")
    dp = world // (tp * pp * cp)
    fields = plan_fields(kw)
    plan = build_plan(**{**fields, "dp": dp, "grad_accum": max(1, train.global_batch // (mb * dp)),
                         "schedule": "interleaved" if kw["interleave"] > 1 else "1f1b", "precision": train.precision,
                         "runtime": runtimes_for(kw["runtime"], False)[0]})
    fp8_offered(train, [plan.runtime])
    from planner.cost import runtime as runtimes
    lacking = runtimes.problems(runtimes.get_runtime(plan.runtime), plan)
    if lacking:
        raise lacking[0].error(field="--runtime")
    batch_ok = train.global_batch % (mb * dp) == 0
    problems = [p for p in plan_problems(model, cluster, train, plan) if batch_ok or p.code != "global-batch"]
    if problems:
        raise SpecError("plan", problems[0].line, "change the flags named above")
    if not batch_ok:
        raise SpecError("--micro-batch", f"micro-batch {mb} x dp {dp} = {mb * dp} does not divide the global "
                        f"batch {train.global_batch}", "choose --micro-batch and --global-batch so that "
                        "global batch = micro-batch x accumulation x dp")
    est = cost_estimate(model, cluster, train, plan)
    compare = training_comparison(model.base(), cost_estimate(model.base(), cluster, train, plan), model, est) \
        if model.variant_label else None
    runtime = [p.line for p in runtime_problems(plan, model)]
    bill, bill_text = estimate_bill(spec, est, plan, model, cluster)
    written: list[str] = []
    moved = None
    if write_dir is not None:
        if plan.runtime != "deepspeed":
            raise SpecError("--write", f"a {plan.runtime} plan is estimated, not run here (`planner run` executes "
                            "DeepSpeed only)", "estimate it without --write, or use --runtime deepspeed")
        if runtime:
            raise SpecError("--write", f"DeepSpeed cannot run this plan ({runtime[0]})",
                            "drop --interleave / --mics-shard to write a run directory; estimate it without --write")
        if not est.feasible:
            raise SpecError("--write", f"the plan does not fit: {'; '.join(est.reasons)}",
                            "write a plan that fits (less micro-batch, more recompute, ZeRO or TP/PP)")
        moved = set_aside_line(*set_aside(write_dir, MEASUREMENTS + SEARCH_FILES))
        written = write_estimate(write_dir, plan, est, model, cluster, train, scale=scale, model_arg=model_arg,
                                 command=command, extra={"bill": bill})
    if kw["as_json"]:
        doc = est.to_json()
        flag = plan_memory_flag(est, cluster)
        host = host_bytes_per_rank(est)
        doc.update(plan=plan.to_dict(), description=plan.describe(), note=cluster.note,
                   variants=list(plan.variants), memory_headroom_gb=headroom_gb(cluster, est),
                   usable_memory_gb=cluster.usable_bytes / GB, memory_warning=flag.text() if flag else None,
                   host_memory_per_node_gb=host * cluster.gpus_per_node / GB,
                   host_memory_capacity_gb=cluster.host.cpu_memory_gb, runtime_warnings=runtime,
                   written=[str(write_dir / n) for n in written], bill=bill)
        if compare:
            doc["variant_comparison"] = comparison_doc(model, compare)
        click.echo(json.dumps(doc))
        return
    out = console()
    _print_estimate(out, plan, est, cluster)
    if compare:
        out.print(comparison_table(f"--variant: {model.describe()}", compare, model.base().name, model.name))
    for problem in runtime:
        out.print(f"warning: {problem}; this estimate is for comparison with Megatron-LM only")
    for line in bill_text:
        click.echo(line)
    if write_dir is not None:
        out.print(f"wrote {write_dir}/: {', '.join(written)}")
        if moved:
            click.echo(moved)


def _print_estimate(console: Console, plan: Plan, est: Estimate, cluster) -> None:
    table = Table(title=plan.describe(), show_header=False)
    table.add_column("figure")
    table.add_column("value", justify="right")
    rows = [("fits", "yes" if est.feasible else "NO: " + "; ".join(est.reasons)),
            ("step time", f"{est.step_time_s:.3f} s"), ("tokens/s", f"{est.tokens_per_s:,.0f}"),
            ("TFLOP/s per GPU", f"{est.tflops_per_gpu:.1f}"), ("MFU / HFU", f"{est.mfu:.1%} / {est.hfu:.1%}"),
            ("pipeline bubble", f"{est.bubble_fraction:.1%}"),
            ("peak memory per GPU", f"{est.peak_memory_gb:.1f} / {est.capacity_bytes / GB:.1f} GB "
                                    f"(stage {est.peak_stage})"),
            ("usable memory per GPU", f"{cluster.usable_bytes / GB:.1f} GB (headroom "
                                      f"{headroom_text(headroom_gb(cluster, est))} counted in the peak)")]
    if plan.variants:
        rows.insert(1, ("ZeRO variants", ", ".join(plan.variants)))
    host = host_memory_text(est, cluster.gpus_per_node, cluster.host.cpu_memory_gb)
    if host:
        rows.append(("host memory", host))
    rows += [(f"  memory: {k}", f"{v:.2f} GB") for k, v in est.stage_memory[est.peak_stage].to_gb().items()]
    rows += [(f"  time: {k}", f"{v:.4f} s") for k, v in est.time.to_dict().items()]
    for r in rows:
        table.add_row(*r)
    console.print(table)
    flag = plan_memory_flag(est, cluster)
    if flag:
        console.print(f"warning: {flag.text()}")
    if cluster.note:
        console.print(f"note: {cluster.note}")
