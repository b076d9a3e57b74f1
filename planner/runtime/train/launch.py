"""Launch the ranks of a plan on this machine, watch them, and write metrics.json.

Processes: one `python -m planner.runtime.train.worker` per rank (dsconfig.ENTRY_MODULE), each
a direct child in one new process group with torchrun's standalone environment and OMP threads
split between ranks (planner/runtime/procs.py RankGroup says why not torchrun), so we know each
rank's pid and exit status (the failing rank is named with its signal or error) and cleanup
signals only that group. Multi-node runs use launch.sh (the deepspeed launcher), which runs the
same worker.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from planner import dsconfig
from planner.errors import ExecutionError
from planner.profiler.device import EXECUTOR_MMAP_THRESHOLD
from planner.runtime.preflight import checks as preflight
from planner.runtime.observe.metrics import build_metrics, failure_metrics
from planner.runtime.preflight.buildlock import stale_lock_problem
from planner.runtime.train.checkpoints import latest_tag
from planner.runtime.files import CKPT_DIR, RANKS_DIR
from planner.runtime.procs import RankGroup, rank_env
from planner.runtime.train.options import TrainerOptions
from planner.runtime.observe.watch import ALERTS_FILE, DASHBOARD_FILE, format_progress
from planner.rundir import atomic_write_json, check_writable, load_run, read_json


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _tail(path: Path, n: int = 3) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])


def _cause(run_dir: Path, rank: int, code: int | None) -> str:
    st = _read(run_dir / RANKS_DIR / f"rank{rank}.json")
    if st.get("error"):
        return st["error"]
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name} in phase {st.get('phase', '?')} at step {st.get('step', 0)}"
    return f"exited with status {code} in phase {st.get('phase', '?')}: {_tail(run_dir / RANKS_DIR / f'rank{rank}.log')}"


def _pick_failed(run_dir: Path, failed: dict[int, int]) -> int:
    """The rank that failed first: a signal death, else an error that is not a peer's lost connection."""
    def score(r: int) -> tuple:
        err = str(_read(run_dir / RANKS_DIR / f"rank{r}.json").get("error") or "")
        secondary = any(w in err.lower() for w in ("connection", "gloo", "nccl", "broken pipe", "timed out"))
        return (failed[r] >= 0, secondary, r)
    return min(failed, key=score)


def check_counts(steps: int, warmup: int, timeout: float) -> None:
    """--steps, --warmup and --timeout of `planner run` / `planner verify`, before anything starts."""
    if steps < 1 or warmup < 0 or warmup >= steps:
        raise ExecutionError("--steps/--warmup", f"need steps >= 1 and 0 <= warmup < steps, got {steps}/{warmup}",
                             "e.g. --steps 10 --warmup 2")
    if not timeout > 0:
        raise ExecutionError("--timeout", f"must be a positive number of seconds, got {timeout:g}",
                             "e.g. --timeout 600")


def run_plan(run_dir: str | Path, *, timeout: float = 600.0, ignore_host_checks: bool = False,
             resume_if_present: bool = False, echo: Callable[[str], None] = lambda s: None,
             **options: Any) -> dict[str, Any]:
    """Run the plan in `run_dir` with the trainer's `options` (TrainerOptions' fields: steps,
    warmup, resume, data, ...); returns (and writes) metrics.json.

    Refuses first, starting nothing, what cannot run here (planner.runtime.preflight.checks): bad
    plan.json, a ds_config.json that disagrees with it, unless `ignore_host_checks` a plan this
    host lacks the GPUs, memory or cores for, and bad trainer input (the corpus and tokenizer,
    a busy metrics port, a missing Hugging Face directory, bad schedule values). While the ranks
    train, rank 0's progress lines (DIR/.ranks/progress.jsonl) go to `echo`; rank 0 writes
    metrics.json at the end (the launcher rebuilds it from result.json if it did not).
    `step_sleep` and `save_sleep` are test hooks (a pause after each step / checkpoint file)."""
    prep = prepare_run(run_dir, timeout=timeout, ignore_host_checks=ignore_host_checks,
                       resume_if_present=resume_if_present, echo=echo, **options)
    run, plan, world, opts = prep.run, prep.plan, prep.plan.world_size, prep.opts
    cmd = [sys.executable, "-m", dsconfig.ENTRY_MODULE, "--run-dir", str(run), *opts.absolute().to_argv()]
    echo(f"launching {world} rank(s): {plan.describe()}")
    if opts.metrics_port:
        echo(f"metrics: http://{opts.metrics_host}:{opts.metrics_port}/metrics (rules {ALERTS_FILE}, "
             f"dashboard {DASHBOARD_FILE})")
    failure = _launch(run, cmd, rank_environment(prep, timeout), world, timeout,
                      _Follower(prep.progress_file, echo, prep.shown))
    if failure is not None:
        raise record_failure(prep, *failure)
    return collect_metrics(prep)


