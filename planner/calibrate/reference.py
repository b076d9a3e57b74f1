"""Calibrate the named runtime factors on DeepSpeed's own published runs (issue 9, point 3).

The rows are shared reference/deepspeed-at-scale.md, sections A-E, encoded with their source
tags and every assumption in profiles/reference/deepspeed-rows.json: BigScience's Megatron-DeepSpeed
pipeline runs on Jean Zay (A100) and a 13B run on DGX-2 (V100), ZeRO-3 at up to 1024 A100s on
Azure, ZeRO-3 vs ZeRO++ on 64 V100s, ZeRO-Offload on one V100, ZeRO-2 data parallel on 128 V100s.

For each row the script builds (model, cluster, train, plan), runs planner.cost.estimate, and
compares in the row's own convention: the step time where the source gives s/iter or ms/iter,
else TFLOP/s per GPU = the source's FLOPs formula per step (Megatron's 96 B s l h^2 (1 + s/6h +
V/16lh), or 8 N tokens) / predicted step time / GPUs. Error = predicted / measured - 1.

Then one set of named factors per GPU generation (A100: sections A and B; V100: A's 13B row, C,
D, E), never one per row, minimising the mean squared log error over the rows marked "fit" (plus
a small ridge toward the profile's current values, which keeps a factor the rows cannot
determine where it was): the package's one fitter, planner/calibrate/solver.py fit_relative
(Levenberg-Marquardt polished by Nelder-Mead: the cost model's max/min kinks stop LM at
corners), from several starting points, in a transformed space (multipliers bounded to a
physical range, logit for dp_overlap as in planner/calibrate/fit.py, seconds linear and >= 0). The factor list per generation is a
parameter (--factors); by default BASE_FACTORS plus every time factor planner/cost/factors.py
has gained since (latency_scale, zero3_fetch_overhead_s, cpu_adam_scale, ...). Every row is
also predicted by a fit that did not see it (leave-one-out, warm-started at the full fit; a
held-out row's leave-one-out is its after-fit prediction). Rows whose point is a ZeRO variant the cost
model does not represent yet (its estimate is unchanged with the variant switched off) print
with a note and stay out of the fit.

    .venv/bin/planner calibrate --reference                 # fit, write the shipped factors into profiles/
    .venv/bin/python benchmarks/ds_reference.py            # table; writes reports/bench-ds-reference/calibration.json
    .venv/bin/python benchmarks/ds_reference.py --json     # the same as JSON on stdout
    .venv/bin/python benchmarks/ds_reference.py --factors A100=compute_scale,network_efficiency --inter-gbps jean-zay=10.5

Megatron-LM's Table 1 stays the separate check for --megatron-features plans (benchmarks/fidelity.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from planner.calibrate.accuracy import mape, rel_error
from planner.calibrate.fit import ADDITIVE, FRACTIONS, with_factors
from planner.calibrate.solver import Additive, Bounded, Logit, Param, fit_relative, leave_out, pmap
from planner.cost import estimate
from planner.cost.factors import DEFAULTS, Factors, factor
from planner.rundir import atomic_write_json
from planner.specs import Estimate, ModelSpec, Plan, TrainSpec, find_device, parse_cluster
from planner.specs.estimate import GB
from planner.specs.hardware import PROFILES_DIR, ClusterSpec, DeviceProfile, Host

DATA = PROFILES_DIR / "reference" / "deepspeed-rows.json"
"""DeepSpeed's published runs as rows (shared reference/deepspeed-at-scale.md A-E, with every
assumption the source leaves open)."""
OUT = Path("reports") / "bench-ds-reference" / "calibration.json"

BASE_FACTORS = ("compute_scale", "dp_overlap", "step_overhead_s", "microbatch_overhead_s")
"""Fitted per generation by default, plus every time factor planner/cost/factors.py gained after
this script was written (the ZeRO-3 fetch, offload ... factors) except PHYSICS."""
PHYSICS = ("comm_efficiency", "latency_scale")
"""Not fitted: communication is measured per link class (profiles/links/classes.json, the profiles'
per-step latencies: benchmarks/link_curves.py), so both stay at 1.0."""
CAPS = {"step_overhead_s": 0.05}
"""Additive factors that may not grow past a bound (issue 19 item 4: any remaining constant
<= 50 ms; the time it stood for is physics now)."""
KNOWN_FACTORS = frozenset({"compute_scale", "attention_scale", "elementwise_scale", "comm_efficiency", "dp_overlap",
                           "step_overhead_s", "microbatch_overhead_s", "optimizer_scale", "activation_scale",
                           "memory_overhead_gb", "memory_fragmentation"})
MEMORY_WORDS = ("memory", "fragmentation", "activation_scale", "_gb", "bytes")
UNITS = {"step_overhead_s": 0.01, "microbatch_overhead_s": 0.01, "zero3_fetch_overhead_s": 1e-4}
"""Scale of the additive factors (seconds; an unknown one 1e-4 s): the ridge costs lam x (value / unit)^2."""
LAM = 1e-4
"""Ridge weight toward the profile's current value, per unit of transformed factor, on the scale
of the mean squared log error (a unit step of z costs 1e-4: 1% of a 1% MSLE): enough to hold a
factor the rows do not determine, too little to move one they do."""
FTOL, XTOL = 1e-9, 1e-7
"""Levenberg-Marquardt's stopping tolerances (relative cost change, step): far below the rows'
own uncertainty, far above what costs iterations for nothing."""
STARTS = 4
"""Starting points per generation's fit (leave-one-out refits warm-start from the full fit)."""
LOO_NM = 20
"""Nelder-Mead evaluations per factor in a leave-one-out refit (its start is already near)."""
VARIANTS = {"offload_optimizer": "none", "offload_params": "none", "hpz": 1, "quantized_weights": False,
            "quantized_gradients": False, "mics_shard": 0}


