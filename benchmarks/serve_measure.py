"""Measure serving deployments of ChatGLM3 tiny/small on this machine, beside the cost model.

Each deployment (model scale, TP, max batch, arrival rate) is served for real by
planner.runtime.serve.run.run_serving (KV cache, continuous batching, TP ranks as gloo
processes, Poisson arrivals) and its serve_metrics.json saved under --out/<name>/. Printed per
deployment: measured TTFT, TPOT (mean) and achieved QPS, and beside them the serving cost
model's prediction at the same rate (planner/serve/queue.py simulate with cost.step_fns) on
the `cpu` profile, its serving factors fitted (planner/serve/calibrate.py fit_serving, on the
measured prefill and decode step times) on the other runs (leave-one-out: every row is held
out). Each deployment is run --repeats times (default 3) and each measured figure is the median
over its repeats (TP 2 over gloo moves 20-50% from run to run); the fit uses every repeat of the
other deployments.

Then, for every deployment, the highest arrival rate whose measured p50 end-to-end latency meets
a target (bisection over short runs of QPS_REQUESTS requests) beside queue.qps_at_target over
the same requests, again with the factors fitted on the other deployments' runs (the bisection
runs are never fitted on). The target is a latency the deployment meets only under load: the
predicted p50 end-to-end latency at the lowest of TARGET_LOADS x its predicted saturation
throughput where the predicted curve is steep (its elasticity d ln p50 / d ln rate at least
STEEP; else the highest load), rounded up to the next ms: on the flat part of the curve, where
continuous batching absorbs load, a few per cent of latency noise moves the crossing by tens of
per cent of rate, and the measurement would test the noise, not the QPS. Measured: runs at QPS_GRID x the predicted rate and the crossing of a
smooth latency-load curve fitted through them (`crossing`), or a bound when the fitted curve
stays on one side of the target over the measured rates.

    ... --reuse   re-prints the tables from the runs already under --out (no new steady runs)

    flock /tmp/planner-cpu.lock .venv/bin/python benchmarks/serve_measure.py [--out reports/serve_measure]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.runtime.serve.run import METRICS_FILE, run_serving  # noqa: E402
from planner.rundir import atomic_write_json  # noqa: E402
from planner.calibrate.accuracy import rel_error  # noqa: E402
from planner.specs import parse_cluster, preset, scale  # noqa: E402

WORKLOADS = {"tiny": dict(prompt_len=32, output_len=16, prompt_sigma=0.3, output_sigma=0.3, seed=0),
             "small": dict(prompt_len=64, output_len=16, prompt_sigma=0.3, output_sigma=0.3, seed=0)}
REQUESTS = {"tiny": 32, "small": 16}
# QPS at a p50 end-to-end latency target, measured by bisection over arrival rates:
# QPS_REQUESTS requests per probe at QPS_GRID x the predicted rate, target on the steep part (TARGET_LOADS)
QPS_REQUESTS = {"tiny": 96, "small": 48}
QPS_GRID = (0.6, 0.75, 0.9, 1.05, 1.2, 1.4)
TARGET_LOADS = (0.8, 0.85, 0.9, 0.95)
STEEP = 1.5
# (scale, tp, max_batch, rate requests/s). Two small TP 1 runs reach batches above 4 (mb8 r16,
# mb6 r24): held out, each one's decode_compute_scale is fitted with the other still in the fit
# (with one, leave-one-out fitted that regime from tiny's batches alone)
DEPLOYMENTS = [("tiny", 1, 1, 20.0), ("tiny", 1, 4, 20.0), ("tiny", 1, 8, 80.0), ("tiny", 2, 4, 20.0),
               ("tiny", 2, 8, 80.0), ("small", 1, 1, 4.0), ("small", 1, 4, 4.0), ("small", 1, 8, 16.0),
               ("small", 1, 6, 24.0), ("small", 2, 4, 4.0), ("small", 2, 8, 16.0)]


def name_of(size: str, tp: int, mb: int, rate: float) -> str:
    return f"{size}-tp{tp}-mb{mb}-r{rate:g}"


def measure(out: Path, precision: str, seed: int, threads: int, repeats: int,
            reuse: bool = False) -> list[list[dict]]:
    """Every deployment `repeats` times; [deployment][repeat] serve_metrics documents (reuse:
    read the ones already under `out`)."""
    import json
    runs = []
    for size, tp, mb, rate in DEPLOYMENTS:
        spec = scale(preset("chatglm3-6b"), size)
        reps = []
        for k in range(repeats):
            d = out / name_of(size, tp, mb, rate) / f"rep{k}"
            if reuse and (d / METRICS_FILE).exists():
                reps.append(json.loads((d / METRICS_FILE).read_text()))
                continue
            t0 = time.perf_counter()
            m = run_serving(spec, tp=tp, max_batch=mb, workload=WORKLOADS[size], rate_qps=rate,
                            requests=REQUESTS[size], seed=seed, timeout_s=120, precision=precision, out_dir=d,
                            threads=threads)
            print(f"measured {name_of(size, tp, mb, rate)} #{k}: {time.perf_counter() - t0:.1f} s, "
                  f"{m['requests']} requests -> {d / METRICS_FILE}", flush=True)
            reps.append(m)
        runs.append(reps)
    return runs


def _median(x: list[float]) -> float:
    import statistics
    return float(statistics.median(x))


def fitted_device(fit_runs: list[dict]):
    """The built-in `cpu` profile with its serving factors fitted on `fit_runs`
    (planner/serve/calibrate.py fit_serving); (device, factors)."""
    import dataclasses

    from planner.serve.calibrate import fit_serving
    from planner.specs.hardware import find_device
    device = find_device("cpu")[0]
    factors = fit_serving(fit_runs, device)
    return dataclasses.replace(device, factors={**device.factors, **factors}), factors


def _fmt(factors: dict) -> str:
    return ", ".join(f"{k} {v:.4g}" for k, v in factors.items())


def _runner(model, device, dep_tp: int, max_batch: int, workload: dict, requests: int, seed: int):
    """rate -> simulate() of the deployment with the device's step times, over the requests
    the measured run serves (queue.draw_requests, as planner/runtime/serve/loadgen.py)."""
    from planner.serve import queue
    from planner.serve.cost import step_fns
    from planner.serve.factors import serve_factor
    from planner.serve.spec import Deployment, Workload
    dep = Deployment(tp=dep_tp, max_batch=max_batch)
    cluster = parse_cluster(f"{dep.tp}x{device.name}", device)
    prefill, decode = step_fns(model, cluster, dep)
    wake = serve_factor(cluster, "serve_wake_s")
    cache: dict = {}

    def run(rate: float) -> dict:
        if rate not in cache:
            cache[rate] = queue.simulate(prefill, decode, Workload(**workload), rate, requests=requests, seed=seed,
                                         max_batch=max_batch, max_total=model.max_seq, wake_s=wake, engine="executor")
        return cache[rate]
    return run


def predict(m: dict, device) -> dict:
    """The cost model at the measured rate: simulate() with the deployment's step times on
    tp x cpu processes (the cluster calibrate.py fits on), over the same requests."""
    from planner.specs.model import ModelSpec
    d = m["deployment"]
    return _runner(ModelSpec.from_dict(m["model"]), device, d["tp"], d["max_batch"], m["workload"],
                   m["requests_offered"], m["seed"])(m["rate_qps"])


def _pct(pred: float, meas: float) -> str:
    return f"{100 * (pred - meas) / meas:+.0f}%" if meas else "n/a"


def _err(pred: float, meas: float) -> float:
    """|rel_error| (NaN where there is nothing to compare)."""
    e = rel_error(pred, meas)
    return float("nan") if e is None else abs(e)


def crossing(rates: list[float], p50s: list[float], target_s: float) -> tuple[float, str]:
    """The rate at which a smooth latency-load curve through the measured points reaches target_s:
    a quadratic in log rate / log p50 (numpy.polyfit; the curve is flat at low load and bends up
    near saturation), evaluated on a fine grid over the measured rates; (rate, "" / "<" / ">"):
    the highest rate whose fitted p50 meets the target, or the lowest rate with "<" when none
    does, the highest with ">" when all do."""
    import numpy as np
    x, y = np.log(rates), np.log(p50s)
    fit = np.poly1d(np.polyfit(x, y, 2))
    grid = np.linspace(x.min(), x.max(), 2001)
    ok = fit(grid) <= np.log(target_s)
    if not ok.any():
        return float(rates[0] if rates[0] < rates[-1] else min(rates)), "<"
    if ok.all():
        return float(max(rates)), ">"
    # the last grid point still meeting the target before the first one that misses it for good
    last_ok = int(np.nonzero(ok)[0].max()) if ok[-1] else int(np.nonzero(~ok)[0].min()) - 1
    return float(np.exp(grid[max(last_ok, 0)])), ""


FALL = 0.25
"""A probe's p50 latency below (1 - FALL) x the p50 at the next lower rate: not noise (the runs
serve the same requests, common random numbers), the machine took the CPU from the run."""


def latency_falls(probes: list[tuple[float, float]], fall: float = FALL) -> list[tuple[float, float]]:
    """The (lower rate, higher rate) pairs of consecutive probes whose p50 end-to-end latency
    drops by more than `fall` as the offered rate rises. Queueing only adds latency as load grows,
    so such a drop marks a run the machine slowed (others' jobs on the cores a TP 2 step needs
    both of): a row with one is contended, and its QPS at the target measures the machine, not
    the model."""
    pts = sorted(probes)
    return [(a[0], b[0]) for a, b in zip(pts, pts[1:]) if b[1] < (1.0 - fall) * a[1]]


def measured_qps_at_target(size: str, tp: int, mb: int, target_s: float, pred: float, out: Path,
                           precision: str, seed: int, threads: int) -> tuple[float, str, list]:
    """Highest arrival rate whose measured p50 end-to-end latency meets target_s: short runs
    (QPS_REQUESTS requests each) at QPS_GRID x the predicted rate, and the crossing of the
    latency-load curve fitted through them (`crossing`; one noisy run does not decide it as it
    would a bisection step); (rate, bound, the (rate, p50 e2e) probes)."""
    spec = scale(preset("chatglm3-6b"), size)
    probes = []
    for g in QPS_GRID:
        rate = round(pred * g, 3)
        m = run_serving(spec, tp=tp, max_batch=mb, workload=WORKLOADS[size], rate_qps=rate,
                        requests=QPS_REQUESTS[size], seed=seed, timeout_s=60, precision=precision,
                        out_dir=out / f"{name_of(size, tp, mb, rate)}", threads=threads)
        if m["e2e_s"]["p50"] is not None and not m["timed_out"]:
            probes.append((rate, m["e2e_s"]["p50"]))
    rate, bound = crossing([r for r, _ in probes], [e for _, e in probes], target_s)
    return rate, bound, probes


def target_load(run, sat: float) -> float:
    """The lowest of TARGET_LOADS (shares of the saturation rate `sat`) at which the predicted
    p50 end-to-end latency grows at least STEEP times as fast as the rate (elasticity, over the
    next 5% of rate); the highest when none does."""
    import math
    for load in TARGET_LOADS:
        a, b = run(load * sat)["e2e_s"]["p50"], run(1.05 * load * sat)["e2e_s"]["p50"]
        if math.log(b / a) / math.log(1.05) >= STEEP:
            return load
    return TARGET_LOADS[-1]


def qps_table(out: Path, runs: list[list[dict]], args) -> list[dict]:
    """Measured vs predicted QPS at a p50 end-to-end target for every deployment, each predicted
    with the factors fitted on the other deployments' runs."""
    import math

    from planner.serve import queue
    from planner.serve.spec import Target
    rows = []
    print(f"\nQPS at a p50 end-to-end target (target: the predicted p50 at the lowest of {TARGET_LOADS} x predicted "
          f"saturation where the predicted curve's elasticity is >= {STEEP:g}; "
          f"measured: runs of {QPS_REQUESTS} requests at {', '.join(f'{g:g}' for g in QPS_GRID)} x the predicted "
          "rate, the crossing of a quadratic log-log latency curve through them)")
    for i, (size, tp, mb, _) in enumerate(DEPLOYMENTS):
        name = f"{size}-tp{tp}-mb{mb}"
        if any(r["deployment"] == name for r in rows):
            continue
        device, _ = fitted_device([m for j, reps in enumerate(runs) if j != i for m in reps])
        spec = scale(preset("chatglm3-6b"), size)
        run = _runner(spec, device, tp, mb, WORKLOADS[size], QPS_REQUESTS[size], args.seed)
        sat = queue.saturation_qps(run)
        load = target_load(run, sat)
        target_s = math.ceil(1e3 * run(load * sat)["e2e_s"]["p50"]) / 1e3
        pred = queue.qps_at_target(run, Target(kind="p50", value=target_s, metric="e2e"), sat)
        t0 = time.perf_counter()
        meas, bound, probes = measured_qps_at_target(size, tp, mb, target_s, pred, out / "qps", args.precision,
                                                     args.seed, args.threads)
        err = (pred - meas) / meas
        falls = latency_falls(probes)
        flag = ("; CONTENDED: p50 falls as the rate rises at " +
                ", ".join(f"{a:.1f}->{b:.1f}" for a, b in falls)) if falls else ""
        print(f"{name:15} p50 e2e <= {1e3 * target_s:5.0f} ms ({load:g} sat): measured {bound or ' '}{meas:6.2f} req/s / predicted "
              f"{pred:6.2f} req/s {_pct(pred, meas):>5} ({len(probes)} runs, {time.perf_counter() - t0:.0f} s: "
              + ", ".join(f"{r:.1f}->{1e3 * e:.0f}ms" for r, e in probes) + flag + ")", flush=True)
        rows.append({"deployment": name, "target_p50_e2e_s": target_s, "target_load": load, "measured_qps": meas, "bound": bound,
                     "predicted_qps": pred, "error": err, "probes": probes, "contended": bool(falls)})
    errs = [abs(r["error"]) for r in rows]
    print(f"qps@target mean |error| {100 * sum(errs) / len(errs):.0f}%, max {100 * max(errs):.0f}%, "
          f"within 15%: {sum(e <= 0.15 and not r['bound'] for e, r in zip(errs, rows))}/{len(rows)}")
    bad = [r["deployment"] for r in rows if r["contended"]]
    print(f"contended (p50 falls by more than {100 * FALL:.0f}% between consecutive probe rates): {len(bad)}/{len(rows)}"
          + (f": {', '.join(bad)}; the run does not measure these rows, re-run on a quiet machine" if bad else ""))
    return rows


