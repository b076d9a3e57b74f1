"""Measure serving deployments of ChatGLM3 tiny/small on this machine, beside the cost model.

Each deployment (model scale, TP, max batch, arrival rate) is served for real by
planner.executor.serve_run.run_serving (KV cache, continuous batching, TP ranks as gloo
processes, Poisson arrivals) and its serve_metrics.json saved under --out/<name>/. Printed per
deployment: measured TTFT, TPOT (mean) and achieved QPS, and beside them the serving cost
model's prediction at the same rate (planner/serve/queue.py simulate with cost.step_fns) on
the `cpu` profile, its serving factors fitted (planner/serve/calibrate.py fit_serving, on the
measured prefill and decode step times) on the even-numbered runs and tested on the odd ones.

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
# (scale, tp, max_batch, rate requests/s)
DEPLOYMENTS = [("tiny", 1, 1, 20.0), ("tiny", 1, 4, 20.0), ("tiny", 1, 8, 80.0), ("tiny", 2, 4, 20.0),
               ("tiny", 2, 8, 80.0), ("small", 1, 1, 4.0), ("small", 1, 4, 4.0), ("small", 1, 8, 16.0),
               ("small", 2, 4, 4.0), ("small", 2, 8, 16.0)]


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
    (planner/serve/calibrate.py fit_serving); (device, label, factors)."""
    import dataclasses

    from planner.serve.calibrate import fit_serving
    from planner.specs.hardware import find_device
    device = find_device("cpu")[0]
    factors = fit_serving(fit_runs, device)
    label = "fitted on the even-numbered runs: " + ", ".join(f"{k} {v:.4g}" for k, v in factors.items())
    return dataclasses.replace(device, factors={**device.factors, **factors}), label, factors


def predict(m: dict, device) -> dict:
    """The cost model at the measured rate: simulate() with the deployment's step times on
    tp x cpu processes (the cluster calibrate.py fits on), over the same requests (lengths and
    arrival times) the measured run served (planner/executor/loadgen.py draws them alike)."""
    from planner.serve import queue
    from planner.serve.cost import step_fns
    from planner.serve.spec import Deployment, Workload
    from planner.specs.model import ModelSpec
    model = ModelSpec.from_dict(m["model"])
    dep = Deployment(tp=m["deployment"]["tp"], max_batch=m["deployment"]["max_batch"])
    prefill, decode = step_fns(model, parse_cluster(f"{dep.tp}x{device.name}", device), dep)
    return queue.simulate(prefill, decode, Workload(**m["workload"]), m["rate_qps"], requests=m["requests_offered"],
                          seed=m["seed"], max_batch=dep.max_batch, max_total=model.max_seq)


def _pct(pred: float, meas: float) -> str:
    return f"{100 * (pred - meas) / meas:+.0f}%" if meas else "n/a"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="reports/serve_measure", help="directory for each run's serve_metrics.json")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"],
                   help="weights and activations (bf16: what the cost model assumes)")
    p.add_argument("--seed", type=int, default=0, help="arrival-time seed")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per rank (1: TP 1 and TP 2 ranks alike get one core; steadier when the "
                        "machine is shared)")
    args = p.parse_args(argv)
    out = Path(args.out)
    runs = measure(out, args.precision, args.seed, args.threads)
    device, label, factors = fitted_device(runs[0::2])
    print(f"\nprediction: {label}")
    print(f"{'deployment':24} {'set':5} {'TTFT ms meas/pred':>22} {'TPOT ms meas/pred':>22} {'QPS meas/pred':>20}")
    rows = []
    for i, m in enumerate(runs):
        d = m["deployment"]
        name = name_of(m["model"]["name"].rsplit("-", 1)[-1], d["tp"], d["max_batch"], m["rate_qps"])
        try:
            pr = predict(m, device)
            pred = (pr["ttft_s"]["mean"], pr["tpot_s"]["mean"], pr["achieved_qps"])
        except Exception as exc:  # the cost model is another helper's, still moving: report, keep measuring
            print(f"  (no prediction for {name}: {type(exc).__name__}: {exc})")
            pred = (float("nan"),) * 3
        meas = (m["ttft_s"]["mean"], m["tpot_s"]["mean"], m["achieved_qps"])
        split = "fit" if i % 2 == 0 else "test"
        print(f"{name:24} {split:5} {1e3 * meas[0]:9.1f} / {1e3 * pred[0]:7.1f} {_pct(pred[0], meas[0]):>5}"
              f"{1e3 * meas[1]:9.2f} / {1e3 * pred[1]:6.2f} {_pct(pred[1], meas[1]):>5}"
              f"{meas[2]:8.2f} / {pred[2]:6.2f} {_pct(pred[2], meas[2]):>5}")
        rows.append({"deployment": name, "set": split, "measured": dict(zip(("ttft_s", "tpot_s", "qps"), meas)),
                     "predicted": dict(zip(("ttft_s", "tpot_s", "qps"), pred))})
    for split in ("fit", "test"):
        errs = [abs(r["predicted"][k] - r["measured"][k]) / r["measured"][k] for r in rows if r["set"] == split
                for k in ("ttft_s", "tpot_s", "qps") if r["measured"][k]]
        print(f"{split}: mean |error| over TTFT, TPOT, QPS {100 * sum(errs) / max(1, len(errs)):.0f}%")
    atomic_write_json(out / "summary.json", {"prediction": label, "factors": factors, "precision": args.precision,
                                             "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