PER_GENERATION = {"network_efficiency": ("A100",)}
"""Factors fitted only for the generations whose sources determine them. network_efficiency:
A100's network rows come from two sources on two fabrics (A: Omni-Path on Jean Zay, B:
InfiniBand on Azure), and leaving either out keeps it near (A: 3.5%, B: 6.9% leave-one-source-
out); V100's (A13, C, E) do not determine it: fitted on them it reaches 1.38 (a network faster
than stated) and leaving C out sends C's error to 470%. V100 keeps the measured class efficiency."""


def default_factor_names(gen: str | None = None) -> tuple[str, ...]:
    # in the factors' declared order (planner/cost/factors.py Factors): DEFAULTS iterates a
    # frozenset, whose order changes with PYTHONHASHSEED, and the order of the fitted names sets
    # Levenberg-Marquardt's path (the fit's last digits and its iteration count)
    new = tuple(n for n in Factors.names() if n not in KNOWN_FACTORS and n not in PHYSICS
                and not any(w in n for w in MEMORY_WORDS) and (gen in PER_GENERATION.get(n, (gen,))))
    return BASE_FACTORS + new


# --- rows -----------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    id: str
    section: str
    gen: str
    source: str
    tag: str
    note: str
    fit: bool
    """Marked for fitting in the data (False: held out)."""
    needs_variant: bool
    """The row's point is a ZeRO variant: out of the fit while the cost model cannot represent it."""
    metric: str
    """step_s (seconds per step) or tflops (TFLOP/s per GPU in the source's convention)."""
    measured: float
    flops: str | None
    """The source's FLOPs convention: megatron or 8nt (None for step-time rows)."""
    published_tflops: float | None
    memory_gb: float | None
    memory_kind: str
    """device (the GPU's peak: the estimate's total) or allocated (torch max allocated: the
    estimate's total less its runtime allowance)."""
    phases_s: Mapping[str, float] | None
    model: ModelSpec
    train: TrainSpec
    plan: Plan
    cluster_name: str
    gpus: str
    inter_gbps: float | None
    intra_gbps: float | None
    host: Mapping[str, float] | None
    assumed: tuple[str, ...]

    @property
    def world(self) -> int:
        return self.plan.world_size


def _world(gpus: str) -> int:
    nums = [int(x) for x in gpus.lower().split("x")[:-1]]
    return math.prod(nums) if nums else 1


