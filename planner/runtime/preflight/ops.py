"""Build DeepSpeed's CPU ops once, at install (`make` runs `python -m planner.runtime.preflight.ops`), so
that no `planner run` compiles.

Every CPU run loads DeepSpeed's shared-memory collective op (deepspeed/comm/torch.py
`build_shm_op`: ShareMemCommBuilder), which DeepSpeed JIT-compiles into torch's extension cache
on first use (19-22 s on this machine, /work/shared/notes/deepspeed-on-cpu.md), under a build
lock every other rank waits on (planner/runtime/preflight/buildlock.py). It is the only op the executor's
runs compile: the ds_config the planner writes gives offload plans torch's AdamW, not
DeepSpeedCPUAdam (planner/dsconfig.py), and names no DeepSpeed optimizer otherwise. Loading an
op that is built already only checks it (no compile).
"""
from __future__ import annotations

import os
import sys
import time

OPS = ("ShareMemCommBuilder",)
"""DeepSpeed op builders a CPU run of the executor loads."""


def build(echo=print) -> int:
    """Build (or find built) each op of OPS; 0, or 1 after one line per op that failed."""
    from planner.runtime.preflight.buildlock import stale_lock_problem
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    lock = stale_lock_problem()
    if lock is not None:
        echo(f"warning: DeepSpeed ops not built: {lock[0]} (fix: {lock[1]})")
        return 1
    from deepspeed.accelerator import get_accelerator
    failed = 0
    for name in OPS:
        t0 = time.perf_counter()
        builder = get_accelerator().create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            echo(f"DeepSpeed op {name}: not available on this accelerator, skipped")
            continue
        try:
            builder.load(verbose=False)
        except Exception as exc:  # a missing compiler: the first run would fail the same way
            echo(f"warning: DeepSpeed op {builder.absolute_name()} did not build: {type(exc).__name__}: "
                 f"{str(exc).splitlines()[0] if str(exc) else ''} (runs will try again; check that g++ and "
                 "ninja are installed)")
            failed += 1
            continue
        echo(f"DeepSpeed op {builder.absolute_name()} ready ({time.perf_counter() - t0:.1f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(build())
