"""Fit the serving factors (planner/serve/factors.py SERVE_DEFAULTS) to measured serving runs.

Input: serve_metrics.json documents written by planner/runtime/serve/run.py (`model`:
ModelSpec.to_dict(), `deployment`: {tp, max_batch, precision, prefill_chunk}, `decode_steps`:
[{batch, context_tokens, time_s, host_s}], `prefills`: [{tokens, time_s, host_s}]). A step's
measured seconds are its forward (time_s) plus the engine's own time before it (host_s, absent
in older files: 0), the whole step as the engine's clock sees it. Every step is

    time = max(compute x compute_scale, memory / decode_bw_efficiency)   (CPU: their sum, cost._serial)
           + comm x serve_comm_scale + serve_step_overhead_s + tp_steps x serve_tp_step_s
           + after_idle x serve_wake_s   (after_idle: the step's field, absent in older files: 0)
(a decode step's attention parts, its cache read and attention core, scaled by
decode_attention_scale inside the two sides)

(planner/serve/factors.py combine; compute_scale: prefill_compute_scale for prefills,
decode_compute_scale for decode steps) with the factor-free terms from cost.prefill_terms /
decode_terms. Once it is known which side of each max() binds, that is linear in x =
(prefill_compute_scale, decode_compute_scale, 1/decode_bw_efficiency, serve_comm_scale,
serve_step_overhead_s, serve_tp_step_s, serve_wake_s, decode_attention_scale; the last one's column
taken at the current scale and efficiency): a least-squares problem on relative errors of group
means (planner/calibrate/solver.py linear_relative, the package's one fitter): the steps of one run averaged per group (decode: per batch size; prefill:
after an idle wait or not), each group's row divided by its mean measured time and weighted by
its step count (_fit_from). The binding side is taken from the current
factors and the fit repeated until it no longer changes. A factor no row determines (no TP
runs: no comm; no compute-bound step) keeps its current value.
"""
from __future__ import annotations

import datetime
import math
from pathlib import Path
from typing import Any

import numpy as np

from planner.calibrate.accuracy import mape_of
from planner.calibrate.core import pct
from planner.calibrate.solver import linear_relative
from planner.errors import SpecError
from planner.rundir import atomic_write_json
from planner.serve.factors import SERVE_DEFAULTS, combine
from planner.serve.terms import decode_terms, prefill_terms
from planner.serve.spec import KV_BYTES, WEIGHT_BYTES, Deployment
from planner.specs.hardware import DeviceProfile, find_device, profile_from_dict
from planner.specs.cluster import parse_cluster
from planner.specs.model import ModelSpec

ORDER = ("prefill_compute_scale", "decode_compute_scale", "decode_bw_efficiency", "serve_comm_scale",
         "serve_step_overhead_s", "serve_tp_step_s", "serve_wake_s", "decode_attention_scale")
MAY_BE_ZERO = (4, 5, 6)
"""Columns of the fit that may come out 0 (the fixed per-step seconds); the scales must be > 0."""
Obs = tuple[dict[str, float], float, bool]


def _observations(run: dict[str, Any], device: DeviceProfile, keys: list | None = None) -> list[Obs]:
    """(factor-free terms, measured seconds, is a decode step) of every step of one
    serve_metrics.json; measured = time_s + host_s. `keys`: appended, each step's group (decode:
    its batch; prefill: whether it follows an idle wait) within this run."""
    try:
        model = ModelSpec.from_dict(run["model"])
        d = run["deployment"]
        p = d.get("precision", "bf16")
        dep = Deployment(tp=int(d["tp"]), max_batch=int(d.get("max_batch", 1)),
                         weight_precision=p if p in WEIGHT_BYTES else "bf16",
                         kv_precision=p if p in KV_BYTES else "bf16", prefill_chunk=int(d.get("prefill_chunk", 0)))
        steps, prefills = run.get("decode_steps", []), run.get("prefills", [])
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecError("serve_metrics.json", f"is missing or has a malformed field ({exc})",
                        "pass files written by planner.runtime.serve.run") from None
    cluster = parse_cluster(f"{dep.tp}x{device.name}", device)
    obs = []
    try:
        for s in steps:
            if s["time_s"] > 0:
                obs.append(({**decode_terms(model, cluster, dep, int(s["batch"]), int(s["context_tokens"]), curves=False),
                             "wake": float(bool(s.get("after_idle", False)))},
                            float(s["time_s"]) + float(s.get("host_s", 0.0)), True))
                if keys is not None:
                    keys.append(("decode", int(s["batch"]), bool(s.get("after_idle", False))))
        for s in prefills:
            if s["time_s"] > 0:
                obs.append(({**prefill_terms(model, cluster, dep, int(s["tokens"]), int(s.get("context", 0)), curves=False),
                             "wake": float(bool(s.get("after_idle", False)))},
                            float(s["time_s"]) + float(s.get("host_s", 0.0)), False))
                if keys is not None:
                    keys.append(("prefill", bool(s.get("after_idle", False))))
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecError("serve_metrics.json", f"has a malformed step ({exc})",
                        "pass files written by planner.runtime.serve.run") from None
    return obs