def load_rows(path: Path = DATA, inter_gbps: Mapping[str, float] | None = None) -> list[Row]:
    """Every row of the data file as a Row; `inter_gbps` overrides a cluster's inter-node link."""
    data = json.loads(Path(path).read_text())
    out = []
    for r in data["rows"]:
        d = data["defaults"][r["defaults"]]
        fam = data["families"][d["family"]]
        cname = r.get("cluster", d.get("cluster"))
        cl = data["clusters"][cname]
        layers, hidden, heads = r["model"]
        m = dict(fam["model"])
        mult = m.pop("ffn_mult")
        seq = d["seq"]
        model = ModelSpec(name=f"{d['family']}-{layers}x{hidden}", hidden=hidden, layers=layers, heads=heads,
                          ffn_hidden=mult * hidden, max_seq=seq, **m)
        pk = {**d.get("plan", {}), **r["plan"]}
        tp, pp = pk.pop("tp", 1), pk.pop("pp", 1)
        dp = pk.pop("dp", _world(cl["gpus"]) // (tp * pp))
        mb = pk.pop("micro_batch")
        gbs = r.get("global_batch", mb * dp)
        if gbs % (mb * dp):
            raise ValueError(f"{r['id']}: global batch {gbs} is not a multiple of micro-batch {mb} x dp {dp}")
        plan = Plan(dp=dp, tp=tp, pp=pp, zero=pk.pop("zero", d["zero"]), micro_batch=mb, grad_accum=gbs // (mb * dp),
                    recompute=d["recompute"], precision=d["precision"], **pk)
        train = TrainSpec(global_batch=gbs, seq_len=seq, precision=d["precision"], attention="eager")
        assumed = (fam["assumed"], cl["assumed"], *d.get("assumed", ()), *r.get("assumed", ()))
        out.append(Row(
            id=r["id"], section=d.get("section", r["defaults"]), gen=d["gen"], source=data["sources"][d["source"]],
            tag=r["tag"], note=r.get("note", ""), fit=bool(r["fit"]),
            needs_variant=bool(r.get("needs_variant", False)),
            metric=d["metric"], measured=float(r["measured"]), flops=d.get("flops"),
            published_tflops=r.get("published_tflops"), memory_gb=r.get("memory_gb"),
            memory_kind=d.get("memory_kind", "device"), phases_s=r.get("phases_s"), model=model, train=train,
            plan=plan, cluster_name=cname, gpus=cl["gpus"],
            inter_gbps=(inter_gbps or {}).get(cname, cl.get("inter_gbps")), intra_gbps=cl.get("intra_gbps"),
            host=cl.get("host"), assumed=assumed))
    return out


def source_flops(row: Row) -> float:
    """FLOPs per step in the source's convention (hardware FLOPs, recompute counted)."""
    m, t = row.model, row.train
    b, s, l, h, v = t.global_batch, t.seq_len, m.layers, m.hidden, m.vocab
    if row.flops == "megatron":  # Narayanan et al. 2021 eq. 3; Megatron-DeepSpeed's throughput calculator
        return 96.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h))
    if row.flops == "8nt":
        return 8.0 * m.params * b * s
    raise ValueError(f"{row.id}: no FLOPs convention")


def cluster_for(row: Row, device: DeviceProfile) -> ClusterSpec:
    c = parse_cluster(row.gpus, device, inter_gbps=row.inter_gbps, intra_gbps=row.intra_gbps)
    if row.host:
        c = dataclasses.replace(c, host=Host(**row.host))
    return c


def run_estimate(row: Row, device: DeviceProfile, plan: Plan | None = None) -> Estimate:
    return estimate(row.model, cluster_for(row, device), row.train, plan or row.plan)


def value_of(row: Row, est: Estimate) -> float:
    """The estimate in the row's metric."""
    if row.metric == "step_s":
        return est.step_time_s
    return source_flops(row) / est.step_time_s / row.world / 1e12


def predict(row: Row, device: DeviceProfile) -> float:
    return value_of(row, run_estimate(row, device))


def unrepresented(row: Row, device: DeviceProfile) -> list[str]:
    """The row's ZeRO variants the cost model ignores (its estimate is unchanged without them)."""
    est = run_estimate(row, device)
    out = []
    for k, off in VARIANTS.items():
        if getattr(row.plan, k) == off:
            continue
        try:
            other = run_estimate(row, device, dataclasses.replace(row.plan, **{k: off}))
        except Exception:  # noqa: BLE001 - a plan the variant's rules reject without it: it matters
            continue
        if other.step_time_s == est.step_time_s and other.peak_memory_bytes == est.peak_memory_bytes:
            out.append(f"{k}={getattr(row.plan, k)}")
    return out


def memory_of(row: Row, est: Estimate) -> float:
    mb = est.stage_memory[est.peak_stage]
    return (mb.total - (mb.overhead if row.memory_kind == "allocated" else 0.0)) / GB


def phases_of(est: Estimate) -> dict[str, float]:
    """forward compute / optimizer step / the rest (backward, recompute and every exposed
    collective: the estimate does not split ZeRO-3's gathers by phase)."""
    t = est.time
    return {"forward": t.forward, "optimizer": t.optimizer, "backward": est.step_time_s - t.forward - t.optimizer}


# --- fitting --------------------------------------------------------------------------------

BOUNDS = {"compute_scale": (0.5, 4.0), "attention_scale": (0.25, 8.0), "elementwise_scale": (0.25, 8.0),
          "comm_efficiency": (0.05, 1.0 / 0.9), "latency_scale": (0.05, 50.0), "cpu_adam_scale": (0.2, 5.0),
          "optimizer_scale": (0.25, 8.0)}
