"""Measured runs for calibration: an executor run directory (metrics.json + plan.json)."""
from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from pathlib import Path

from planner.errors import SpecError
from planner.rundir import load_run, read_json
from planner.specs.hardware import DeviceProfile
from planner.specs.cluster import ClusterSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import Plan
from planner.specs.train import TrainSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class MeasuredRun:
    """One plan the executor ran, with what it measured."""

    path: str
    model: ModelSpec
    cluster: ClusterSpec
    train: TrainSpec
    plan: Plan
    step_time_s: float
    """Median step time after warm-up (metrics.json step_times_s; its mean step_time_s when the
    per-step list is absent). The median, because on a shared machine a few steps stall."""
    peak_memory_gb: float
    """Largest per-rank peak (metrics.json peak_memory_gb)."""

    def on(self, device: DeviceProfile) -> ClusterSpec:
        """The run's cluster with `device` (and its links) in place of the one it was planned with."""
        return dataclasses.replace(self.cluster, device=device, intra_node=device.intra_node,
                                   inter_node=device.inter_node)


def load_measured(run_dir: str | Path) -> MeasuredRun:
    """Read a run directory written by `planner search` and `planner run`."""
    d = Path(run_dir)
    metrics = read_json(d / "metrics.json" if d.is_dir() else d, "metrics.json")
    where = str(d)
    if not isinstance(metrics, dict):
        raise SpecError(where, "metrics.json is not a JSON object", "re-run `planner run`")
    if metrics.get("status") != "ok":
        raise SpecError(where, f"the run did not succeed (status {metrics.get('status')!r}: {metrics.get('error')})",
                        "leave failed runs out of the calibration")
    for key in ("step_time_s", "peak_memory_gb", "plan", "model"):
        if key not in metrics:
            raise SpecError(f"{where}/metrics.json", f"has no {key}", "re-run `planner run`")
    _, _, cluster, train, _ = load_run(d if d.is_dir() else d.parent)
    plan = Plan.from_dict(metrics["plan"])
    model = ModelSpec.from_dict(metrics["model"])
    step, mem = metrics["step_time_s"], metrics["peak_memory_gb"]
    times = metrics.get("step_times_s") or []
    warm = metrics.get("warmup", 0) if isinstance(metrics.get("warmup"), int) else 0
    timed = [t for t in times[warm:] if isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0]
    if timed:
        step = statistics.median(timed)
    for name, v in (("step_time_s", step), ("peak_memory_gb", mem)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise SpecError(f"{where}/metrics.json", f"{name} must be a positive number, got {v!r}", "re-run `planner run`")
    train = dataclasses.replace(train, global_batch=plan.global_batch, precision=plan.precision)
    return MeasuredRun(path=where, model=model, cluster=cluster, train=train, plan=plan,
                       step_time_s=float(step), peak_memory_gb=float(mem))
