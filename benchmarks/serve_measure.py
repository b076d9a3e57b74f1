"""Measure serving deployments of ChatGLM3 tiny/small on this machine, beside the cost model.

Each deployment (model scale, TP, max batch, arrival rate) is served for real by
planner.executor.serve_run.run_serving (KV cache, continuous batching, TP ranks as gloo
processes, Poisson arrivals) and its serve_metrics.json saved under --out/<name>/. Printed per
deployment: measured TTFT, TPOT (mean) and achieved QPS, and beside them the serving cost
model's prediction at the same rate (planner/serve/queue.py simulate with cost.step_fns) on
the `cpu` profile, its serving factors fitted (planner/serve/calibrate.py fit_serving, on the
measured prefill and decode step times) on the other runs (leave-one-out: every row is held
out). Then, for QPS_DEPLOYMENTS, the highest arrival rate whose measured p50 end-to-end latency
meets a target (bisection over short runs) beside queue.qps_at_target with the factors fitted
on all the runs above (the bisection runs are not fitted on).

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

from planner.executor.serve_run import METRICS_FILE, run_serving  # noqa: E402
from planner.rundir import atomic_write_json  # noqa: E402
from planner.specs import parse_cluster, preset, scale  # noqa: E402

WORKLOADS = {"tiny": dict(prompt_len=32, output_len=16, prompt_sigma=0.3, output_sigma=0.3, seed=0),
             "small": dict(prompt_len=64, output_len=16, prompt_sigma=0.3, output_sigma=0.3, seed=0)}
REQUESTS = {"tiny": 32, "small": 16}
# QPS at a p50 end-to-end latency target, measured by bisection over arrival rates: (scale, tp,
# max batch, target ms), QPS_REQUESTS requests per probe, QPS_ITERS bisection steps
QPS_DEPLOYMENTS = [("tiny", 1, 4, 40.0), ("small", 1, 4, 200.0)]
QPS_REQUESTS = {"tiny": 24, "small": 12}
QPS_ITERS = 4
# (scale, tp, max_batch, rate requests/s). Two small TP 1 runs reach batches above 4 (mb8 r16,
# mb6 r24): held out, each one's decode_compute_scale is fitted with the other still in the fit
# (with one, leave-one-out fitted that regime from tiny's batches alone)
DEPLOYMENTS = [("tiny", 1, 1, 20.0), ("tiny", 1, 4, 20.0), ("tiny", 1, 8, 80.0), ("tiny", 2, 4, 20.0),
               ("tiny", 2, 8, 80.0), ("small", 1, 1, 4.0), ("small", 1, 4, 4.0), ("small", 1, 8, 16.0),
               ("small", 1, 6, 24.0), ("small", 2, 4, 4.0), ("small", 2, 8, 16.0)]


def name_of(size: str, tp: int, mb: int, rate: float) -> str:
    return f"{size}-tp{tp}-mb{mb}-r{rate:g}"


def measure(out: Path, precision: str, seed: int, threads: int) -> list[dict]:
    runs = []
    for size, tp, mb, rate in DEPLOYMENTS:
        spec = scale(preset("chatglm3-6b"), size)
        d = out / name_of(size, tp, mb, rate)
        t0 = time.perf_counter()
        m = run_serving(spec, tp=tp, max_batch=mb, workload=WORKLOADS[size], rate_qps=rate,
                        requests=REQUESTS[size], seed=seed, timeout_s=120, precision=precision, out_dir=d,
                        threads=threads)
        print(f"measured {d.name}: {time.perf_counter() - t0:.1f} s, {m['requests']} requests "
              f"-> {d / METRICS_FILE}", flush=True)
        runs.append(m)
    return runs


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
    the measured run serves (queue.draw_requests, as planner/executor/loadgen.py)."""
    from planner.serve import queue
    from planner.serve.cost import serve_factor, step_fns
    from planner.serve.spec import Deployment, Workload
    dep = Deployment(tp=dep_tp, max_batch=max_batch)
    cluster = parse_cluster(f"{dep.tp}x{device.name}", device)
    prefill, decode = step_fns(model, cluster, dep)
    wake = serve_factor(cluster, "serve_wake_s")
    cache: dict = {}

    def run(rate: float) -> dict:
        if rate not in cache:
            cache[rate] = queue.simulate(prefill, decode, Workload(**workload), rate, requests=requests, seed=seed,
                                         max_batch=max_batch, max_total=model.max_seq, wake_s=wake)
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
    return abs(pred - meas) / meas if meas else float("nan")


