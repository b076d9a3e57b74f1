"""The framework's own costs per micro-batch and per optimizer step, as the executor runs them.

One process (planner.runtime.train.probe; gloo, world size 1) builds the executor's DeepSpeed engine for the profiled model
(planner.runtime.train.build.build_engine with planner.dsconfig.ds_config: the same module,
config and client AdamW as `planner run`) in each precision, with 1 and 4 micro-batches per step,
and times whole steps the way the executor's loop does (forward, loss, backward, engine.step per
micro-batch). Per precision:

    per micro-batch = (step with 4 - step with 1) / 3,  per step = step with 1 - per micro-batch,

and what the cost model's terms leave of them (planner.profiler.steps.step_section): the
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
from planner.profiler.device import EXECUTOR_MMAP_THRESHOLD
from planner.runtime.procs import free_port

ACCUMULATIONS = (1, 4)
"""Micro-batches per step of the two timed engines (planner.runtime.train.probe)."""


LAYOUTS = ({"name": "dp", "dp": 2, "pp": 1}, {"name": "pp", "dp": 1, "pp": 2},
           {"name": "z3", "dp": 2, "pp": 1, "zero": 3}, {"name": "z2", "dp": 2, "pp": 1, "zero": 2})
"""The layouts of the 2-process engine probe (measure_parallel): DP2 ZeRO-0 (the gradient
all-reduce as DeepSpeed runs it, both ranks computing at once), PP2 (DeepSpeed's
PipelineEngine: its 1F1B schedule, sends and receives), DP2 ZeRO-3 (its gathers, releases
and reductions as its module hooks run them) and DP2 ZeRO-2 (its gradient reduction every
micro-batch: deepspeed/runtime/zero/stage_1_and_2.py average_tensor reduces each bucket with
one dist.reduce per partition owner, in line on a CPU, whose accelerator's streams are
no-ops)."""

ZERO2_LAYOUTS = tuple(lay for lay in LAYOUTS if lay["name"] in ("dp", "z2"))
"""measure_parallel's layouts of a further model: ZeRO-2's cost per micro-batch beyond the first is a gradient
reduction over every parameter, so a second model size separates its per-parameter and fixed
parts (planner.profiler.steps.zero2_section)."""


def measure(model: dict[str, Any], b: int, s: int, precisions: list[str], threads: int,
            timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """Run the engine probe (planner.runtime.train.probe, by module name: the profiler does not
    import the runtime) in a subprocess; its rows (one per precision and accumulation)."""
    return _launch({"model": model, "b": b, "s": s, "precisions": precisions, "threads": threads}, 1, timeout_s)


def measure_parallel(model: dict[str, Any], b: int, s: int, precisions: list[str], threads: int,
                     timeout_s: float = 600.0, quick: bool = False,
                     other: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The engine probe on 2 processes, each LAYOUTS entry in every precision (ZeRO-3 and
    ZeRO-2: the first, the profiled one) with 1 and 4 micro-batches per step; rows tagged with
    their layout ("dp", "pp", "z3", "z2"). With `other` (a further model), ZERO2_LAYOUTS of it
    too at micro-batch 1, in the same processes, rows tagged with its name ("model").
    quick: 1 warm-up step and 3 timed (else the probe's 2 and 4)."""
    layouts = [dict(lay, precisions=precisions[:1]) if lay.get("zero") in (2, 3) else lay for lay in LAYOUTS]
    if other is not None:
        layouts += [dict(lay, precisions=precisions[:1], model=other, b=1) for lay in ZERO2_LAYOUTS]
    return _launch({"model": model, "b": b, "s": s, "precisions": precisions, "threads": threads,
                    "layouts": layouts, **({"steps": 3, "warmup": 1} if quick else {})}, 2, timeout_s)


def _launch(args: dict[str, Any], world: int, timeout_s: float) -> list[dict[str, Any]]:
    import subprocess
    import sys
    import time
    fd, out_path = tempfile.mkstemp(prefix="planner-engine-", suffix=".json")
    os.close(fd)
    port = free_port()
    env = dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"),
               OMP_NUM_THREADS=str(args["threads"]), MALLOC_MMAP_THRESHOLD_=str(EXECUTOR_MMAP_THRESHOLD))
    procs = [subprocess.Popen([sys.executable, "-m", "planner.runtime.train.probe",
                               json.dumps(dict(args, port=port, world=world, rank=r)), out_path], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    try:
        deadline = time.monotonic() + timeout_s
        errs = []
        for p in procs:
            try:
                _, err = p.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                raise PlannerError("engine probe", f"did not finish in {timeout_s:.0f} s",
                                   "profile without it (--quick on a loaded machine)") from None
            errs.append((p.returncode, err))
        for rc, err in errs:
            if rc:
                last = (err.strip().splitlines() or [f"exit status {rc}"])[-1]
                raise PlannerError("engine probe", f"the process failed: {last}", "check that DeepSpeed runs on this "
                                   "machine (planner run of a 1xcpu plan)")
        with open(out_path) as fh:
            return json.load(fh)
    finally:
        for p in procs:  # only our own children
            if p.poll() is None:
                p.kill()
                p.wait(5)
        os.unlink(out_path)


def split(rows: list[dict[str, Any]], layout: str = "1", model: str | None = None) -> dict[str, dict[str, float]]:
    """Per precision: measured seconds per micro-batch and per step (fixed part), from the
    steps with 1 and 4 micro-batches (ACCUMULATIONS), of one layout ("1": one process, rows
    without a layout are its; "dp", "pp": measure_parallel's) and one model (None: the profiled
    model's rows, which carry no "model"; else those of the model of that name)."""
    out = {}
    rows = [r for r in rows if r.get("layout", "1") == layout and r.get("model") == model]
    for prec in dict.fromkeys(r["precision"] for r in rows):
        by_m = {r["grad_accum"]: r["step_s"] for r in rows if r["precision"] == prec}
        lo, hi = min(by_m), max(by_m)
        if lo == hi:
            continue
        per_mb = (by_m[hi] - by_m[lo]) / (hi - lo)
        out[prec] = {"microbatch_s": per_mb, "step_s": by_m[lo] - lo * per_mb}
    return out