"""Physical ranges of the multipliers. comm_efficiency may reach 1/0.9: the links here are
stated at 0.825-0.9 of their line rate (the profiles take 0.9), so 1/0.9 is about the line rate."""


def transform(name: str, device: DeviceProfile) -> Param:
    """logit for dp_overlap (as planner.calibrate.fit does); multipliers bounded to BOUNDS (an
    unknown one to 1/20..20 x its value); seconds and factors that sit at 0 additive (value =
    unit x |z|: planner.calibrate.fit's softplus has slope ~1e-3 at 0, where these start, and the
    ridge would then hold them there whatever the rows say). The parametrisations are
    planner/calibrate/solver.py's."""
    v = factor_value(device, name)
    if name in FRACTIONS:
        return Logit(name)
    if name in ADDITIVE or v <= 0 or name.endswith(("_s", "_us", "_ms", "_gb")):
        return Additive(name, UNITS.get(name, 1e-4 if name.endswith("_s") else 1.0), CAPS.get(name, math.inf))
    lo, hi = BOUNDS.get(name, (v / 20.0, v * 20.0))
    return Bounded(name, min(lo, v / 1.01), max(hi, v * 1.01))


def factor_value(device: DeviceProfile, name: str) -> float:
    return factor(device, name)


@dataclass(frozen=True, slots=True, kw_only=True)
class Fit:
    factors: dict[str, float]
    sensitivity: dict[str, float]
    """Mean |d log(prediction) / d z| over the fitted rows at the solution (z: the transformed
    factor: logit of its place between its bounds for multipliers, logit for fractions,
    value / unit for seconds)."""
    determination: dict[str, float]
    """How much the rows rather than the ridge set each factor: info / (info + lam), info the
    rows' curvature of the mean squared log error along z (sum of squared Jacobian entries).
    Below 0.5 the ridge decides: the rows do not determine the factor and it stays near the
    profile's value."""
    msle: float
    cost: float
    """The minimised objective: 0.5 (MSLE + lam |z - z_profile|^2)."""
    iterations: int
    at_bound: list[str] = dataclasses.field(default_factory=list)
    """Multipliers that ended at a bound of BOUNDS (the rows push them past what is physical)."""


def fit_factors(rows: Sequence[Row], device: DeviceProfile, names: Sequence[str], *, lam: float = LAM,
                start: Mapping[str, float] | None = None, starts: int = 1, perturbations: Sequence[int] = (),
                nm_evals: int = 0, predictor: Callable[[Row, DeviceProfile], float] = predict) -> Fit:
    """One set of `names` for all `rows` (one generation): minimise mean log(pred/meas)^2 +
    lam |z - z_profile|^2 by Levenberg-Marquardt (planner/calibrate/solver.py) polished by
    Nelder-Mead, from `start` (default: the profile's values) and from more points drawn
    uniformly within +-2 of it in z (seeds 1 .. starts - 1, or `perturbations`; seed 0 is
    `start` itself); the lowest cost wins (the cost model's max/min kinks leave corners and
    shallow local minima)."""
    tr = [transform(n, device) for n in names]
    meas = np.array([r.measured for r in rows])
    scale = 1.0 / math.sqrt(len(rows))
    fit = fit_relative(lambda v: [predictor(r, with_factors(device, v)) for r in rows], meas, tr,
                       {n: factor_value(device, n) for n in names}, start=start, lam=lam, weight=scale,
                       seeds=list(perturbations) or list(range(starts)), polish=True, nm_evals=nm_evals,
                       ftol=FTOL, xtol=XTOL)
    sol, values = fit.solution, fit.values
    after = with_factors(device, values)
    r = scale * np.log(np.array([max(predictor(x, after), 1e-30) for x in rows]) / meas) / scale
    jac = sol.jacobian[:len(rows)]
    sens = np.abs(jac).mean(axis=0) / scale
    info = (jac ** 2).sum(axis=0)
    at_bound = [t.name for t in tr if isinstance(t, Bounded) and t.at_bound(values[t.name])]
    return Fit(factors=values, sensitivity={n: float(x) for n, x in zip(names, sens)},
               determination={n: float(i / (i + lam)) if i + lam > 0 else 0.0 for n, i in zip(names, info)},
               msle=float(np.mean(r ** 2)), cost=sol.cost, iterations=fit.iterations, at_bound=at_bound)


_STATE: dict[str, Any] = {}
"""What the pool's workers read: per generation its fitted rows, device, factor names, lam and
(for leave-one-out) the full fit to start from. Set before the pool forks."""


