"""`planner search`: parse -> load specs -> planner.search.driver.search -> write reports/<name>/."""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from planner.search.bill import OBJECTIVES, search_bill
from planner.cost.bill import tokens_text
from planner.cli.common import bill_options, common_inputs, load_bill, load_inputs, variant_option
from planner.cli.tuning import prepare as prepare_tuning
from planner.cli.tuning import refine_step, tuning_options
from planner.errors import SpecError
from planner.rundir import check_writable
from planner.report.plan_text import headroom_gb, headroom_text, host_memory_text, option_labels, plan_memory_flag
from planner.search.claim import claim
from planner.search.outputs import set_aside, set_aside_line, write_outputs
from planner.specs.estimate import GB, Estimate
from planner.specs.plan import Plan
from planner.cli.common import command_line, console, fp8_offered, runtime_comparison, runtimes_for

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}$")


def _default_name(model_name: str, gpus: str) -> str:
    raw = f"{model_name}_{gpus.replace(' ', '')}"
    return re.sub(r"[^A-Za-z0-9_.+-]+", "-", raw).strip("-.")[:120] or "run"


def _gb(x: float) -> str:
    return f"{x / GB:.1f}"


def _progress(console: Console, label: str):
    """A rich progress bar on a terminal; nothing when output is captured."""
    if not console.is_terminal:
        return None, None
    bar = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=console, transient=True)
    task = bar.add_task(label, total=None)
    return bar, (lambda done, total: bar.update(task, completed=done, total=total))


def _plan_cells(plan: Plan) -> list[str]:
    rc = plan.recompute
    if rc == "full" and plan.recompute_layers:
        rc = f"full {sum(plan.recompute_layers)}/{sum(plan.stage_layers) or '?'}"
    sched = f"interleaved x{plan.interleave}" if plan.schedule == "interleaved" else ("1F1B" if plan.pp > 1 else "-")
    variants = option_labels(plan)          # every option away from its default: else two rows look the same
    return [f"{plan.tp}x{plan.pp}x{plan.dp}", str(plan.zero), " ".join(variants) or "-",
            f"{plan.micro_batch}x{plan.grad_accum}", rc, "yes" if plan.sequence_parallel else "-", sched]


def _mem_cell(est: Estimate, cluster) -> str:
    """Peak / capacity GB per GPU, with "!" when the plan is near (or over) the usable memory."""
    flag = plan_memory_flag(est, cluster)
    return f"{_gb(est.peak_memory_bytes)}/{_gb(est.capacity_bytes)}" + (" !" if flag else "")


def _memory_lines(est: Estimate, cluster) -> list[str]:
    """The near-the-limit warning and the host memory per node of one plan, as printed lines."""
    out = []
    flag = plan_memory_flag(est, cluster)
    if flag:
        out.append(f"warning: {flag.text()}")
    host = host_memory_text(est, cluster.gpus_per_node, cluster.host.cpu_memory_gb)
    if host:
        out.append(f"host memory: {host}")
    return out


def baseline_words(plan: Plan, est: Estimate, train) -> str:
    """What the baseline is, in one sentence the CLI and verify share: the exact plan, its
    global batch when it differs from the user's, and where the comparison comes from."""
    from planner.search.baseline import baseline_note
    note = baseline_note(plan, train)
    words = f"baseline (plain data parallelism, ZeRO-0, every device): {plan.describe()}"
    if plan.precision != "fp32":
        # the "vs base" column compares at the run's precision; the 3x / one-third targets do not
        words += ("; the 3x / one-third targets compare against it in fp32 with padded static batches "
                  "(`planner verify` measures that)")
    return words + (f"; {note}" if note else "")


