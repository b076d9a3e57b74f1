"""What `planner run` tells each rank: the trainer's options, said once.

TrainerOptions is what `planner run`'s flags (planner/cli/run.py) ask of the ranks: checked
before any rank starts (planner/runtime/preflight/checks.py check_trainer), carried to every
rank as argv by the launcher (`to_argv`) and read back by the worker (`from_argv`, whose argparse
is built from these fields). A new trainer flag is a new field here; nothing else writes or
parses the worker's argv.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.data.batching import BATCHING
from planner.dsconfig import LR_SCHEDULES

PATHS = ("data", "tokenizer", "init_hf", "save_hf", "dump_grads")
"""Made absolute before they reach a rank: the rank works in the run directory."""


def _opt(default: Any, help: str, *, kind: type, choices: tuple[str, ...] | None = None, hidden: bool = False,
         env: str = "") -> Any:
    """A field with the worker flag's type, help, choices; `env`: the default comes from this
    environment variable (a test or measurement hook set for every rank)."""
    meta = {"help": help, "kind": kind, "choices": choices, "hidden": hidden, "env": env}
    return field(default=default, metadata=meta)


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerOptions:
    steps: int = _opt(10, "optimizer steps to run", kind=int)
    warmup: int = _opt(2, "steps left out of the timing", kind=int)
    resume: bool = _opt(False, "continue from the latest checkpoint in RUN_DIR/checkpoints", kind=bool)
    batching: str = _opt("dynamic", "static (padded rows) or dynamic (packed rows)", kind=str, choices=BATCHING)
    checkpoint_every: int = _opt(0, "save a checkpoint every K steps (0: never)", kind=int)
    inject_nan: int = _opt(-1, "poison the batch of this step (test)", kind=int, hidden=True)
    data: str = _opt("", "a corpus instead of the synthetic one", kind=str)
    tokenizer: str = _opt("", "local Hugging Face tokenizer directory for a text corpus", kind=str)
    eval_every: int = _opt(0, "held-out loss every K steps (0: never)", kind=int)
    eval_batches: int = _opt(2, "global batches per evaluation", kind=int)
    lr: float | None = _opt(None, "peak learning rate (default: planner.dsconfig.OPTIMIZER)", kind=float)
    lr_warmup_steps: int = _opt(0, "linear warmup steps", kind=int)
    lr_schedule: str | None = _opt(None, "cosine or constant (default: a scheduler block in ds_config.json, else "
                                   "constant)", kind=str, choices=LR_SCHEDULES)
    metrics_port: int = _opt(0, "rank 0 serves Prometheus metrics on this port (0: off)", kind=int)
    metrics_host: str = _opt("127.0.0.1", "address the metrics endpoint listens on", kind=str)
    init_hf: str = _opt("", "Hugging Face checkpoint directory to start from", kind=str)
    save_hf: str = _opt("", "write the trained weights here in Hugging Face format", kind=str)
    seed: int = _opt(1234, "seeds the synthetic corpus, the initialisation and dropout", kind=int)
    data_workers: int | None = _opt(None, "DataLoader workers per rank (default: plan.json's loader settings, "
                                    "else 1)", kind=int)
    measure_activations: bool = _opt(False, "record the bytes each layer keeps for backward (one micro-batch; "
                                     "costs hooks)", kind=bool, env="PLANNER_MEASURE_ACTIVATIONS")
    dump_grads: str = _opt("", "test hook (tests/integration/test_parity.py): gradients before the first "
                           "optimizer step", kind=str, hidden=True, env="PLANNER_DUMP_GRADS")
    step_sleep: float = _opt(0.0, "test hook: pause after each step", kind=float, hidden=True)
    save_sleep: float = _opt(0.0, "test hook: pause after each checkpoint file (a kill lands mid-save)",
                             kind=float, hidden=True)

    def absolute(self) -> "TrainerOptions":
        """Paths resolved against the current directory (a rank works in the run directory)."""
        return dataclasses.replace(self, **{n: str(Path(getattr(self, n)).resolve()) for n in PATHS
                                            if getattr(self, n)})

    def to_argv(self) -> list[str]:
        """The worker's flags for these options: every field that differs from its default."""
        out: list[str] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value == f.default:
                continue
            if f.metadata["kind"] is bool:
                out.append(_flag(f))
            else:
                out += [_flag(f), repr(float(value)) if f.metadata["kind"] is float else str(value)]
        return out

    @classmethod
    def from_argv(cls, argv: list[str] | None = None) -> tuple[Path, "TrainerOptions"]:
        """(run directory, options) from the worker's command line; paths made absolute."""
        ns = parser().parse_args(argv)
        opts = cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})
        return Path(ns.run_dir), opts.absolute()


def _flag(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def parser() -> argparse.ArgumentParser:
    """The worker's command line, from the fields."""
    ap = argparse.ArgumentParser(prog="planner.runtime.train.worker")
    ap.add_argument("--run-dir", required=True)
    for f in dataclasses.fields(TrainerOptions):
        m = f.metadata
        default = f.default
        if m["env"]:
            raw = os.environ.get(m["env"], "")
            default = raw not in ("", "0") if m["kind"] is bool else (raw or default)
        help_ = argparse.SUPPRESS if m["hidden"] else m["help"]
        if m["kind"] is bool:
            ap.add_argument(_flag(f), action="store_true", default=default, help=help_)
        else:
            ap.add_argument(_flag(f), type=m["kind"], default=default, choices=m["choices"], help=help_)
    ap.add_argument("--local_rank", type=int, default=None)  # passed by the deepspeed launcher
    return ap


__all__ = ["TrainerOptions", "parser"]