def _task(task: tuple[str, str, int]) -> Any:
    kind, gen, i = task
    g = _STATE[gen]
    if kind == "start":  # one starting point of the generation's full fit
        return fit_factors(g["fitted"], g["device"], g["names"], lam=g["lam"], perturbations=(i,))
    rows = [r for j, r in enumerate(g["fitted"]) if j != i]  # leave row i out, warm-start at the full fit
    f = fit_factors(rows, g["device"], g["names"], lam=g["lam"], start=g["start"], nm_evals=LOO_NM * len(g["names"]))
    return predict(g["fitted"][i], with_factors(g["device"], f.factors)), f.factors


# --- the benchmark --------------------------------------------------------------------------

def run(*, factor_names: Mapping[str, Sequence[str]] | None = None, lam: float = LAM,
        inter_gbps: Mapping[str, float] | None = None, loo: bool = True, jobs: int = 2, starts: int = STARTS,
        data: Path = DATA) -> dict[str, Any]:
    t0 = time.perf_counter()
    meta = json.loads(Path(data).read_text())
    rows = load_rows(data, inter_gbps)
    report: dict[str, Any] = {"lam": lam, "starts": starts, "generations": {}, "rows": [], "sections": {},
                              "clusters": meta["clusters"], "defaults": meta["defaults"],
                              "families": meta["families"]}
    by_id: dict[str, dict[str, Any]] = {}
    _STATE.clear()
    for gen, ginfo in meta["generations"].items():
        device, _ = find_device(ginfo["profile"])
        grows = [r for r in rows if r.gen == gen]
        missing = {r.id: unrepresented(r, device) for r in grows}
        fitted = [r for r in grows if r.fit and not (r.needs_variant and missing[r.id])]
        _STATE[gen] = {"device": device, "rows": grows, "missing": missing, "fitted": fitted, "lam": lam,
                       "names": tuple((factor_names or {}).get(gen, default_factor_names(gen)))}
    fits: dict[str, list[Fit]] = {}
    for (_, gen, _), f in zip(tasks := [("start", g, k) for g in _STATE for k in range(starts)],
                              pmap(_task, tasks, jobs)):
        fits.setdefault(gen, []).append(f)
    for gen in _STATE:
        _STATE[gen]["fit"] = min(fits[gen], key=lambda f: f.cost)
        _STATE[gen]["start"] = _STATE[gen]["fit"].factors
    loo_tasks = [("loo", g, i) for g in _STATE for i in range(len(_STATE[g]["fitted"]))] if loo else []
    loo_out = leave_out(loo_tasks, _task, jobs=jobs)
    for gen, ginfo in meta["generations"].items():
        st = _STATE[gen]
        device, grows, missing, fitted, names, fit = (st[k] for k in ("device", "rows", "missing", "fitted", "names",
                                                                      "fit"))
        fitted_ids = {r.id for r in fitted}
        after_dev = with_factors(device, fit.factors)
        loo_by_id: dict[str, float] = {}
        loo_factors: dict[str, dict[str, float]] = {}
        for i, r in enumerate(fitted):
            if ("loo", gen, i) in loo_out:
                loo_by_id[r.id], loo_factors[r.id] = loo_out[("loo", gen, i)]
        before_f = {n: factor_value(device, n) for n in names}
        report["generations"][gen] = {
            "profile": ginfo["profile"], "applies_to": ginfo["applies_to"], "why": ginfo["why"],
            "fitted_names": list(names), "before": before_f, "after": fit.factors,
            "sensitivity": fit.sensitivity,
            "determination": fit.determination,
            "undetermined": [n for n, d in fit.determination.items() if d < 0.5 and n not in fit.at_bound],
            "at_bound": fit.at_bound,
            "msle_fitted": fit.msle, "iterations": sum(f.iterations for f in fits[gen]),
            "fitted_rows": [r.id for r in fitted],
            "loo_factor_range": {n: [min(f[n] for f in loo_factors.values()), max(f[n] for f in loo_factors.values())]
                                 for n in names} if loo_factors else {},
        }
        for r in grows:
            eb, ea = run_estimate(r, device), run_estimate(r, after_dev)
            before, after = value_of(r, eb), value_of(r, ea)
            in_fit = r.id in fitted_ids
            loo_v = loo_by_id.get(r.id, after if loo and not in_fit else None)
            notes = []
            if missing[r.id]:
                notes.append("cost model does not represent " + ", ".join(missing[r.id])
                             + (" yet: out of the fit" if r.needs_variant else " yet"))
            if not eb.feasible:
                notes.append("estimate infeasible: " + "; ".join(eb.reasons))
            rec = {
                "id": r.id, "section": r.section, "gen": gen, "tag": r.tag, "note": r.note,
                "role": "fit" if in_fit else "held out" if not r.fit else "excluded",
                "metric": r.metric, "measured": r.measured,
                "before": before, "after": after, "loo": loo_v,
                "err_before": rel_error(before, r.measured), "err_after": rel_error(after, r.measured),
                "err_loo": rel_error(loo_v, r.measured), "notes": notes,
                "plan": r.plan.describe(), "cluster": r.cluster_name, "gpus": r.gpus,
                "global_batch": r.train.global_batch, "seq": r.train.seq_len,
                "source_tflops_convention": r.flops, "source": r.source, "assumed": list(r.assumed),
                "estimate_after": {"step_time_s": ea.step_time_s, "time_breakdown_s": ea.time.to_dict(),
                                   "peak_memory_gb": ea.peak_memory_gb, "feasible": ea.feasible},
            }
            if r.metric == "step_s" and r.flops:
                rec["published_tflops"] = r.published_tflops
                rec["formula_tflops_at_measured_step"] = source_flops(r) / r.measured / r.world / 1e12
            if r.memory_gb is not None:
                rec["memory"] = {"kind": r.memory_kind, "measured_gb": r.memory_gb,
                                 "predicted_gb": memory_of(r, ea), "err": rel_error(memory_of(r, ea), r.memory_gb)}
            if r.phases_s:
                rec["phases_s"] = {"measured": dict(r.phases_s), "predicted_after": phases_of(ea)}
            by_id[r.id] = rec
    report["rows"] = [by_id[r.id] for r in rows]
    report["profiles"] = profile_provenance(report["generations"], meta.get("borrow", "A100"))
    groups: dict[str, list[dict]] = {}
    for rec in report["rows"]:
        groups.setdefault(f"section {rec['section']}" + (f" ({rec['gen']})" if rec["section"] == "A" else ""),
                          []).append(rec)
        groups.setdefault(rec["gen"], []).append(rec)
    groups["all"] = report["rows"]
    for k, recs in groups.items():
        report["sections"][k] = {
            "rows": len(recs),
            "mape_before": mape([x["err_before"] for x in recs]),
            "mape_after": mape([x["err_after"] for x in recs]),
            "mape_after_fitted": mape([x["err_after"] for x in recs if x["role"] == "fit"]),
            "mape_after_held_out": mape([x["err_after"] for x in recs if x["role"] == "held out"]),
            "mape_loo": mape([x["err_loo"] for x in recs]),
            "memory_mape": mape([x["memory"]["err"] for x in recs if "memory" in x]),
        }
    report["runtime_s"] = time.perf_counter() - t0
    return report