def _print_search(console: Console, result, cluster, run_dir: Path, written: list[str], top: int, train,
                  tokens: float | None = None) -> None:
    base = result.baseline
    vs_base = base.feasible                   # a speed-up needs a baseline that runs
    table = Table(title=f"Top plans ({result.method}: {result.distinct} distinct plans evaluated, "
                        f"{result.space_size} points in the search space, {result.wall_s:.2f} s)")

    def days(e: Estimate) -> list[str]:       # to train --tokens (docs/cost.md)
        return [] if tokens is None else [f"{tokens / e.tokens_per_s / 86400:,.1f}"]
    cols = ["#", "TPxPPxDP", "ZeRO", "ZeRO options", "micro x acc", "recompute", "SP", "schedule", "tokens/s",
            "step s", "MFU"] + ([f"days {tokens_text(tokens)}"] if tokens else []) + ["GB/GPU"] + \
        (["vs base"] if vs_base else [])
    for col in cols:
        table.add_column(col, justify="left" if col in ("ZeRO options", "recompute", "schedule") else "right")
    flagged = False
    for i, t in enumerate(result.ranked[:top], 1):
        e = t.estimate
        speed = [f"{e.tokens_per_s / base.tokens_per_s:.2f}x"] if vs_base else []
        mem = _mem_cell(e, cluster)
        flagged |= mem.endswith("!")
        table.add_row(str(i), *_plan_cells(t.plan), f"{e.tokens_per_s:,.0f}", f"{e.step_time_s:.2f}", f"{e.mfu:.1%}",
                      *days(e), mem, *speed)
    cells = _plan_cells(result.baseline_plan)
    if base.feasible:
        mem = _mem_cell(base, cluster)
        flagged |= mem.endswith("!")
        table.add_row("base", *cells, f"{base.tokens_per_s:,.0f}", f"{base.step_time_s:.2f}", f"{base.mfu:.1%}",
                      *days(base), mem, "1.00x")
    else:
        table.add_row("base", *cells, "does not fit", "-", "-", *(["-"] if tokens else []),
                      f"needs {_gb(base.peak_memory_bytes)}/{_gb(base.capacity_bytes)}")
    console.print(table)
    if flagged:
        console.print(f"! = near the memory limit: peak within 2% of the {_gb(cluster.usable_bytes)} GB usable "
                      f"per GPU (headroom {headroom_text(headroom_gb(cluster, result.best.estimate))} counted "
                      "in the peak, --memory-headroom)")
    if cluster.note:
        console.print(f"note: {cluster.note}")
    best = result.best
    extra = f"; blocks per stage {list(best.plan.stage_layers)}" if best.plan.pp > 1 else ""
    if best.plan.recompute_layers:
        extra += f"; checkpointed blocks per stage {list(best.plan.recompute_layers)}"
    console.print(f"chosen: {best.plan.describe()}{extra}")
    mem = ", ".join(f"stage {i}: {_gb(m.total)}" for i, m in enumerate(best.estimate.stage_memory))
    console.print(f"per-GPU memory (GB, capacity {_gb(best.estimate.capacity_bytes)}, usable "
                  f"{_gb(cluster.usable_bytes)}): {mem}")
    for line in _memory_lines(best.estimate, cluster):
        console.print(line)
    console.print(baseline_words(result.baseline_plan, base, train))
    if base.feasible:
        console.print(f"baseline: {base.tokens_per_s:,.0f} tokens/s, {_gb(base.peak_memory_bytes)} GB per GPU; "
                      f"the chosen plan: {best.estimate.tokens_per_s / base.tokens_per_s:.2f}x the tokens/s, "
                      f"{best.estimate.peak_memory_bytes / base.peak_memory_bytes:.2f}x the memory")
    else:
        console.print(f"baseline does not fit: needs {_gb(base.peak_memory_bytes)} GB per GPU > "
                      f"{_gb(base.capacity_bytes)} GB, so no plan is compared with it (no \"vs base\" column)")
    console.print(f"wrote {run_dir}/: {', '.join(written)}")


@click.command()
@common_inputs
@variant_option
@bill_options
@click.option("--objective", type=click.Choice(OBJECTIVES), default="throughput", show_default=True,
              help="Rank plans by tokens/s, or by the cost to train --tokens (spot cost with --spot).")
@click.option("--name", default=None, help="Run directory name (default: <model>_<gpus>).")
@click.option("--out-dir", default="reports", show_default=True, type=click.Path(file_okay=False),
              help="Parent of the run directory.")
