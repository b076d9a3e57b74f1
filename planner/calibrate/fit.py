"""Fit the cost model's named runtime factors (planner/cost/factors.py) to measured runs.

Step-time factors are fitted to the runs' step times and to the profiler's per-block times
(TP 1 points: forward + backward of one block); memory factors to the runs' peak memory.
Residuals are log(predicted / measured), so every run weighs the same whatever its size.
Solver: Levenberg-Marquardt (planner/calibrate/solver.py) in a transformed space (log for
positive factors, logit for dp_overlap, a fraction) with a ridge penalty lam * (z - z_default)^2
that keeps factors the runs cannot determine at their defaults (Tikhonov regularisation).
lam is chosen by leave-one-out cross-validation over the runs; the held-out error of each run
(fitted without it, same lam) is the honest figure.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from planner.calibrate.runs import MeasuredRun
from planner.calibrate.solver import least_squares
from planner.cost import estimate, layer_costs
from planner.cost.factors import DEFAULTS
from planner.specs.hardware import ClusterSpec, DeviceProfile
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


def _softplus(z: float) -> float:
    return z + math.log1p(math.exp(-z)) if z > 0 else math.log1p(math.exp(z))


def _softplus_inv(v: float) -> float:
    return v + math.log(-math.expm1(-v)) if v < 30 else v


class Transform:
    """Unconstrained z <-> factor value. Multipliers: log. Fractions: logit. Additive terms
    (seconds, GB, fragmentation) may be 0: unit x softplus(z), whose slope does not vanish near
    0 as a log's would (an overhead started at ~0 in log space never grows)."""

    def __init__(self, name: str, unit: float) -> None:
        self.name, self.unit = name, unit
        self.kind = "logit" if name in FRACTIONS else "softplus" if name in ADDITIVE else "log"

    def to_z(self, v: float) -> float:
        if self.kind == "logit":
            v = min(max(v, 1e-4), 1 - 1e-4)
            return math.log(v / (1 - v))
        if self.kind == "softplus":
            return _softplus_inv(max(v / self.unit, 1e-3))
        return math.log(v)

    def value(self, z: float) -> float:
        z = max(min(z, 50.0), -50.0)
        if self.kind == "logit":
            return 1 / (1 + math.exp(-z))
        if self.kind == "softplus":
            return float(self.unit * _softplus(z))
        return math.exp(z)


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
    return [LayerObs(model=model, micro_batch=r["micro_batch"], seq=r["seq"],
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
    meas = np.array([v for _, v in observations])
    tr = [Transform(n, 0.1 if n == "memory_fragmentation" else unit) for n in names]
    z0 = np.array([t.to_z(device.factor(n, DEFAULTS[n])) for n, t in zip(names, tr)])

    def resid(z: np.ndarray) -> np.ndarray:
        dev = with_factors(device, {t.name: t.value(zi) for t, zi in zip(tr, z)})
        pred = np.array([max(p(dev), 1e-30) for p, _ in observations])
        return np.concatenate([np.log(pred / meas), math.sqrt(lam) * (z - z0)])

    sol = least_squares(resid, z0)
    sens = np.abs(sol.jacobian[:len(observations)]).sum(axis=0)
    return GroupFit(factors={t.name: t.value(zi) for t, zi in zip(tr, sol.x)}, lam=lam,
                    sensitivity={n: float(s) for n, s in zip(names, sens)}, iterations=sol.iterations)


def fit_group(device: DeviceProfile, names: tuple[str, ...], runs: list[MeasuredRun],
              measure: Callable[[MeasuredRun], float], predict: Callable[[DeviceProfile, MeasuredRun], float],
              extra: list[tuple[Callable, float]] = ()) -> tuple[GroupFit, list[float]]:
    """Fit `names` to the runs (+ extra observations); returns the fit and each run's held-out prediction."""
    obs = [(lambda d, r=r: predict(d, r), measure(r)) for r in runs]
    unit = float(np.median([measure(r) for r in runs]))

    def loo(lam: float) -> list[float]:
        out = []
        for i, r in enumerate(runs):
            f = _fit(device, names, obs[:i] + obs[i + 1:] + list(extra), lam, unit)
            out.append(predict(with_factors(device, f.factors), r))
        return out

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