def profile_provenance(gens: Mapping[str, Mapping[str, Any]], borrow: str) -> dict[str, dict[str, Any]]:
    """For every built-in GPU profile, per factor: fitted on its own generation's rows; or, for
    a profile with no rows of its own, borrowed (from `borrow`'s rows, else another
    generation's, where they determine it); or kept at the profile's value (its own rows do not
    determine it, or push it to a bound: another generation's value is noted, not imposed)."""
    def determined(g: str, n: str) -> bool:
        v = gens[g]
        return n in v["fitted_names"] and n not in set(v["undetermined"]) | set(v["at_bound"])

    out = {}
    for f in sorted(PROFILES_DIR.glob("*.json")):
        data = json.loads(f.read_text())
        if data.get("kind") != "gpu":
            continue
        name = data["name"]
        own = next((g for g, v in gens.items() if name in v["applies_to"]), None)
        names = list(dict.fromkeys(n for v in gens.values() for n in v["fitted_names"]))
        mine, borrowed, kept = [], {}, {}
        for n in names:
            if own is not None and determined(own, n):
                mine.append(n)
                continue
            donor = next((g for g in [borrow, *gens] if g != own and determined(g, n)), None)
            alt = {"from": donor, "value": gens[donor]["after"][n]} if donor else {"from": None, "value": None}
            if own is None and donor:
                borrowed[n] = alt
            else:
                why = ("pushed to its bound by" if own and n in gens[own]["at_bound"] else "not determined by") + \
                    (f" {own}'s rows" if own else " any generation's rows")
                kept[n] = {"why": why, "alternative": alt}
        out[name] = {"generation": own, "fitted_on_own_generation": mine, "borrowed": borrowed, "kept": kept,
                     "note": (f"rows of {own}" + ("" if name == gens[own]["profile"] else
                                                  f" (fitted on {gens[own]['profile']}, the same chip)"))
                     if own else f"no DeepSpeed rows of its own in the reference: borrows {borrow}'s (the nearest "
                                 f"generation with rows: NVLink nodes, InfiniBand)"}
    return out


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def render(rep: dict[str, Any]) -> str:
    lines = [f"{'row':<4} {'gen':<4} {'role':<8} {'metric':<6} {'measured':>9} {'before':>9} {'err':>7} "
             f"{'after':>9} {'err':>7} {'LOO':>9} {'err':>7}  plan / note"]
    for x in rep["rows"]:
        unit = "s/step" if x["metric"] == "step_s" else "TFLOP/s"
        lines.append(f"{x['id']:<4} {x['gen']:<4} {x['role']:<8} {unit:<6} {x['measured']:>9.2f} "
                     f"{x['before']:>9.2f} {_fmt(x['err_before'], '+7.1%')} {x['after']:>9.2f} "
                     f"{_fmt(x['err_after'], '+7.1%')} {_fmt(x['loo'], '9.2f')} {_fmt(x['err_loo'], '+7.1%')}  "
                     f"{x['note']}: {x['plan']}")
        for n in x["notes"]:
            lines.append(f"{'':<27}! {n}")
    lines.append("")
    lines.append(f"{'MAPE':<16} {'rows':>4} {'before':>8} {'after':>8} {'fitted':>8} {'held out':>9} {'LOO':>8} "
                 f"{'memory':>8}")
    for k, s in rep["sections"].items():
        lines.append(f"{k:<16} {s['rows']:>4} {_fmt(s['mape_before'], '8.1%')} {_fmt(s['mape_after'], '8.1%')} "
                     f"{_fmt(s['mape_after_fitted'], '8.1%')} {_fmt(s['mape_after_held_out'], '9.1%')} "
                     f"{_fmt(s['mape_loo'], '8.1%')} {_fmt(s['memory_mape'], '8.1%')}")
    lines.append("")
    mem = [x for x in rep["rows"] if "memory" in x]
    if mem:
        lines.append("memory per GPU (after fit; memory factors not fitted):")
        for x in mem:
            m = x["memory"]
            lines.append(f"  {x['id']:<4} {m['kind']:<9} measured {m['measured_gb']:6.2f} GB  predicted "
                         f"{m['predicted_gb']:6.2f} GB  {m['err']:+.1%}")
    ph = [x for x in rep["rows"] if "phases_s" in x]
    if ph:
        lines.append("phases, seconds (measured / predicted after fit; predicted backward = everything but "
                     "forward compute and the optimizer step):")
        for x in ph:
            m, p = x["phases_s"]["measured"], x["phases_s"]["predicted_after"]
            lines.append("  " + f"{x['id']:<4} " + "  ".join(f"{k} {m[k]:.2f} / {p[k]:.2f}" for k in m))
    lines.append("")
    for gen, g in rep["generations"].items():
        lines.append(f"{gen} ({g['profile']}; fitted on {len(g['fitted_rows'])} rows, MSLE {g['msle_fitted']:.4f}, "
                     f"{g['iterations']} iterations):")
        for n in g["fitted_names"]:
            rng = g["loo_factor_range"].get(n)
            lines.append(f"  {n:<24} {g['before'][n]:>10.4g} -> {g['after'][n]:>10.4g}   determined "
                         f"{g['determination'][n]:4.2f}" + (" (by the ridge, not the rows: stays near the profile's)"
                                                            if n in g["undetermined"] else "")
                         + (" (at its bound)" if n in g["at_bound"] else "")
                         + (f"   LOO range {rng[0]:.4g}..{rng[1]:.4g}" if rng else ""))
    lines.append("profiles: factors fitted on their own generation / borrowed / kept (another generation's value):")
    for name, p in rep["profiles"].items():
        b = ", ".join(f"{n} from {v['from']}" for n, v in p["borrowed"].items())
        k = ", ".join(n + (f" ({v['alternative']['from']}: {v['alternative']['value']:.4g})"
                           if v["alternative"]["from"] else "") for n, v in p["kept"].items())
        lines.append(f"  {name:<10} own: {', '.join(p['fitted_on_own_generation']) or '-'}; borrowed: {b or '-'}; "
                     f"kept at the profile's value: {k or '-'}")
    lines.append(f"lam {rep['lam']:g}, {rep['starts']} starts; runtime {rep['runtime_s']:.1f} s")
    return "\n".join(lines)


