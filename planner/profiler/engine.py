"""The framework's own costs per micro-batch and per optimizer step, as the executor runs them.

One process (planner.runtime.train.probe; gloo, world size 1) builds the executor's DeepSpeed engine for the profiled model
(planner.runtime.train.build.build_engine with planner.dsconfig.ds_config: the same module,
config and client AdamW as `planner run`) in each precision, with 1 and 4 micro-batches per step,
and times whole steps the way the executor's loop does (forward, loss, backward, engine.step per
micro-batch). Per precision:

    per micro-batch = (step with 4 - step with 1) / 3,  per step = step with 1 - per micro-batch,

and what the cost model's terms leave of them (planner.profiler.write.step_section): the
micro-batch's blocks (through the block probe), embedding and head, and the optimizer's
memory-bound update are subtracted; the rest is step.framework.<precision> (planner/specs/step.py).
No communication: one process. A failure is reported as a note; the profile is written without it.
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from planner.errors import PlannerError
from planner.runtime.procs import free_port

ACCUMULATIONS = (1, 4)
"""Micro-batches per step of the two timed engines (planner.runtime.train.probe)."""


def measure(model: dict[str, Any], b: int, s: int, precisions: list[str], threads: int,
            timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """Run the engine probe (planner.runtime.train.probe, by module name: the profiler does not
    import the runtime) in a subprocess; its rows (one per precision and accumulation)."""
    import subprocess
    import sys
    fd, out_path = tempfile.mkstemp(prefix="planner-engine-", suffix=".json")
    os.close(fd)
    args = json.dumps({"port": free_port(), "model": model, "b": b, "s": s, "precisions": precisions,
                       "threads": threads})
    env = dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"), OMP_NUM_THREADS=str(threads),
               MALLOC_MMAP_THRESHOLD_="65536")
    try:
        try:
            p = subprocess.run([sys.executable, "-m", "planner.runtime.train.probe", args, out_path], env=env,
                               capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise PlannerError("engine probe", f"did not finish in {timeout_s:.0f} s",
                               "profile without it (--quick on a loaded machine)") from None
        if p.returncode:
            last = (p.stderr.strip().splitlines() or [f"exit status {p.returncode}"])[-1]
            raise PlannerError("engine probe", f"the process failed: {last}", "check that DeepSpeed runs on this "
                               "machine (planner run of a 1xcpu plan)")
        with open(out_path) as fh:
            return json.load(fh)
    finally:
        os.unlink(out_path)


def split(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per precision: measured seconds per micro-batch and per step (fixed part), from the
    steps with 1 and 4 micro-batches (ACCUMULATIONS)."""
    out = {}
    for prec in dict.fromkeys(r["precision"] for r in rows):
        by_m = {r["grad_accum"]: r["step_s"] for r in rows if r["precision"] == prec}
        lo, hi = min(by_m), max(by_m)
        if lo == hi:
            continue
        per_mb = (by_m[hi] - by_m[lo]) / (hi - lo)
        out[prec] = {"microbatch_s": per_mb, "step_s": by_m[lo] - lo * per_mb}
    return out