def _predict(obs: list[Obs], f: dict[str, float]) -> list[float]:
    return [combine(t, f, decode) for t, _, decode in obs]


def _columns(terms: dict[str, float], decode: bool, f: dict[str, float], fold: bool = False) -> list[float]:
    """One row of the linear system: the terms multiplying x (ORDER, 1/decode_bw_efficiency in
    place of decode_bw_efficiency) once the binding side of the max() is taken from `f`."""
    scale = f["decode_compute_scale"] if decode else f["prefill_compute_scale"]
    eff = f["decode_bw_efficiency"]
    serial = bool(terms.get("serial", 0.0))  # CPU: compute + memory, both sides count
    a = f.get("decode_attention_scale", 1.0) if decode else 1.0
    ac, am = (terms.get("attn_compute_s", 0.0), terms.get("attn_memory_s", 0.0)) if decode else (0.0, 0.0)
    compute_bound = (terms["compute_s"] + (a - 1) * ac) * scale >= (terms["memory_s"] + (a - 1) * am) / eff
    if fold:  # decode_attention_scale held at its value: its parts go with compute and memory
        ac, am = (1 - a) * ac, (1 - a) * am
    c = terms["compute_s"] - ac if compute_bound or serial else 0.0
    m = terms["memory_s"] - am if serial or not compute_bound else 0.0
    # decode_attention_scale's column: the attention parts at the current scale and efficiency
    # (the product is linearised like the max(): the fit alternates until both are stable)
    att = 0.0 if fold else \
        (ac * scale if compute_bound or serial else 0.0) + (am / eff if serial or not compute_bound else 0.0)
    return [0.0 if decode else c, c if decode else 0.0, m,
            terms["comm_s"], 1.0, terms.get("tp_steps", 0.0), terms.get("wake", 0.0), att]


def fit_serving(runs: list[dict[str, Any]], device: DeviceProfile | None = None, *,
                start: dict[str, float] | None = None, iters: int = 20) -> dict[str, float]:
    """The serving factors that best explain the measured steps of `runs` on `device` (default:
    the built-in cpu profile), starting from `start` (default: the device's current values)."""
    if device is None:
        device = find_device("cpu")[0]
    keys: list = []
    obs = [o for i, r in enumerate(runs) for o in _observations(r, device, keys)]
    run_of = [i for i, r in enumerate(runs) for _ in _observations(r, device)]
    if not obs:
        raise SpecError("serve runs", "hold no measured decode steps or prefills",
                        "pass serve_metrics.json files of completed serving runs")
    f = {k: device.factor(k, SERVE_DEFAULTS[k]) for k in ORDER}
    if start:
        f.update(start)
    meas = np.array([m for _, m, _ in obs])
    ids: dict = {}
    group = np.array([ids.setdefault((r, key), len(ids)) for r, key in zip(run_of, keys)])
    # the binding side of each max() follows the start: start also from larger compute scales, so
    # a compute-bound regime the defaults hide can be found; keep the best fit
    starts = [f] + [{**f, k: f[k] * m} for k in ("decode_compute_scale", "prefill_compute_scale") for m in (2.0, 4.0)]
    fits = [_fit_from(obs, meas, s0, iters, group) for s0 in starts]
    return min(fits, key=lambda g: _grouped_sse(np.array(_predict(obs, g)), meas, group))