def apply(rep: dict[str, Any], profiles_dir: Path = PROFILES_DIR) -> list[str]:
    """Write the fit into the built-in profiles: each factor fitted on the profile's own
    generation, or borrowed from another generation's fit, with a source line saying which
    (the issue's rule: never one factor per row, and every profile states where its factors
    came from). Returns one line per profile changed."""
    out = []
    sections = {"A100": "A (BigScience, Jean Zay) and B (Azure NDm A100 v4 ZeRO-3)",
                "V100": "A13 (Megatron-DeepSpeed 13B), C (ZeRO-3 vs ZeRO++), D (ZeRO-Offload), E (ZeRO paper)"}
    for name, p in rep["profiles"].items():
        path = profiles_dir / f"{name}.json"
        data = json.loads(path.read_text())
        factors, sources = dict(data.get("factors", {})), dict(data.get("sources", {}))
        gen = p.get("generation")
        if gen:
            g = rep["generations"][gen]
            loo = rep["sections"].get(gen, {}).get("mape_loo")
            for n in p["fitted_on_own_generation"]:
                factors[n] = round(g["after"][n], 6)
                sources[f"factors.{n}"] = (
                    f"fitted on DeepSpeed's published {gen} runs, sections {sections.get(gen, '?')} of "
                    f"reference/deepspeed-at-scale.md ({len(g['fitted_rows'])} rows, one set for the generation; "
                    f"MSLE {g['msle_fitted']:.4f}" + (f", leave-one-out MAPE {100 * loo:.1f}%" if loo else "")
                    + "): planner calibrate --reference")
        for n, b in p["borrowed"].items():
            factors[n] = round(b["value"], 6)
            sources[f"factors.{n}"] = (f"borrowed from the {b['from']} fit on DeepSpeed's published runs (no published "
                                       f"DeepSpeed runs on {name}): planner calibrate --reference")
        for n in p["kept"]:
            sources[f"factors.{n}"] = (f"kept at planner/cost/factors.py's default: {p['kept'][n]['why']} "
                                       "(planner calibrate --reference)")
        sources["factors"] = ("DeepSpeed runtime factors fitted per GPU generation on DeepSpeed's own published runs "
                              "(planner calibrate --reference); each factors.<name> line says fitted, borrowed or "
                              "kept; Megatron-LM Table 1 is the separate check (benchmarks/fidelity.py)")
        data["factors"], data["sources"] = dict(sorted(factors.items())), sources
        atomic_write_json(path, data)
        out.append(f"{name}: " + ", ".join(f"{k}={v:.4g}" for k, v in data["factors"].items()))
    return out


