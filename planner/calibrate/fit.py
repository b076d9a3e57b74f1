"""Fit the cost model's named runtime factors (planner/cost/factors.py) to measured runs.

Step-time factors are fitted to the runs' step times and to the profiler's per-block times
(TP 1 points: forward + backward of one block); memory factors to the runs' peak memory.
Residuals are log(predicted / measured), so every run weighs the same whatever its size.
Solver: the package's one fitter (planner/calibrate/solver.py fit_relative: Levenberg-Marquardt
in a transformed space: log for positive factors, logit for dp_overlap, a fraction, softplus for
additive terms) with a ridge penalty lam * (z - z_default)^2
that keeps factors the runs cannot determine at their defaults (Tikhonov regularisation).
lam is chosen by leave-one-out cross-validation over the runs; the held-out error of each run
(fitted without it, same lam: solver.leave_out) is the honest figure.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from planner.calibrate.runs import MeasuredRun
from planner.calibrate.solver import Log, Logit, Param, Softplus, fit_relative, leave_out
from planner.cost import estimate, layer_costs
from planner.cost.factors import DEFAULTS
from planner.specs.hardware import DeviceProfile
from planner.specs.cluster import ClusterSpec
from planner.specs.plan import Plan
from planner.specs.train import TrainSpec

TIME_FACTORS = ("compute_scale", "attention_scale", "elementwise_scale", "comm_efficiency", "dp_overlap",
                "step_overhead_s", "microbatch_overhead_s", "optimizer_scale")
MEMORY_FACTORS = ("activation_scale", "memory_overhead_gb", "memory_fragmentation")
FRACTIONS = ("dp_overlap",)
ADDITIVE = ("step_overhead_s", "microbatch_overhead_s", "memory_overhead_gb", "memory_fragmentation")
LAMBDAS = (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0)


def with_factors(device: DeviceProfile, factors: dict[str, float]) -> DeviceProfile:
    return dataclasses.replace(device, factors={**device.factors, **factors})


def param(name: str, unit: float) -> Param:
    """How `name` is fitted: multipliers in log space, fractions (dp_overlap) as a logit, additive
    terms (seconds, GB, fragmentation), which may be 0, as unit x softplus."""
    if name in FRACTIONS:
        return Logit(name)
    if name in ADDITIVE:
        return Softplus(name, unit)
    return Log(name)


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerObs:
    """A profiler block timing usable as an observation (TP 1: no communication in it)."""

    model: Any
    micro_batch: int
    seq: int
    precision: str
    time_s: float


def layer_observations(device: DeviceProfile) -> list[LayerObs]:
    m = device.measured or {}
    opts, rows = m.get("options", {}), m.get("layers", [])
    if not opts or not rows:
        return []
    from planner.specs.model import ModelSpec
    model = ModelSpec.from_dict(opts["model"])
    return [LayerObs(model=ModelSpec.from_dict(r["model"]) if r.get("model") else model,
                     micro_batch=r["micro_batch"], seq=r["seq"],
                     precision=r.get("precision") or opts["precision"],
                     time_s=r["forward_s"]["median"] + r["backward_s"]["median"]) for r in rows if r["tp"] == 1]


def predict_time(device: DeviceProfile, run: MeasuredRun) -> float:
    return estimate(run.model, run.on(device), run.train, run.plan).step_time_s


def predict_memory(device: DeviceProfile, run: MeasuredRun) -> float:
    return estimate(run.model, run.on(device), run.train, run.plan).peak_memory_gb


def predict_layer(device: DeviceProfile, obs: LayerObs) -> float:
    cluster = ClusterSpec(nodes=1, gpus_per_node=1, device=device, intra_node=device.intra_node,
                          inter_node=device.inter_node)
    plan = Plan(micro_batch=obs.micro_batch, precision=obs.precision)
    train = TrainSpec(global_batch=obs.micro_batch, seq_len=obs.seq, precision=obs.precision)
    return layer_costs(obs.model, cluster, train, plan).block_time


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupFit:
    factors: dict[str, float]
    lam: float
    sensitivity: dict[str, float]
    """|d log(prediction) / d z| summed over the observations: ~0 means not determined."""
    iterations: int


def _fit(device: DeviceProfile, names: tuple[str, ...], observations: list[tuple[Callable, float]],
         lam: float, unit: float) -> GroupFit:
    """observations: (predict(device) -> value, measured value); unit: scale of the additive
    factors (the runs' median step time in seconds, or their median memory in GB)."""
    params = [param(n, 0.1 if n == "memory_fragmentation" else unit) for n in names]
    f = fit_relative(lambda v: [p(with_factors(device, v)) for p, _ in observations], [m for _, m in observations],
                     params, {n: device.factor(n, DEFAULTS[n]) for n in names}, lam=lam)
    sens = np.abs(f.solution.jacobian[:len(observations)]).sum(axis=0)
    return GroupFit(factors=f.values, lam=lam, sensitivity={n: float(s) for n, s in zip(names, sens)},
                    iterations=f.iterations)


def fit_group(device: DeviceProfile, names: tuple[str, ...], runs: list[MeasuredRun],
              measure: Callable[[MeasuredRun], float], predict: Callable[[DeviceProfile, MeasuredRun], float],
              extra: list[tuple[Callable, float]] = ()) -> tuple[GroupFit, list[float]]:
    """Fit `names` to the runs (+ extra observations); returns the fit and each run's held-out prediction."""
    obs = [(lambda d, r=r: predict(d, r), measure(r)) for r in runs]
    unit = float(np.median([measure(r) for r in runs]))

    def loo(lam: float) -> list[float]:
        def held(i: int) -> float:
            f = _fit(device, names, obs[:i] + obs[i + 1:] + list(extra), lam, unit)
            return predict(with_factors(device, f.factors), runs[i])
        return list(leave_out(range(len(runs)), held).values())

    if len(runs) >= 3:
        scores, held = {}, {}
        for lam in LAMBDAS:
            held[lam] = loo(lam)
            scores[lam] = float(np.mean([math.log(p / measure(r)) ** 2 for p, r in zip(held[lam], runs)]))
        lam = min(scores, key=scores.get)
        held_out = held[lam]  # same lam for every fold (mildly optimistic: lam was chosen on all runs)
    else:
        lam, held_out = LAMBDAS[-1], [float("nan")] * len(runs)
    return _fit(device, names, obs + list(extra), lam, unit), held_out