def all_four(rows: list[dict], qps: list[dict]) -> int:
    """Deployments whose held-out TTFT, TPOT and achieved QPS and whose QPS at the p50 target (a
    bound counts as a miss) are all within 15% of the measured."""
    at = {r["deployment"]: abs(r["error"]) <= 0.15 and not r["bound"] for r in qps}
    return sum(all(_err(r["predicted"][k], r["measured"][k]) <= 0.15 for k in ("ttft_s", "tpot_s", "qps"))
               and at.get(r["deployment"].rsplit("-r", 1)[0], False) for r in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="reports/serve_measure", help="directory for each run's serve_metrics.json")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"],
                   help="weights and activations (bf16: what the cost model assumes)")
    p.add_argument("--seed", type=int, default=0, help="arrival-time seed")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per rank (1: TP 1 and TP 2 ranks alike get one core; steadier when the "
                        "machine is shared)")
    p.add_argument("--no-qps", action="store_true", help="skip the QPS-at-target bisection")
    p.add_argument("--repeats", type=int, default=3, help="runs per deployment; each figure is their median")
    p.add_argument("--reuse", action="store_true", help="read the steady runs already under --out instead of "
                   "running them again (the QPS-at-target runs always run)")
    args = p.parse_args(argv)
    out = Path(args.out)
    load0 = os.getloadavg()
    print(f"load average at the start: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}", flush=True)
    runs = measure(out, args.precision, args.seed, args.threads, args.repeats, args.reuse)
    print("\nleave-one-out: each deployment predicted with the serving factors fitted on the other "
          f"{len(runs) - 1} deployments' runs; measured: the median of {args.repeats} runs")
    print(f"{'deployment':24} {'TTFT ms meas/pred':>22} {'TPOT ms meas/pred':>22} {'QPS meas/pred':>20}")
    rows = []
    for i, reps in enumerate(runs):
        m = reps[0]
        d = m["deployment"]
        name = name_of(m["model"]["name"].rsplit("-", 1)[-1], d["tp"], d["max_batch"], m["rate_qps"])
        device, factors = fitted_device([r for j, rr in enumerate(runs) if j != i for r in rr])
        pr = predict(m, device)
        pred = (pr["ttft_s"]["mean"], pr["tpot_s"]["mean"], pr["achieved_qps"])
        meas = tuple(_median([r[k]["mean"] for r in reps]) for k in ("ttft_s", "tpot_s")) \
            + (_median([r["achieved_qps"] for r in reps]),)
        print(f"{name:24} {1e3 * meas[0]:9.1f} / {1e3 * pred[0]:7.1f} {_pct(pred[0], meas[0]):>5}"
              f"{1e3 * meas[1]:9.2f} / {1e3 * pred[1]:6.2f} {_pct(pred[1], meas[1]):>5}"
              f"{meas[2]:8.2f} / {pred[2]:6.2f} {_pct(pred[2], meas[2]):>5}", flush=True)
        rows.append({"deployment": name, "factors": factors,
                     "measured": dict(zip(("ttft_s", "tpot_s", "qps"), meas)),
                     "predicted": dict(zip(("ttft_s", "tpot_s", "qps"), pred)),
                     "repeats": [{k: r[k]["mean"] for k in ("ttft_s", "tpot_s")} | {"qps": r["achieved_qps"]}
                                 for r in reps]})
    summary = {}
    for k in ("ttft_s", "tpot_s", "qps"):
        errs = [_err(r["predicted"][k], r["measured"][k]) for r in rows]
        within = sum(e <= 0.15 for e in errs)
        summary[k] = {"mean_abs_error": sum(errs) / len(errs), "max_abs_error": max(errs), "within_15pct": within}
        print(f"{k:7} mean |error| {100 * summary[k]['mean_abs_error']:.0f}%, max {100 * max(errs):.0f}%, "
              f"within 15%: {within}/{len(errs)}")
    every = sum(all(_err(r["predicted"][k], r["measured"][k]) <= 0.15 for k in ("ttft_s", "tpot_s", "qps"))
                for r in rows)
    print(f"deployments with TTFT, TPOT and QPS all within 15%: {every}/{len(rows)}")
    device, factors = fitted_device([r for rr in runs for r in rr])
    print(f"\nall {len(runs)} deployments: {_fmt(factors)}")
    qps = [] if args.no_qps else qps_table(out, runs, args)
    if qps:
        print(f"deployments with TTFT, TPOT, QPS and QPS at the target all within 15%: {all_four(rows, qps)}/{len(rows)}")
    load1 = os.getloadavg()
    print(f"load average at the end: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    atomic_write_json(out / "summary.json", {"factors_all_runs": factors, "precision": args.precision,
                                             "load_average": {"start": list(load0), "end": list(load1)},
                                             "repeats": args.repeats, "rows": rows, "errors": summary,
                                             "all_three_within_15pct": every, "qps_at_target": qps,
                                             "all_four_within_15pct": all_four(rows, qps) if qps else None})
    return 0


if __name__ == "__main__":
    sys.exit(main())