def _pairs(items: Sequence[str], what: str) -> dict[str, str]:
    out = {}
    for it in items:
        if "=" not in it:
            raise SystemExit(f"{what}: expected NAME=VALUE, got {it!r}")
        k, v = it.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--factors", action="append", default=[], metavar="GEN=a,b,c",
                    help=f"factors to fit for a generation (default: {','.join(default_factor_names())})")
    ap.add_argument("--inter-gbps", action="append", default=[], metavar="CLUSTER=GBPS",
                    help="override a cluster's assumed inter-node bus bandwidth (clusters in the data file)")
    ap.add_argument("--lam", type=float, default=LAM, help=f"ridge weight toward the profile's values ({LAM:g})")
    ap.add_argument("--starts", type=int, default=STARTS, help=f"fit starting points per generation ({STARTS})")
    ap.add_argument("--no-loo", action="store_true", help="skip the leave-one-out refits")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                    help="processes for the fits' starting points and the leave-one-out refits")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--apply", action="store_true",
                    help="write the fitted (and borrowed) factors into profiles/*.json with their sources")
    a = ap.parse_args(argv)
    names = {g: [n for n in v.split(",") if n] for g, v in _pairs(a.factors, "--factors").items()}
    for g, ns in names.items():
        bad = [n for n in ns if n not in DEFAULTS]
        if bad:
            raise SystemExit(f"--factors {g}: unknown factor(s) {bad}; known: {', '.join(DEFAULTS)}")
    gbps = {k: float(v) for k, v in _pairs(a.inter_gbps, "--inter-gbps").items()}
    rep = run(factor_names=names, lam=a.lam, inter_gbps=gbps, loo=not a.no_loo, jobs=a.jobs, starts=a.starts)
    rep["command"] = " ".join(["planner calibrate --reference" if a.apply else "benchmarks/ds_reference.py",
                               *(argv if argv is not None else sys.argv[1:])])
    atomic_write_json(a.out, rep)
    print(json.dumps(rep, indent=2) if a.json else render(rep) + f"\nwritten: {a.out}")
    if a.apply:
        print("applied to profiles/:\n  " + "\n  ".join(apply(rep)))
    return rep


if __name__ == "__main__":
    main()
