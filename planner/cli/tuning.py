"""`planner search` options for tuning on a cluster (docs/distributed-tuning.md): a named study
in a shared storage, trials launched on a node group, a dry run, timeouts and heartbeats.

    planner search ... --refine 4 --storage postgresql://tuner@db/optuna --study glm-a100 \\
        --hostfile hosts --include node-3 --trial-timeout 900

Everything a worker could refuse is checked by `prepare` before the search writes anything:
the storage URL, a study (search or runs) created for other inputs, a node group that is not
the plan's cluster, options that need --refine.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import click
from rich.console import Console

from planner.errors import SpecError


def tuning_options(f: Callable) -> Callable:
    opts = [
        click.option("--study", default=None, metavar="NAME",
                     help="Optuna study name (default: derived from the inputs). With --storage and --refine, "
                          "workers naming the same study share the real runs (study NAME.runs)."),
        click.option("--refine-plans", default="", metavar="LIST",
                     help="--refine K: run these K plans of the search's ranking by predicted step time (1-based "
                          "positions, the # column of the plans table, e.g. 1,40) instead of the first K."),
        click.option("--hostfile", default=None, metavar="PATH",
                     help="--refine: launch each trial with the deepspeed launcher on this hostfile's hosts "
                          "('<host> slots=<n>' lines)."),
        click.option("--include", default="", metavar="NODE[:SLOTS][@...]",
                     help="--refine: this worker's node group within --hostfile (deepspeed --include syntax)."),
        click.option("--exclude", default="", metavar="NODE[:SLOTS][@...]",
                     help="--refine: hosts/slots of --hostfile this worker leaves out (deepspeed --exclude)."),
        click.option("--cores", default="", metavar="LIST",
                     help="--refine with a local --hostfile group: run this group's launcher and ranks on these "
                          "CPU cores only (taskset -c; the launcher's --bind_core_list syntax, e.g. 0-3,8), so "
                          "workers sharing a machine do not share cores."),
        click.option("--dry-run", is_flag=True,
                     help="--refine: print the launch command of each top plan and run nothing."),
        click.option("--trial-timeout", type=click.FloatRange(1, 86400), default=1800, show_default=True,
                     help="--refine: seconds one trial's run may take before it is stopped and failed."),
        click.option("--heartbeat", type=click.FloatRange(1, 3600), default=30, show_default=True,
                     help="--refine with --storage: seconds between a running trial's heartbeats; a trial "
                          "silent for twice this is failed and retried by another worker."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


@dataclasses.dataclass
class Tuning:
    """What `prepare` checked: the storages, the study names, the node group."""

    url: str | None
    study: str | None
    storage: Any = None            # the search's study storage (no heartbeats)
    runs_storage: Any = None       # the real runs' storage (heartbeats, retries)
    group: Any = None              # planner.runtime.train.group_launch.NodeGroup or None
    picks: tuple[int, ...] = ()    # --refine-plans: positions in the ranking (empty: the first K)
    runs_key: str = ""
    label: str = ""


def prepare(kw: dict[str, Any], model: Any, cluster: Any, train: Any, runtime: str = "deepspeed") -> Tuning:
    """Refuse bad tuning input before anything is written (SpecError: one line, exit 2)."""
    from planner.search.storage import check_study, open_storage, safe_url
    k = kw["refine_k"]
    for flag, given in (("--refine-plans", kw["refine_plans"]), ("--hostfile", kw["hostfile"]),
                        ("--include", kw["include"]), ("--exclude", kw["exclude"]),
                        ("--cores", kw["cores"]), ("--dry-run", kw["dry_run"])):
        if given and not k:
            raise SpecError(flag, "only applies to --refine K (the trials run for real)",
                            f"add --refine K, or drop {flag}")
    study = kw["study"]
    if study is not None and (not study.strip() or len(study) > 256):
        raise SpecError("--study", f"{study!r} is not a study name", "give a name of 1-256 characters, e.g. --study glm")
    t = Tuning(url=kw["storage"], study=study, picks=_picks(kw["refine_plans"], k))
    if kw["refine_k"]:
        from planner.runtime.train.group_launch import NodeGroup
        t.group = NodeGroup.parse(kw["hostfile"], kw["include"], kw["exclude"], kw["cores"])
        if t.group is not None:
            t.group.check(cluster)
    if t.url is None or kw["exhaustive"]:
        return t
    t.storage = open_storage(t.url)
    from planner.search.optuna_search import study_key, study_label, study_name
    from planner.search.space import Space
    # the space planner.search.driver.search builds for `runtime` (the study's key depends on it)
    space = Space(model=model, cluster=cluster, train=train, megatron_features=runtime == "megatron-core",
                  runtime=runtime)
    t.study = study or study_name(space)
    t.label = study_label(space)
    check_study(t.storage, t.study, study_key(space), t.label, f" in {safe_url(t.url)}")
    if k and not kw["dry_run"]:
        from planner.tune.shared import runs_key, runs_study_name
        t.runs_storage = open_storage(t.url, heartbeat_s=kw["heartbeat"])
        t.runs_key = runs_key(study_key(space), k, kw["refine_steps"], 1, t.picks)
        check_study(t.runs_storage, runs_study_name(t.study), t.runs_key, t.label, f" in {safe_url(t.url)}")
    return t


def _picks(text: str, k: int | None) -> tuple[int, ...]:
    """--refine-plans 1,40: K distinct positions >= 1 (checked against the ranking after the search)."""
    if not text or not k:
        return ()
    fix = f"give {k} distinct plan numbers of the ranking, e.g. --refine-plans {','.join(map(str, range(1, k + 1)))}"
    try:
        picks = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise SpecError("--refine-plans", f"{text!r} is not a list of plan numbers", fix) from None
    if min(picks) < 1 or len(set(picks)) != len(picks) or len(picks) != k:
        raise SpecError("--refine-plans", f"{text!r} does not name {k} distinct plans numbered from 1 (--refine {k})",
                        fix)
    return picks


def _runner(t: Tuning, timeout: float) -> tuple[Callable[[Path, int, int], dict], Callable[[Path], str]]:
    """How one trial runs: the deepspeed launcher on the node group, else the executor here."""
    if t.group is not None:
        from planner.runtime.procs import free_port
        from planner.runtime.train.group_launch import dry_run_line
        group = t.group
        return (lambda sub, steps, warmup: group.run(sub, steps=steps, warmup=warmup, timeout=timeout),
                lambda sub, steps=0, warmup=1: dry_run_line(group.command(sub, steps=steps, warmup=warmup,
                                                                          port=free_port()), sub))

    def local(sub: Path, steps: int, warmup: int) -> dict:
        from planner.runtime.train.launch import run_plan
        return run_plan(sub, steps=steps, warmup=warmup, timeout=timeout)
    return local, lambda sub, steps=0, warmup=1: f"planner run {sub} --steps {steps} --warmup {warmup}"


def refine_step(run_dir: Path, kw: dict[str, Any], t: Tuning, err: Console, out: Console) -> None:
    """--refine K after the search: dry run, shared study, or the one-machine loop; print the outcome."""
    from planner.tune.refine import prepare_plan_dir, refine, top_plans, with_device
    from planner.rundir import load_run
    k, steps = kw["refine_k"], kw["refine_steps"]
    runner, describe = _runner(t, kw["trial_timeout"])
    if kw["dry_run"]:
        _, model, cluster, train, doc = load_run(run_dir)
        c = with_device(cluster, cluster.device)
        for i, (_, plan, _) in enumerate(top_plans(run_dir / "trials.csv", k, t.picks)):
            sub = run_dir / "refine" / f"plan-{i}"
            prepare_plan_dir(sub, plan, model, c, train, doc, run_dir)
            out.print(f"# plan {i + 1}: {plan.describe()}", soft_wrap=True)
            click.echo(describe(sub, steps, 1))
        if t.group is not None and not t.group.local:
            first = t.group.hosts[0]
            out.print(f"# before each launch the run directory is copied over ssh to the hosts of "
                      f"{t.group.describe()} that do not share it; after it metrics.json is read back from "
                      f"{first} (ssh {first} cat RUN_DIR/metrics.json) unless {first} shares it", soft_wrap=True)
        out.print("dry run: nothing launched, nothing written to a study")
        return
    if t.runs_storage is not None:
        from planner.tune.shared import refine_shared
        group = t.group.describe() if t.group is not None else "local"
        result = refine_shared(run_dir, k, steps, warmup=1, storage=t.runs_storage, study=t.study, key=t.runs_key,
                               label=t.label, runner=runner, describe_run=lambda sub: describe(sub, steps, 1),
                               group=group, url=t.url or "", picks=t.picks,
                               echo=lambda line: err.print(line, soft_wrap=True))
    else:
        result = refine(run_dir, k, steps=steps, warmup=1, picks=t.picks, runner=runner,
                        echo=lambda line: err.print(line))
    _print(out, run_dir, result)


def _print(out: Console, run_dir: Path, result: dict[str, Any]) -> None:
    summary = result.get("summary", {})

    def pct(x: object) -> str:
        return f"{x:.1f}%" if isinstance(x, (int, float)) and x == x else "n/a"
    for key, label in (("step_time_mape_pct", "step time"), ("memory_mape_pct", "peak memory")):
        e = summary.get(key) or {}
        out.print(f"refine {label} error (MAPE): before {pct(e.get('before'))}, after refit {pct(e.get('after'))}, "
                  f"held out {pct(e.get('held_out'))} over {summary.get('runs', 0)} runs")
    ranking = result.get("ranking", {})
    best = result.get("best_measured")
    if best:
        trials = result.get("trials", [])
        states = {s: sum(1 for r in trials if r["state"] == s) for s in ("COMPLETE", "FAIL")}
        retried = sum(1 for r in trials if r.get("retry_of") is not None)
        out.print(f"study {result['study']}: {states['COMPLETE']} runs complete, {states['FAIL']} failed "
                  f"({retried} retried); best measured: trial {best['trial']} {best['description']}, "
                  f"{best['tokens_per_s']:,.0f} tokens/s on {best['host']}", soft_wrap=True)
    out.print(f"refine: best plan before = trial {ranking.get('best_before')}, after refit = trial "
              f"{ranking.get('best_after')} ({ranking.get('plans')} feasible plans re-ranked); "
              f"wrote {run_dir / 'refine.json'}")


__all__ = ["Tuning", "prepare", "refine_step", "tuning_options"]