@click.option("--overwrite", is_flag=True,
              help="Search into a run directory that holds a plan for other inputs, moving that plan to "
                   "RUN_DIR/previous/<time>/ (without it such a directory is refused).")
@click.option("--exhaustive", is_flag=True, help="Evaluate every legal plan instead of sampling with Optuna.")
@click.option("--prune", type=click.IntRange(0, 1000), default=0, show_default=True, metavar="K",
              help="With --exhaustive: keep the fastest max(K, --top) plans exact and estimate only the plans "
                   "the bounds cannot discard (trials.csv then lists those; docs/search.md). 0: every plan.")
@click.option("--trials", "n_trials", type=click.IntRange(1, 1_000_000), default=100, show_default=True,
              help="Optuna trials the study should hold (a rerun resumes up to this many).")
@click.option("--seed", type=int, default=0, show_default=True, help="Optuna sampler seed.")
@click.option("--storage", default=None, metavar="URL",
              help="Any Optuna storage URL (e.g. postgresql://...) to share one study between workers; "
                   "default: SQLite study.db in the run directory.")
@click.option("--top", type=click.IntRange(1, 100), default=5, show_default=True, help="Plans to show.")
@click.option("--refine", "refine_k", type=click.IntRange(1, 64), default=None, metavar="K",
              help="Closed loop: run the top K plans for a few steps with the executor, refit the profile's "
                   "factors to the measurements and re-rank (writes refine.json, profile-calibrated.json).")
@click.option("--refine-steps", type=click.IntRange(2, 1000), default=5, show_default=True,
              help="Optimizer steps per plan for --refine (the first is warm-up).")
@click.option("--megatron-features", is_flag=True,
              help="The same as --runtime megatron-core (kept for old command lines).")
@click.option("--runtime", default="deepspeed", show_default=True, metavar="NAME",
              help="The runtime the plan runs on: deepspeed (what `planner run` executes), megatron-core "
                   "(Megatron-LM / NeMo), fsdp (PyTorch FSDP), or all (search each and say which wins and by "
                   "how much; writes the deepspeed run). docs/runtimes.md")
