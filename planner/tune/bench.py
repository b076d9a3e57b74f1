"""What the measuring benchmarks share (benchmarks/calibration_fidelity.py, benchmarks/agreement.py):
profile this machine, write a plan's run directory, run every plan several times in
round-robin order with the executor, and turn the rounds into MeasuredRuns for `calibrate`.

On a shared machine step times drift between runs: round-robin order makes slow drift hit
every plan alike, and each plan's figure is the median over rounds of each run's median step
after warm-up (peak memory: the median of each run's largest per-rank peak).
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.calibrate.runs import MeasuredRun
from planner.cost import estimate
from planner.errors import PlannerError
from planner.rundir import atomic_write_json, plan_document
from planner.specs.cluster import ClusterSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import Plan
from planner.specs.train import TrainSpec


def profile_machine(out: Path, echo: Callable[[str], None] = print) -> str:
    """`planner profile --quick --out out` in a subprocess; returns the profile's path."""
    t0 = time.perf_counter()
    planner = Path(sys.executable).with_name("planner")
    subprocess.run([str(planner), "profile", "--quick", "--out", str(out)], check=True)
    echo(f"profiled this machine (--quick) in {time.perf_counter() - t0:.1f} s -> {out}")
    return str(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class Setup:
    """One plan to measure, in its own run directory."""

    name: str
    model: ModelSpec
    cluster: ClusterSpec
    train: TrainSpec
    plan: Plan
    run_dir: Path
    scale: str | None = None
    model_arg: str = ""
    tags: dict[str, Any] = field(default_factory=dict)
    """Free-form labels the caller groups by (layout name, scale, ...)."""

    def write(self, command: str) -> None:
        """plan.json and estimate.json as `planner search` writes them (the executor writes
        ds_config.json from plan.json)."""
        est = estimate(self.model, self.cluster, self.train, self.plan)
        atomic_write_json(self.run_dir / "plan.json",
                          plan_document(self.plan, self.model, self.cluster, self.train, scale=self.scale,
                                        model_arg=self.model_arg, command=command))
        atomic_write_json(self.run_dir / "estimate.json", {"plan": self.plan.to_dict(), "estimate": est.to_json()})
        (self.run_dir / "ds_config.json").unlink(missing_ok=True)  # never a previous plan's config


Runner = Callable[[Path, int, int], dict[str, Any]]


def _run_plan(run_dir: Path, steps: int, warmup: int) -> dict[str, Any]:
    from planner.runtime.train.launch import run_plan
    return run_plan(run_dir, steps=steps, warmup=warmup)


def round_robin(setups: list[Setup], *, rounds: int, steps: int, warmup: int, runner: Runner = _run_plan,
                echo: Callable[[str], None] = print) -> dict[str, list[dict[str, Any]]]:
    """Run every setup `rounds` times, round-robin; returns each setup's metrics.json per
    successful round (also saved as metrics-round<r>.json in its run directory)."""
    out: dict[str, list[dict[str, Any]]] = {s.name: [] for s in setups}
    for rnd in range(rounds):
        for s in setups:
            t0 = time.perf_counter()
            try:
                m = runner(s.run_dir, steps, warmup)
            except PlannerError as exc:
                echo(f"round {rnd} {s.name}: {s.plan.describe()}: FAILED {exc.line()}")
                continue
            (s.run_dir / f"metrics-round{rnd}.json").write_text(json.dumps(m))
            out[s.name].append(m)
            timed = timed_steps(m)
            echo(f"round {rnd} {s.name}: {s.plan.describe()}: median {statistics.median(timed):.3f} s/step "
                 f"(min {min(timed):.3f}, max {max(timed):.3f}), {m['peak_memory_gb']:.3f} GB "
                 f"({time.perf_counter() - t0:.0f} s)")
    return out


def timed_steps(metrics: dict[str, Any]) -> list[float]:
    return [t for t in metrics["step_times_s"][metrics["warmup"]:] if t is not None]


def step_time(rounds: list[dict[str, Any]]) -> float:
    """The median over rounds of each run's median step after warm-up."""
    return statistics.median(statistics.median(timed_steps(m)) for m in rounds)


def peak_memory_gb(rounds: list[dict[str, Any]]) -> float:
    return statistics.median(m["peak_memory_gb"] for m in rounds)


def measured_run(s: Setup, rounds: list[dict[str, Any]]) -> MeasuredRun:
    """The setup's rounds as one calibration observation."""
    return MeasuredRun(path=str(s.run_dir), model=s.model, cluster=s.cluster, train=s.train, plan=s.plan,
                       step_time_s=step_time(rounds), peak_memory_gb=peak_memory_gb(rounds))


__all__ = ["Setup", "measured_run", "peak_memory_gb", "profile_machine", "round_robin", "step_time", "timed_steps"]
