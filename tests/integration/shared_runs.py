"""Runs that more than one integration module checks. Each launch of DeepSpeed ranks costs CI time
(every rank imports torch, DeepSpeed and the planner before it does anything), so a run that two
tests can both read is started once per session (the fixtures in conftest.py)."""
from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

DP2_STEPS = 8
DP2 = dict(dp=2, zero=1, micro_batch=2, grad_accum=1, precision="fp32")
"""Tiny ChatGLM3 (test_executor.make_run), DP 2, ZeRO-1, fp32, no accumulation, DeepSpeed's default
WarmupLR (3e-4 from the first step)."""


def plans_start():
    """benchmarks/plans_start.py as a module, loaded once per session: test_plans_start and
    test_batch_start both use it, and a second load would replace sys.modules["plans_start"], under
    which the first module's dataclasses (Case) resolve their names."""
    if "plans_start" in sys.modules:
        return sys.modules["plans_start"]
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "plans_start.py"
    spec = importlib.util.spec_from_file_location("plans_start", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["plans_start"] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_dp2_bare(root: Path) -> tuple[Path, list[str], list[int]]:
    """The DP2 run for DP2_STEPS steps (warm-up 1), started as launch.sh's deepspeed launcher starts
    it: torchrun-style environment variables, each rank a plain `python -m planner.runtime.train.worker`
    (no `planner run`). (run dir, each rank's output, each rank's exit code)."""
    from test_executor import make_run
    d = make_run(root, "bare", **DP2)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
               OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    cmd = [sys.executable, "-m", "planner.runtime.train.worker", "--run-dir", str(d), "--steps", str(DP2_STEPS),
           "--warmup", "1"]
    procs = [subprocess.Popen(cmd, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:  # a timeout leaves no rank behind
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return d, outs, [p.returncode for p in procs]


def dp2_losses(run: tuple[Path, list[str], list[int]]) -> list[float]:
    """The losses of a start_dp2_bare run, which must have run to the end."""
    d, outs, codes = run
    assert codes == [0, 0], outs
    m = json.loads((d / "metrics.json").read_text())
    assert m["status"] == "ok" and len(m["loss"]) == DP2_STEPS, m
    return m["loss"]
