"""One training rank: `python -m planner.runtime.train.worker --run-dir DIR [...]` (the flags are
TrainerOptions', planner/runtime/train/options.py).

Started by planner.runtime.train.launch (or by launch.sh through the deepspeed launcher). Reads
plan.json and ds_config.json from the run directory, trains, and writes per-rank state under
DIR/.ranks/: rank<r>.json (pid, phase, step, error; the launcher reads it to name a failing
rank), progress.jsonl (rank 0: one line per step and event) and result.json (rank 0: every
rank's measurements, gathered at the end). Checkpoints go to DIR/checkpoints/. Rank 0 prints
a progress line per step and writes DIR/metrics.json at the end (launch.sh runs get it too).
"""
from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from pathlib import Path

from planner.runtime.files import RANKS_DIR
from planner.runtime.train.options import TrainerOptions
from planner.rundir import atomic_write_json


class Status:
    def __init__(self, run_dir: Path, rank: int) -> None:
        self.path = run_dir / RANKS_DIR / f"rank{rank}.json"
        self.state = {"rank": rank, "pid": os.getpid(), "phase": "start", "step": 0, "error": None}
        self.write()

    def write(self, **kw) -> None:
        self.state.update(kw, time=time.time())
        atomic_write_json(self.path, self.state)


def main(argv: list[str] | None = None) -> int:
    run_dir, opts = TrainerOptions.from_argv(argv)
    run_dir = run_dir.resolve()
    rank = int(os.environ.get("RANK", "0"))
    status = Status(run_dir, rank)
    signal.signal(signal.SIGTERM, _on_sigterm(status))
    _exit_with_parent()
    try:
        from planner.runtime.train.loop import train
        train(opts, run_dir, rank, status)
    except Terminated:  # the stack has unwound (finally blocks ran): leave now
        os._exit(143)
    except BaseException as exc:  # record the cause for the launcher, then fail
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        status.write(phase="error", error=last[:2000])
        traceback.print_exc()
        return 1
    status.write(phase="done")
    return 0


class Terminated(BaseException):
    """Raised in the main thread by SIGTERM (BaseException: no `except Exception` swallows it)."""


UNWIND_GRACE_S = 3.0
"""Seconds the stack may take to unwind after SIGTERM before the rank exits regardless."""


def _on_sigterm(status: Status):
    """SIGTERM unwinds the main thread instead of exiting on the spot, so that the `finally` of
    whatever holds a resource runs: torch's FileBaton removes its torch-extensions build lock
    there (planner/runtime/preflight/buildlock.py; an os._exit inside DeepSpeed's op build left it behind
    and every later run waited on it). A timer exits anyway if unwinding hangs."""
    import threading

    def handler(*_) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one interruption
        status.write(phase="terminated")
        timer = threading.Timer(UNWIND_GRACE_S, os._exit, (143,))
        timer.daemon = True
        timer.start()
        raise Terminated
    return handler


def _exit_with_parent() -> None:
    """A rank whose launcher died (killed without cleanup) stops as on SIGTERM (see _on_sigterm)
    instead of lingering."""
    import threading
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(UNWIND_GRACE_S + 1.0)
                os._exit(144)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


if __name__ == "__main__":
    sys.exit(main())