@dataclasses.dataclass(frozen=True, slots=True)
class Prepared:
    """A run directory checked and cleared for its ranks (prepare_run)."""

    run: Path
    plan: Any
    model: Any
    cluster: Any
    opts: TrainerOptions
    progress_file: Path
    shown: int


def prepare_run(run_dir: str | Path, *, timeout: float = 600.0, ignore_host_checks: bool = False,
                resume_if_present: bool = False, echo: Callable[[str], None] = lambda s: None,
                **options: Any) -> Prepared:
    """run_plan up to the launch: every refusal (ExecutionError), then the run directory cleared
    of what a previous run left."""
    opts = TrainerOptions(**options)
    run = Path(run_dir).resolve()
    check_counts(opts.steps, opts.warmup, timeout)
    plan, model, cluster, train, doc = load_run(run)
    opts = _resume_or_start(run, opts, resume_if_present, echo)
    # every refusal comes before the run directory is touched (planner/runtime/preflight/checks.py)
    missing_cfg = preflight.check(run, plan, model, cluster, train, doc, ignore_host=ignore_host_checks)
    preflight.check_trainer(run, plan, model, train, opts)
    check_writable(run, "RUN_DIR")
    lock = stale_lock_problem()
    if lock is not None:
        raise ExecutionError("torch extensions", *lock)
    if missing_cfg is not None:
        atomic_write_json(run / "ds_config.json", missing_cfg)
        echo("ds_config.json was missing: written from plan.json")
    progress_file, shown = _prepare_run_dir(run, opts.resume)
    return Prepared(run, plan, model, cluster, opts, progress_file, shown)