def measured_qps_at_target(size: str, tp: int, mb: int, target_s: float, lo: float, hi: float, out: Path,
                           precision: str, seed: int, threads: int, iters: int) -> tuple[float | None, list]:
    """Highest arrival rate whose measured p50 end-to-end latency meets target_s: geometric
    bisection on [lo, hi] with short runs (QPS_REQUESTS requests each); (rate or None, the
    (rate, p50 e2e) probes)."""
    spec = scale(preset("chatglm3-6b"), size)
    probes = []

    def meets(rate: float) -> bool:
        m = run_serving(spec, tp=tp, max_batch=mb, workload=WORKLOADS[size], rate_qps=rate,
                        requests=QPS_REQUESTS[size], seed=seed, timeout_s=60, precision=precision,
                        out_dir=out / f"{name_of(size, tp, mb, rate)}", threads=threads)
        probes.append((rate, m["e2e_s"]["p50"]))
        return m["e2e_s"]["p50"] is not None and m["e2e_s"]["p50"] <= target_s and not m["timed_out"]
    if not meets(lo):
        return None, probes
    if meets(hi):
        return hi, probes
    for _ in range(iters):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return lo, probes


def qps_table(out: Path, device, args) -> list[dict]:
    """Measured vs predicted QPS at a p50 end-to-end target for QPS_DEPLOYMENTS."""
    from planner.serve import queue
    from planner.serve.spec import Target
    rows = []
    for size, tp, mb, target_ms in QPS_DEPLOYMENTS:
        spec = scale(preset("chatglm3-6b"), size)
        run = _runner(spec, device, tp, mb, WORKLOADS[size], QPS_REQUESTS[size], args.seed)
        sat = queue.saturation_qps(run)
        pred = queue.qps_at_target(run, Target(kind="p50", value=target_ms / 1e3, metric="e2e"), sat)
        t0 = time.perf_counter()
        centre = pred or sat / 2
        meas, probes = measured_qps_at_target(size, tp, mb, target_ms / 1e3, centre / 2.5, min(centre * 2.5, sat),
                                              out / "qps", args.precision, args.seed, args.threads, QPS_ITERS)
        name = f"{size}-tp{tp}-mb{mb}"
        print(f"{name:18} p50 e2e <= {target_ms:g} ms: measured {meas or 0:7.2f} req/s / predicted "
              f"{pred or 0:7.2f} req/s {_pct(pred or 0, meas) if meas else 'n/a':>5} "
              f"({len(probes)} runs, {time.perf_counter() - t0:.1f} s: "
              + ", ".join(f"{r:.1f}->{1e3 * e:.0f}ms" for r, e in probes) + ")", flush=True)
        rows.append({"deployment": name, "target_p50_e2e_s": target_ms / 1e3, "measured_qps": meas,
                     "predicted_qps": pred, "probes": probes})
    return rows


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
    args = p.parse_args(argv)
    out = Path(args.out)
    runs = measure(out, args.precision, args.seed, args.threads)
    print("\nleave-one-out: each deployment predicted with the serving factors fitted on the other "
          f"{len(runs) - 1} runs' steps")
    print(f"{'deployment':24} {'TTFT ms meas/pred':>22} {'TPOT ms meas/pred':>22} {'QPS meas/pred':>20}")
    rows = []
    for i, m in enumerate(runs):
        d = m["deployment"]
        name = name_of(m["model"]["name"].rsplit("-", 1)[-1], d["tp"], d["max_batch"], m["rate_qps"])
        device, factors = fitted_device(runs[:i] + runs[i + 1:])
        pr = predict(m, device)
        pred = (pr["ttft_s"]["mean"], pr["tpot_s"]["mean"], pr["achieved_qps"])
        meas = (m["ttft_s"]["mean"], m["tpot_s"]["mean"], m["achieved_qps"])
        print(f"{name:24} {1e3 * meas[0]:9.1f} / {1e3 * pred[0]:7.1f} {_pct(pred[0], meas[0]):>5}"
              f"{1e3 * meas[1]:9.2f} / {1e3 * pred[1]:6.2f} {_pct(pred[1], meas[1]):>5}"
              f"{meas[2]:8.2f} / {pred[2]:6.2f} {_pct(pred[2], meas[2]):>5}", flush=True)
        rows.append({"deployment": name, "factors": factors,
                     "measured": dict(zip(("ttft_s", "tpot_s", "qps"), meas)),
                     "predicted": dict(zip(("ttft_s", "tpot_s", "qps"), pred))})
    summary = {}
    for k in ("ttft_s", "tpot_s", "qps"):
        errs = [_err(r["predicted"][k], r["measured"][k]) for r in rows]
        within = sum(e <= 0.15 for e in errs)
        summary[k] = {"mean_abs_error": sum(errs) / len(errs), "max_abs_error": max(errs), "within_15pct": within}
        print(f"{k:7} mean |error| {100 * summary[k]['mean_abs_error']:.0f}%, max {100 * max(errs):.0f}%, "
              f"within 15%: {within}/{len(errs)}")
    device, factors = fitted_device(runs)
    print(f"\nall {len(runs)} runs: {_fmt(factors)}")
    qps = [] if args.no_qps else qps_table(out, device, args)
    atomic_write_json(out / "summary.json", {"factors_all_runs": factors, "precision": args.precision,
                                             "rows": rows, "errors": summary, "qps_at_target": qps})
    return 0


if __name__ == "__main__":
    sys.exit(main())