@tuning_options
@click.pass_context
def search(ctx: click.Context, **kw: Any) -> None:
    """Find the fastest plan that fits and write reports/<name>/."""
    from planner.search.driver import search as run_search
    command = command_line(ctx)
    scale, model_arg, gpus = kw["scale"], kw["model_arg"], kw["gpus"]
    runtimes = runtimes_for(kw["runtime"], kw["megatron_features"])
    model, cluster, train = load_inputs(kw)
    fp8_offered(train, runtimes)
    if kw["prune"] and not kw["exhaustive"]:
        raise SpecError("--prune", "prunes the exhaustive sweep", "add --exhaustive, or drop --prune")
    if kw["prune"] and kw["objective"] == "cost":
        raise SpecError("--prune", "keeps the fastest plans exact, not the cheapest (--objective cost)",
                        "drop --prune")
    spec = load_bill(kw, model, cluster)
    name = kw["name"] or _default_name(model.name, gpus)
    if not _NAME_RE.match(name) or name in (".", ".."):
        raise SpecError("--name", f"{name!r} is not a plain directory name",
                        "use letters, digits, '.', '_', '+' or '-', e.g. --name glm130b-a100")
    out_dir = Path(kw["out_dir"])
    run_dir = out_dir / name
    if out_dir.exists() and not out_dir.is_dir():
        raise SpecError("--out-dir", f"{out_dir} is not a directory", "give a directory path")
    tuning = prepare_tuning(kw, model, cluster, train, runtimes[0])   # refuses bad tuning input first
    check_writable(run_dir, "--out-dir")
    held = claim(run_dir, {"model": model.to_dict(), "cluster": cluster.to_dict(), "train": train.to_dict()},
                 overwrite=kw["overwrite"])
    ctx.call_on_close(held.release)
    if held.moved:
        click.echo(held.moved)
    storage, tmp_db = tuning.storage, None
    rdb = None
    if not kw["exhaustive"] and storage is None:
        # the study runs in a temporary copy; it replaces study.db only when the search succeeds
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp_db = out_dir / f".{name}.study.db.tmp-{os.getpid()}"
        if (run_dir / "study.db").exists():
            shutil.copy2(run_dir / "study.db", tmp_db)
        rdb = _sqlite_storage(tmp_db)
        storage = rdb
    err = console(err=True)
    bar, progress = _progress(err, "searching")
    try:
        if bar:
            bar.start()
        results = {}
        for rt in runtimes:
            try:
                results[rt] = run_search(model, cluster, train, exhaustive=kw["exhaustive"],
                                         n_trials=kw["n_trials"], seed=kw["seed"],
                                         storage=storage if rt == runtimes[0] else None,
                                         progress=progress if rt == runtimes[0] else None, runtime=rt,
                                         study_name=tuning.study if rt == runtimes[0] else None,
                                         prune=max(kw["prune"], kw["top"]) if kw["prune"] else 0)
            except SpecError:
                if len(runtimes) == 1:
                    raise
                results[rt] = None  # fits nowhere on this runtime: said in the comparison
        result = results[runtimes[0]]
        if result is None:
            raise SpecError("--runtime", f"nothing fits on {runtimes[0]} (needed for the run directory)",
                            "use more or larger devices, or search one runtime that fits")
    except BaseException:
        if tmp_db is not None:
            _close(rdb)
            tmp_db.unlink(missing_ok=True)
        raise
    finally:
        if bar:
            bar.stop()
    result, bill, bill_text = search_bill(spec, result, model, cluster, kw["objective"])
    moved = set_aside_line(*set_aside(run_dir))
    try:
        written = write_outputs(run_dir, result, model, cluster, train, scale=scale, model_arg=model_arg,
                                 command=command, top=kw["top"], bill=bill)
        if tmp_db is not None:
            _close(rdb)
            os.replace(tmp_db, run_dir / "study.db")
            written.append("study.db")
    finally:
        if tmp_db is not None and tmp_db.exists():
            tmp_db.unlink()
    report = _write_report(run_dir, err)
    if report:
        written.append(report)
    _print_search(console(), result, cluster, run_dir, written, kw["top"], train, spec.tokens)
    for line in bill_text:
        click.echo(line)
    if len(runtimes) > 1:
        for line in runtime_comparison(results):
            console().print(line)
    elif result.best.plan.runtime != "deepspeed":
        console().print(f"note: {result.best.plan.runtime} plans are estimated, not executed here: `planner run` "
                         "runs DeepSpeed only (planner export --to megatron-lm writes Megatron-LM arguments)")
    if moved:
        click.echo(moved)
    if kw["refine_k"]:
        refine_step(run_dir, kw, tuning, err, console())


def _sqlite_storage(path: Path) -> Any:
    """Optuna's RDB storage on a SQLite file without an fsync per trial: the file is a
    temporary copy that replaces study.db only after the search succeeded."""
    import optuna
    from sqlalchemy import event

    rdb = optuna.storages.RDBStorage(f"sqlite:///{path}")

    def pragmas(conn: Any, _record: Any) -> None:
        cur = conn.cursor()
        cur.execute("PRAGMA synchronous=OFF")
        cur.execute("PRAGMA journal_mode=MEMORY")
        cur.close()

    event.listen(rdb.engine, "connect", pragmas)
    rdb.engine.dispose()
    return rdb


def _close(rdb: Any) -> None:
    if rdb is not None:
        rdb.engine.dispose()


def _write_report(run_dir: Path, err: Console) -> str | None:
    try:
        from planner.report import write_report
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("planner.report"):
            err.print("note: report.html not written (planner.report is not installed)")
            return None
        raise
    try:
        return Path(write_report(run_dir)).name
    except Exception as exc:  # the plan is written; say loudly that the report is not
        if os.environ.get("PLANNER_DEBUG"):
            raise
        err.print(f"warning: report.html not written: {type(exc).__name__}: {exc} "
                  "(set PLANNER_DEBUG=1 for a traceback and report it)")
        return None