def _group_mean(a: np.ndarray, group: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of `a` averaged within each group id; (means, rows per group)."""
    n = np.bincount(group).astype(float)
    sums = np.zeros((len(n),) + a.shape[1:])
    np.add.at(sums, group, a)
    return sums / n.reshape((-1,) + (1,) * (a.ndim - 1)), n


def _grouped_sse(pred: np.ndarray, meas: np.ndarray, group: np.ndarray) -> float:
    p, n = _group_mean(pred, group)
    m, _ = _group_mean(meas, group)
    return float(np.sum(n * (p / m - 1.0) ** 2))


def _rank(a: np.ndarray) -> int:
    """Numerical rank of a fit's columns, each scaled to unit length first (their units differ)."""
    norms = np.linalg.norm(a, axis=0)
    return int(np.linalg.matrix_rank(a / np.where(norms > 0, norms, 1.0), tol=1e-9))


def _fit_from(obs: list[Obs], meas_rows: np.ndarray, f: dict[str, float], iters: int,
              group: np.ndarray) -> dict[str, float]:
    """Alternate: binding sides from `f`, then the linear least squares; until `f` is stable.
    The rows are averaged within each group (one run's decode steps of one batch size, its
    prefills after an idle wait or not) and each group weighted by its step count: the
    simulation needs each kind of step's mean time (throughput is 1 / mean), and relative
    errors of single steps would fit below the mean where the step times scatter (TP on gloo:
    10-25 ms within one run), as sum((p/m - 1)^2) is weighted to the short steps."""
    n = len(ORDER)
    meas, count = _group_mean(meas_rows, group)
    w = np.sqrt(count)
    for _ in range(iters):
        cols, _ = _group_mean(np.array([_columns(t, decode, f) for t, _, decode in obs]), group)
        x_now = np.array([1.0 / f[k] if k == "decode_bw_efficiency" else f[k] for k in ORDER])
        free = [j for j in range(n) if np.any(cols[:, j] > 0)]
        if _rank(cols[:, free] / meas[:, None]) < len(free):
            # decode_attention_scale trades off against the bandwidth share where the weight read
            # cannot be told from the fixed seconds (one model size): it keeps its value and the
            # cache read shares the weights' bandwidth share, as before it was a factor
            cols, _ = _group_mean(np.array([_columns(t, decode, f, fold=True) for t, _, decode in obs]), group)
            free = [j for j in range(n) if np.any(cols[:, j] > 0)]
        # a negative fixed term is 0; a non-positive scale keeps its current value
        x = linear_relative(cols, meas, w, x_now, free, MAY_BE_ZERO)
        new = {k: float(1.0 / x[j] if k == "decode_bw_efficiency" else x[j]) for j, k in enumerate(ORDER)}
        if all(math.isclose(new[k], f[k], rel_tol=1e-9, abs_tol=1e-12) for k in ORDER):
            break
        f = new
    return f


def fit_report(runs: list[dict[str, Any]], factors: dict[str, float], device: DeviceProfile | None = None) -> dict[str, Any]:
    """Mean absolute percentage error of the step times before (the device's factors) and after."""
    if device is None:
        device = find_device("cpu")[0]
    obs = [o for r in runs for o in _observations(r, device)]
    meas = [m for _, m, _ in obs]
    before = {k: device.factor(k, SERVE_DEFAULTS[k]) for k in ORDER}
    return {"steps": len(obs), "mape_before_pct": pct(mape_of(_predict(obs, before), meas)),
            "mape_after_pct": pct(mape_of(_predict(obs, factors), meas)), "factors": factors}


def apply_serving(profile_data: dict[str, Any], factors: dict[str, float], report: dict[str, Any]) -> dict[str, Any]:
    """The profile JSON with the fitted serving factors and their sources (like
    planner/calibrate/core.apply for the training factors); marked not built in."""
    data = dict(profile_data)
    data["factors"] = {**data.get("factors", {}), **{k: round(v, 9) for k, v in factors.items()}}
    data["builtin"] = False
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    sources = dict(data.get("sources", {}))
    for k in factors:
        sources[f"factors.{k}"] = (f"fitted by planner.serve.calibrate to {report['steps']} measured serving steps on "
                                   f"{date} (step-time MAPE {report['mape_before_pct']:.1f}% -> "
                                   f"{report['mape_after_pct']:.1f}%)")
    data["sources"] = sources
    data["measured"] = {**data.get("measured", {}), "serving_calibration": report}
    profile_from_dict(data, str(data.get("name")))
    return data


def write_serving_profile(profile_path: str | Path, runs: list[dict[str, Any]], out: str | Path) -> dict[str, Any]:
    """Fit the serving factors of the profile at `profile_path` to `runs` and write a calibrated
    copy to `out` (atomically); returns the fit report."""
    import json
    src = Path(profile_path)
    data = json.loads(src.read_text())
    device = profile_from_dict(data, str(src))
    factors = fit_serving(runs, device)
    report = fit_report(runs, factors, device)
    atomic_write_json(out, apply_serving(data, factors, report))
    return report
