"""One training rank: `python -m planner.runtime.train.worker --run-dir DIR [...]`.

Started by planner.runtime.train.launch (or by launch.sh through the deepspeed launcher). Reads
plan.json and ds_config.json from the run directory, trains, and writes per-rank state under
DIR/.ranks/: rank<r>.json (pid, phase, step, error; the launcher reads it to name a failing
rank), progress.jsonl (rank 0: one line per step and event) and result.json (rank 0: every
rank's measurements, gathered at the end). Checkpoints go to DIR/checkpoints/. Rank 0 prints
a progress line per step and writes DIR/metrics.json at the end (launch.sh runs get it too).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from planner.runtime.files import RANKS_DIR
from planner.rundir import atomic_write_json

def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="planner.runtime.train.worker")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--batching", choices=["static", "dynamic"], default="dynamic")
    ap.add_argument("--checkpoint-every", type=int, default=0)
    ap.add_argument("--inject-nan", type=int, default=-1, help="poison the batch of this step (test)")
    ap.add_argument("--data", default="")
    ap.add_argument("--tokenizer", default="", help="local Hugging Face tokenizer directory for a text corpus")
    ap.add_argument("--eval-every", type=int, default=0, help="held-out loss every K steps (0: never)")
    ap.add_argument("--eval-batches", type=int, default=2, help="global batches per evaluation")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default: planner.dsconfig.OPTIMIZER)")
    ap.add_argument("--lr-warmup-steps", type=int, default=0)
    ap.add_argument("--lr-schedule", choices=["cosine", "constant"], default="constant")
    ap.add_argument("--metrics-port", type=int, default=0, help="rank 0 serves Prometheus metrics here (0: off)")
    ap.add_argument("--metrics-host", default="127.0.0.1", help="address the metrics endpoint listens on")
    ap.add_argument("--init-hf", default="", help="Hugging Face checkpoint directory to start from")
    ap.add_argument("--save-hf", default="", help="write the trained weights here in Hugging Face format")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--data-workers", type=int, default=None,
                    help="DataLoader workers per rank (default: plan.json's loader settings, else 1)")
    ap.add_argument("--measure-activations", action="store_true",
                    default=os.environ.get("PLANNER_MEASURE_ACTIVATIONS", "") not in ("", "0"),
                    help="record the bytes each layer keeps for backward (one micro-batch; costs hooks)")
    # test hook (tests/integration/test_parity.py): gradients before the first optimizer step
    ap.add_argument("--dump-grads", default=os.environ.get("PLANNER_DUMP_GRADS", ""), help=argparse.SUPPRESS)
    # test hooks: sleep after each step / after each checkpoint file (a kill lands mid-save)
    ap.add_argument("--step-sleep", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--save-sleep", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--local_rank", type=int, default=None)  # passed by the deepspeed launcher
    return ap.parse_args(argv)


class Status:
    def __init__(self, run_dir: Path, rank: int) -> None:
        self.path = run_dir / RANKS_DIR / f"rank{rank}.json"
        self.state = {"rank": rank, "pid": os.getpid(), "phase": "start", "step": 0, "error": None}
        self.write()

    def write(self, **kw) -> None:
        self.state.update(kw, time=time.time())
        atomic_write_json(self.path, self.state)


def absolute_paths(args: argparse.Namespace) -> argparse.Namespace:
    """The rank works in the run directory (train.py chdirs there): paths given relative to
    where launch.sh / the deepspeed launcher was started are made absolute first."""
    for name in ("data", "tokenizer", "init_hf", "save_hf", "dump_grads"):
        value = getattr(args, name)
        if value:
            setattr(args, name, str(Path(value).resolve()))
    return args


def main(argv: list[str] | None = None) -> int:
    args = absolute_paths(parse(argv))
    run_dir = Path(args.run_dir).resolve()
    rank = int(os.environ.get("RANK", "0"))
    status = Status(run_dir, rank)
    signal.signal(signal.SIGTERM, _on_sigterm(status))
    _exit_with_parent()
    try:
        from planner.runtime.train.loop import train
        train(args, run_dir, rank, status)
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
