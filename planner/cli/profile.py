"""`planner profile` (measure this machine) and `planner calibrate` (fit the cost model's factors)."""
from __future__ import annotations

import os
from pathlib import Path

import click

from planner.errors import SpecError


@click.command()
@click.option("--quick", is_flag=True, help="A pass of about a minute: fewer shapes, points, message sizes and repeats.")
@click.option("--out", "out", default=None, metavar="PROFILE.JSON",
              help="Where to write the profile (default profiles/<device>-measured.json).")
@click.option("--model", "model_arg", default=None, metavar="NAME|CONFIG.JSON",
              help="Model whose layer shapes and block are measured (default chatglm3-6b on CPU, glm-4-9b on GPU).")
@click.option("--scale", type=click.Choice(["full", "tiny", "small"]), default=None,
              help="Shrink the model (default tiny on CPU, full on GPU).")
@click.option("--procs", type=int, default=None,
              help="Processes for the collective benchmarks (default: GPUs, or 2 on CPU); 1 skips them.")
@click.option("--max-tp", type=int, default=None, help="Largest TP degree whose per-rank shapes are measured (default --procs).")
@click.option("--precision", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True,
              help="Precision of the GEMM sweep and block timings.")
@click.option("--name", default=None, help="Profile name (default <device>-measured).")
@click.option("--cpu", "force_cpu", is_flag=True, help="Profile the CPU even when a GPU is present.")
def profile(quick: bool, out: str | None, model_arg: str | None, scale: str | None, procs: int | None,
            max_tp: int | None, precision: str, name: str | None, force_cpu: bool) -> None:
    """Measure this machine and write a device profile (use it with --profile)."""
    from planner.rundir import check_writable
    check_writable(Path(out).parent if out else Path("profiles"), "--out")  # before minutes of measuring
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from planner.cli.common import load_model
    from planner.profiler import ProfileOptions, profile_machine, write

    gpu = torch.cuda.is_available() and not force_cpu
    if procs is None:
        procs = torch.cuda.device_count() if gpu else min(2, os.cpu_count() or 1)
    if procs < 1 or (gpu and procs > torch.cuda.device_count()):
        raise SpecError("--procs", f"{procs} is not between 1 and the {torch.cuda.device_count() if gpu else 'CPU'} "
                        "devices here", "give a smaller count")
    if max_tp is not None and max_tp < 1:
        raise SpecError("--max-tp", f"must be >= 1, got {max_tp}", "give a TP degree such as 2")
    model = load_model(model_arg or ("glm-4-9b" if gpu else "chatglm3-6b"), scale or ("full" if gpu else "tiny"))
    # CPU, default model: the block of the lab's other scale too (the step probe's line spans both)
    others = (load_model("chatglm3-6b", "small"),) if not gpu and model_arg is None and scale is None else ()
    opts = ProfileOptions(model=model, precision=precision, quick=quick, procs=procs, max_tp=max_tp or max(1, procs),
                          block_models=others)
    console = Console(stderr=True)
    with Progress(TextColumn("[bold]profile"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=console, transient=True) as bar:
        task = bar.add_task("starting", total=None)
        data = profile_machine(opts, name=name, force_cpu=force_cpu,
                               on_plan=lambda p: bar.update(task, total=p.total),
                               tick=lambda d: bar.update(task, advance=1, description=d))
    path = Path(out or Path("profiles") / f"{data['name']}.json")
    write.write(path, data)
    m = data["measured"]
    click.echo(f"wrote {path} ({data['kind']}, {m['environment']['device']}, {m['wall_s']:.1f} s)")
    click.echo("peak TFLOP/s: " + ", ".join(f"{p} {v:.3g}" for p, v in data["peak_tflops"].items()))
    click.echo(f"memory bandwidth: {data['hbm_bandwidth_gbps']:.1f} GB/s; memory {data['memory_gb']:.1f} GB")
    click.echo(f"intra-node: {data['intra_node']['busbw_gbps']:.3g} GB/s busbw, "
               f"{data['intra_node']['latency_us']:.1f} us per step ({data['sources']['intra_node'].split(':')[0]})")
    for note in m["notes"]:
        click.echo(f"note: {note}")
    click.echo(f"use it: planner search --gpus {data['gpus_per_node']}x{'cpu' if data['kind'] == 'cpu' else 'GPU'} "
               f"--profile {path} ...")


@click.command()
@click.argument("run_dirs", nargs=-1, required=False, metavar="RUN_DIRS...")
@click.option("--reference", is_flag=True,
              help="Fit DeepSpeed's factors per GPU generation on its published runs (profiles/reference/"
                   "deepspeed-rows.json) and write them, with their sources, into the built-in profiles/.")
@click.option("--loo", is_flag=True, help="With --reference: also print every row predicted by a fit without it (slower).")
@click.option("--profile", "profile_path", default=None, metavar="PROFILE.JSON",
              help="Profile whose factors are fitted (default: the one the runs were planned with).")
@click.option("--out", "out", default=None, metavar="PROFILE.JSON",
              help="Where to write the calibrated profile (default: over --profile; required for a built-in one).")
@click.option("--no-layers", is_flag=True, help="Fit to the runs only, not to the profile's per-block timings.")
@click.option("--serving", is_flag=True,
              help="The runs are serving runs (serve_metrics.json, planner serve-bench): fit the serving factors "
                   "(automatic when every RUN_DIR holds a serve_metrics.json); --profile defaults to the cpu one.")
def calibrate(run_dirs: tuple[str, ...], reference: bool, loo: bool, profile_path: str | None, out: str | None,
              no_layers: bool, serving: bool) -> None:
    """Fit the cost model's runtime factors to measured runs (metrics.json) and write them into the profile."""
    import json

    if reference:
        if run_dirs or profile_path or out or serving:
            raise SpecError("--reference", "fits the published runs in profiles/reference/ into the built-in profiles",
                            "drop RUN_DIRS, --profile, --out and --serving")
        from planner.calibrate import reference as ref
        ref.main(["--apply"] + ([] if loo else ["--no-loo"]))
        return
    if not run_dirs:
        raise SpecError("RUN_DIRS", "missing", "give the run directories to fit, or --reference")

    if serving or all(_serve_metrics(d).is_file() for d in run_dirs):
        _calibrate_serving(run_dirs, profile_path, out)
        return

    from rich.console import Console
    from rich.table import Table

    from planner.calibrate import apply, calibrate as fit, load_measured
    from planner.specs.hardware import load_profile

    device = load_profile(profile_path) if profile_path else None  # a bad profile fails before any run is read
    runs = [load_measured(d) for d in run_dirs]
    if device is None:
        paths = {r.cluster.device.path for r in runs}
        if len(paths) != 1 or not next(iter(paths)):
            raise SpecError("--profile", "the runs were planned with different or unknown profiles",
                            "pass --profile PROFILE.JSON")
        device = runs[0].cluster.device
        profile_path = device.path
    raw = json.loads(Path(profile_path).read_text())
    if out is None:
        if raw.get("builtin", True) is not False:
            raise SpecError("--out", f"{profile_path} is a built-in profile", "write the calibrated copy elsewhere: "
                            "--out profiles/<name>-calibrated.json")
        out = profile_path
    cal = fit(device, runs, use_layers=not no_layers)
    from planner.rundir import atomic_write_json
    atomic_write_json(out, apply(raw, cal))
    console = Console(highlight=False)
    console.width = max(console.width, 120)
    table = Table(title=f"{len(runs)} run(s): measured vs predicted (before / after / held out)",
                  caption="plan: ZeRO stage, tp x pp x dp, micro-batch, accumulation, recompute, precision")
    table.add_column("plan", no_wrap=True)
    for col in ("step s", "before", "after", "held out", "mem GB", "before", "after", "held out"):
        table.add_column(col, justify="right", no_wrap=True)
    for r, run in zip(cal.rows, runs):
        t, m = r["step_time_s"], r["peak_memory_gb"]
        table.add_row(_short(run.plan), *(f"{t[k]:.3g}" for k in ("measured", "before", "after", "held_out")),
                      *(f"{m[k]:.3g}" for k in ("measured", "before", "after", "held_out")))
    console.print(table)
    s = cal.summary
    for key, label in (("step_time_mape_pct", "step time"), ("memory_mape_pct", "memory")):
        v = s[key]
        console.print(f"{label} MAPE: before {v['before']:.1f}%, after {v['after']:.1f}%, held out {v['held_out']:.1f}%")
    if s["layer_points"]:
        v = s["layer_time_mape_pct"]
        console.print(f"block time MAPE ({s['layer_points']} profiler points): before {v['before']:.1f}%, after {v['after']:.1f}%")
    console.print("factors: " + ", ".join(f"{k}={v:.4g}" for k, v in cal.factors.items()))
    if s["undetermined"]:
        console.print("not determined by these runs (kept near default): " + ", ".join(s["undetermined"]))
    console.print(f"wrote {out}")


def _short(plan) -> str:
    """A plan in one short cell, e.g. Z1 1x2x1 mb2 ga4 full bf16."""
    return (f"Z{plan.zero} {plan.tp}x{plan.pp}x{plan.dp} mb{plan.micro_batch} ga{plan.grad_accum} "
            f"{plan.recompute} {plan.precision}")


def _serve_metrics(run_dir: str) -> Path:
    """A serving run's metrics: the file itself, or serve_metrics.json in the directory."""
    p = Path(run_dir)
    return p if p.is_file() and p.suffix == ".json" else p / "serve_metrics.json"


def _calibrate_serving(run_dirs: tuple[str, ...], profile_path: str | None, out: str | None) -> None:
    """Fit the serving factors (planner/serve/calibrate.py) to serving runs; write the profile."""
    import json

    from planner.serve.calibrate import ORDER, write_serving_profile
    from planner.specs.hardware import PROFILES_DIR

    runs = []
    for d in run_dirs:
        f = _serve_metrics(d)
        try:
            runs.append(json.loads(f.read_text()))
        except (OSError, ValueError) as exc:
            raise SpecError("RUN_DIRS", f"{f}: no readable serve_metrics.json ({exc.__class__.__name__})",
                            "pass directories written by planner serve-bench") from None
    profile_path = profile_path or str(PROFILES_DIR / "cpu.json")
    try:
        raw = json.loads(Path(profile_path).read_text())
    except (OSError, ValueError) as exc:
        raise SpecError("--profile", f"cannot read {profile_path} ({exc.__class__.__name__})",
                        "pass a profile JSON") from None
    if out is None:
        if raw.get("builtin", True) is not False:
            raise SpecError("--out", f"{profile_path} is a built-in profile", "write the calibrated copy elsewhere: "
                            "--out profiles/<name>-serving.json")
        out = profile_path
    rep = write_serving_profile(profile_path, runs, out)
    click.echo(f"{len(runs)} serving run(s), {rep['steps']} steps: step-time MAPE {rep['mape_before_pct']:.1f}% -> "
               f"{rep['mape_after_pct']:.1f}%")
    for k in ORDER:
        click.echo(f"  {k} = {rep['factors'][k]:.4g}")
    click.echo(f"wrote {out}; use it: planner serve --profile {out} ...")
