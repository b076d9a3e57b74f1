"""Several plans of one world size, one after another, in the same rank processes.

A start of a tiny plan on this machine's CPU is mostly fixed cost: each rank imports torch,
DeepSpeed and the planner and starts the CPU allocation profiler (about 9 CPU-seconds per
process, measured with benchmarks/plans_start.py's probe in docs/moe.md), before the engine is
built and one step runs. `run_plans` pays that once per launch: the ranks
(`python -m planner.runtime.train.batch --runs FILE [trainer flags]`) keep the process group
and run each run directory exactly as `planner run DIR` does (planner.runtime.train.loop.train
reads that directory's plan.json and ds_config.json, builds a fresh engine, our TP/EP/SP
groups and data), then put DeepSpeed's process-wide state back as it was before the first
plan (`DeepSpeedState`): the groups registry (deepspeed/utils/groups.py: expert groups, mpu,
world group), activation checkpointing's configuration and RNG tracker, ZeRO-3's buffers.

Each run directory gets what `planner run` writes (.ranks/rank<r>.json with its own phase,
metrics.json). When a rank fails, the plan it failed in is recorded as failed (metrics.json,
the cause named as run_plan names it), the processes are stopped, and the plans after it start
in a fresh launch, so one failure costs only its own plan. A batch is therefore a faster
`planner run` over many directories; benchmarks/plans_start.py (--batch) checks on a sample
that it gives the same outcome as separate runs.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from planner.errors import ExecutionError, PlannerError
from planner.runtime.files import RANKS_DIR

BATCH_MODULE = "planner.runtime.train.batch"


# ---- the ranks ------------------------------------------------------------------------------

class DeepSpeedState:
    """DeepSpeed's process-wide state that one plan leaves behind for the next: captured before
    the first plan, restored after each. Module globals of the listed modules holding plain
    values (None, numbers, strings, lists, dicts: the groups registry, checkpointing's mpu and
    flags, ZeRO-3's buffers) are reset to copies of their captured values; the activation
    checkpointing RNG tracker is emptied; and every torch.distributed process group the plan
    created is destroyed (all but the default group and those alive at capture). Resetting the
    registry alone left each plan's groups in torch's own registry (distributed_c10d._world),
    alive with their gloo threads: +5 groups and about 15 threads per rank per tiny GLM-4.5-Air
    plan on 2 CPU processes, measured with the per-plan `live` counts (live_counts) in a 6-plan
    batch, and about 600 threads per rank after 40 plans in the issue-22 sweep. Destroying a
    subgroup is local to the rank (ProcessGroup.shutdown, no collective), so ranks need not meet."""

    MODULES = ("deepspeed.utils.groups", "deepspeed.runtime.activation_checkpointing.checkpointing",
               "deepspeed.runtime.zero.partition_parameters")
    PLAIN = (type(None), bool, int, float, str, list, dict, tuple)

    def __init__(self) -> None:
        import importlib
        self.saved: dict[str, dict[str, Any]] = {}
        for name in self.MODULES:
            mod = importlib.import_module(name)
            self.saved[name] = {k: _copy(v) for k, v in vars(mod).items()
                                if not k.startswith("__") and type(v) in self.PLAIN}
        from torch.distributed import distributed_c10d as c10d
        self.groups = set(c10d._world.pg_map)

    def restore(self) -> None:
        import importlib
        from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker
        for name, values in self.saved.items():
            mod = importlib.import_module(name)
            for k, v in values.items():
                setattr(mod, k, _copy(v))
        get_cuda_rng_tracker().reset()
        self._destroy_new_groups()

    def _destroy_new_groups(self) -> None:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
        world = c10d.GroupMember.WORLD
        for pg in reversed(list(c10d._world.pg_map)):  # newest first
            if pg is not world and pg not in self.groups:
                dist.destroy_process_group(pg)


def release(engine) -> None:
    """Free what a finished plan's engine would keep alive in this process. DeepSpeed's gradient
    hooks sit in autograd's C++ graph, where Python's collector cannot see the cycle through
    them, so without engine.destroy() (which removes them) the engine, its model and optimizer,
    and the process groups they hold outlived the plan, each gloo group with its threads
    (DeepSpeedState.restore); rank 0's TensorBoard writer (ds_config's monitor) kept its writer
    thread until closed."""
    tb = getattr(getattr(engine, "monitor", None), "tb_monitor", None)
    writer = getattr(tb, "summary_writer", None)
    if writer is not None:
        writer.close()
    engine.destroy()


def live_counts() -> dict[str, int | None]:
    """This process's OS threads (None where /proc is missing) and live torch.distributed process
    groups (the default group included; 0 before init_process_group)."""
    from torch.distributed import distributed_c10d as c10d
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError:
        threads = None
    return {"threads": threads, "process_groups": len(c10d._world.pg_map)}


def _copy(v: Any) -> Any:
    return type(v)(v) if isinstance(v, (list, dict)) else v


class _Current:
    """The Status of the plan being run (worker.Status), for the SIGTERM handler."""

    def __init__(self) -> None:
        self.status = None

    def write(self, **kw) -> None:
        if self.status is not None:
            self.status.write(**kw)


def main(argv: list[str] | None = None) -> int:
    from planner.runtime.train.options import TrainerOptions
    from planner.runtime.train.worker import Status, Terminated, _exit_with_parent, _on_sigterm
    import signal
    ap = argparse.ArgumentParser(prog=BATCH_MODULE, add_help=False)
    ap.add_argument("--runs", required=True, help="JSON list of run directories, run in this order")
    ns, rest = ap.parse_known_args(argv)
    runs = json.loads(Path(ns.runs).read_text())
    rank = int(os.environ.get("RANK", "0"))
    current = _Current()
    signal.signal(signal.SIGTERM, _on_sigterm(current))
    _exit_with_parent()
    state = DeepSpeedState()
    for d in runs:
        run_dir, opts = TrainerOptions.from_argv(["--run-dir", d, *rest])
        run_dir = run_dir.resolve()
        current.status = status = Status(run_dir, rank)
        status.write(live=live_counts())  # what the plans before this one left alive
        try:
            from planner.runtime.train.loop import train
            run = train(opts, run_dir, rank, status)
        except Terminated:
            os._exit(143)
        except BaseException as exc:  # as worker.main: record the cause for the launcher, then fail
            last = traceback.format_exception_only(type(exc), exc)[-1].strip()
            status.write(phase="error", error=last[:2000])
            traceback.print_exc()
            return 1
        status.write(phase="done")
        release(run.engine)
        del run
        gc.collect()  # the engine, its hooks and groups of this plan go before the next is built
        state.restore()
    return 0


# ---- the launcher ---------------------------------------------------------------------------

def _phase(run: Path, rank: int) -> str:
    try:
        return json.loads((run / RANKS_DIR / f"rank{rank}.json").read_text()).get("phase", "start")
    except (OSError, ValueError):
        return "start"


def run_plans(run_dirs: list[str | Path], *, timeout: float = 600.0, echo: Callable[[str], None] = lambda s: None,
              **options: Any) -> list[dict[str, Any] | PlannerError]:
    """Run each directory as `run_plan(dir, timeout=timeout, **options)` would, with one launch of
    the ranks for many of them (module docstring). The directories' plans must have one world
    size. Returns per directory its metrics (as run_plan returns them) or the PlannerError
    run_plan would have raised. `timeout` applies to each plan."""
    from planner.runtime.procs import RankGroup
    from planner.runtime.train.launch import collect_metrics, prepare_run, rank_environment, record_failure
    out: dict[int, dict[str, Any] | PlannerError] = {}
    ready = []
    for i, d in enumerate(run_dirs):
        try:
            ready.append((i, prepare_run(d, timeout=timeout, **options)))
        except PlannerError as exc:
            out[i] = exc
    worlds = {p.plan.world_size for _, p in ready}
    if len(worlds) > 1:
        raise ValueError(f"run_plans: one world size per batch, got {sorted(worlds)}")
    while ready:
        prep0 = ready[0][1]
        world = prep0.plan.world_size
        with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="planner-batch-", delete=False) as fh:
            json.dump([str(p.run) for _, p in ready], fh)
        cmd = [sys.executable, "-m", BATCH_MODULE, "--runs", fh.name, *prep0.opts.absolute().to_argv()]
        echo(f"launching {world} rank(s) for {len(ready)} plan(s)")
        group, logs, env = RankGroup(), [], rank_environment(prep0, timeout)  # one rendezvous port
        try:
            for r in range(world):
                log = open(prep0.run / RANKS_DIR / f"batch-rank{r}.log", "w")
                logs.append(log)
                group.start(cmd, r, env, log, cwd=str(prep0.run))
            failed_at = _watch_batch(ready, group.procs, timeout, out, collect_metrics)
        finally:
            group.stop()
            for log in logs:
                log.close()
            os.unlink(fh.name)
        if failed_at is None:
            break
        k, rank, cause = failed_at
        i, prep = ready[k]
        out[i] = record_failure(prep, rank, cause)
        echo(f"plan {i} failed: rank {rank}: {cause}")
        ready = ready[k + 1:]
    return [out[i] for i in range(len(run_dirs))]


def _watch_batch(ready: list, procs: list, timeout: float, out: dict,
                 collect: Callable) -> tuple[int, int | None, str] | None:
    """Follow the plans in order: a plan is finished when every rank wrote phase done in its
    directory (its metrics then go to `out`). Returns None when all finished, else (index in
    `ready` of the plan that failed or hung, rank, cause)."""
    from planner.runtime.train.launch import _cause, _pick_failed
    world = len(procs)
    k, since = 0, time.monotonic()
    while True:
        while k < len(ready) and all(_phase(ready[k][1].run, r) == "done" for r in range(world)):
            i, prep = ready[k]
            try:
                out[i] = collect(prep)
            except PlannerError as exc:
                out[i] = exc
            k, since = k + 1, time.monotonic()
        if k == len(ready):
            return None
        codes = {r: p.poll() for r, p in enumerate(procs)}
        failed = {r: c for r, c in codes.items() if c not in (None, 0)}
        if failed or all(c == 0 for c in codes.values()):
            time.sleep(0.5)  # let simultaneous failures and the last status files land
            while k < len(ready) and all(_phase(ready[k][1].run, r) == "done" for r in range(world)):
                i, prep = ready[k]
                out[i] = collect(prep)
                k += 1
            if k == len(ready):
                return None
            failed = {r: p.poll() for r, p in enumerate(procs) if p.poll() not in (None, 0)}
            run = ready[k][1].run
            if not failed:
                return k, None, "the ranks exited before the plan finished"
            r = _pick_failed(run, failed)
            return k, r, _cause(run, r, failed[r])
        if time.monotonic() - since > timeout:
            run = ready[k][1].run
            r = min(range(world), key=lambda q: (_phase(run, q) == "done", q))
            return k, r, f"hung: no finish within --timeout {timeout:g} s; rank {r} stuck in phase {_phase(run, r)}"
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