def rank_environment(prep: Prepared, timeout: float) -> dict[str, str]:
    """The ranks' environment: torchrun's standalone rendezvous, DeepSpeed's collective timeout,
    OMP threads split between the ranks, the CPU accelerator on a CPU cluster."""
    world = prep.plan.world_size
    env = rank_env(world, LOCAL_WORLD_SIZE=str(world), DEEPSPEED_TIMEOUT=str(max(1, int(timeout // 60) + 1)))
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    if prep.cluster.device.kind == "cpu":
        env.update(DS_ACCELERATOR="cpu", MALLOC_MMAP_THRESHOLD_=str(EXECUTOR_MMAP_THRESHOLD))
    return env


def record_failure(prep: Prepared, rank: int | None, cause: str) -> ExecutionError:
    """metrics.json for a failed run; the error to raise."""
    run, opts = prep.run, prep.opts
    metrics = failure_metrics(run, prep.plan, prep.model, prep.plan.world_size, prep.cluster, opts.warmup,
                              opts.steps, opts.batching, rank, cause)
    atomic_write_json(run / "metrics.json", metrics)
    return ExecutionError(f"rank {rank}" if rank is not None else "run", cause,
                          f"see {run / RANKS_DIR}/rank{rank if rank is not None else 0}.log; metrics.json records "
                          "the failure")


def collect_metrics(prep: Prepared) -> dict[str, Any]:
    """metrics.json of a run whose ranks all finished."""
    run = prep.run
    if (run / "metrics.json").exists():  # written by rank 0 (planner/runtime/train/loop.py)
        return read_json(run / "metrics.json", "metrics.json")
    result = read_json(run / RANKS_DIR / "result.json", "result.json")
    metrics = build_metrics(result, prep.plan, prep.model, prep.opts.warmup, prep.opts.steps,
                            _read(run / "estimate.json"), run)
    atomic_write_json(run / "metrics.json", metrics)
    return metrics


def _resume_or_start(run: Path, opts: TrainerOptions, resume_if_present: bool,
                     echo: Callable[[str], None]) -> TrainerOptions:
    """--resume needs a checkpoint; --resume-if-present starts fresh without one."""
    if not opts.resume or latest_tag(run / CKPT_DIR) is not None:
        return opts
    if not resume_if_present:
        raise ExecutionError("--resume", f"no checkpoint to resume from in {run / CKPT_DIR} "
                             "(no complete tag named in `latest`)",
                             "run without --resume to start at step 1, or pass --resume-if-present to "
                             "resume when a checkpoint exists and start fresh otherwise")
    echo(f"no checkpoint in {run / CKPT_DIR}: starting at step 1 (--resume-if-present)")
    return dataclasses.replace(opts, resume=False)


def _prepare_run_dir(run: Path, resume: bool) -> tuple[Path, int]:
    """Clear what a previous run left (kept when resuming: its checkpoints and progress lines);
    returns the progress file and the offset from which this run's lines are shown."""
    ranks = run / RANKS_DIR
    if not resume:
        shutil.rmtree(run / CKPT_DIR, ignore_errors=True)
        shutil.rmtree(ranks, ignore_errors=True)
        shutil.rmtree(run / "logs", ignore_errors=True)
    ranks.mkdir(parents=True, exist_ok=True)
    for f in ranks.glob("rank*.json"):
        f.unlink()
    (ranks / "result.json").unlink(missing_ok=True)
    progress_file = ranks / "progress.jsonl"
    # a resumed run shows its own lines only: the killed run's records stay in the file
    shown = progress_file.stat().st_size if resume and progress_file.exists() else 0
    (run / "metrics.json").unlink(missing_ok=True)  # rank 0 writes this run's at the end
    return progress_file, shown


def _launch(run: Path, cmd: list[str], env: dict[str, str], world: int, timeout: float,
            follow: "_Follower") -> tuple[int | None, str] | None:
    """Start the world's ranks, watch them until they finish, fail or hang; stop what is left."""
    import threading
    if threading.current_thread() is threading.main_thread():
        # SIGTERM to the launcher still runs the cleanup below (ranks are in their own group)
        signal.signal(signal.SIGTERM, _terminated)
    group = RankGroup()
    logs = []
    start = time.monotonic()
    try:
        for r in range(world):
            log = open(run / RANKS_DIR / f"rank{r}.log", "w")
            logs.append(log)
            group.start(cmd, r, env, log, cwd=str(run))
        failure = _watch(run, group.procs, start, timeout, follow)
        follow()
    finally:
        group.stop()
        for log in logs:
            log.close()
    return failure


class _Follower:
    """Echo the progress records rank 0 appends to progress.jsonl (complete lines only)."""

    def __init__(self, path: Path, echo: Callable[[str], None], offset: int = 0) -> None:
        self.path, self.echo, self.offset = path, echo, offset

    def __call__(self) -> None:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read()
        except OSError:
            return
        end = chunk.rfind(b"\n")
        if end < 0:
            return
        self.offset += end + 1
        for line in chunk[:end].decode(errors="replace").splitlines():
            try:
                self.echo(format_progress(json.loads(line)))
            except (ValueError, KeyError, TypeError):
                continue


def _terminated(*_) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one interruption; let the cleanup finish
    raise KeyboardInterrupt


LOCK_CHECK_S = 10.0
"""While a rank is still starting, look for a stale torch-extensions build lock this often."""


def _watch(run: Path, procs: list[subprocess.Popen], start: float, timeout: float,
           tick: Callable[[], None] = lambda: None) -> tuple[int | None, str] | None:
    next_lock_check = start + LOCK_CHECK_S
    while True:
        tick()
        if time.monotonic() > next_lock_check:
            next_lock_check = time.monotonic() + LOCK_CHECK_S
            starting = [r for r in range(len(procs))
                        if _read(run / RANKS_DIR / f"rank{r}.json").get("phase", "start") in ("start", "init")]
            lock = stale_lock_problem() if starting else None
            if lock is not None:  # ranks wait on it forever: stop now and name it
                raise ExecutionError("torch extensions", f"rank {starting[0]} cannot start: {lock[0]}", lock[1])
        codes = {r: p.poll() for r, p in enumerate(procs)}
        failed = {r: c for r, c in codes.items() if c not in (None, 0)}
        if failed:
            time.sleep(0.5)  # let simultaneous failures land before choosing the first
            failed = {r: p.poll() for r, p in enumerate(procs) if p.poll() not in (None, 0)}
            r = _pick_failed(run, failed)
            return r, _cause(run, r, failed[r])
        if all(c == 0 for c in codes.values()):
            return None
        if time.monotonic() - start > timeout:
            states = {r: _read(run / RANKS_DIR / f"rank{r}.json") for r in codes if codes[r] is None}
            r = min(states, key=lambda k: (states[k].get("step", 0), states[k].get("time", 0)))
            st = states[r]
            return r, (f"hung: no finish within --timeout {timeout:g} s; rank {r} stuck in phase "
                       f"{st.get('phase', 'start')} at step {st.get('step', 0)}")
        time.sleep(0.1)
