"""Measured vs predicted step time and per-rank memory for a tiny GLM on 2 CPU processes.

Runs each plan with the executor (real DeepSpeed, gloo) and prints the cost model's
prediction (planner.cost.estimate with the built-in or --profile CPU profile) beside it.
Relative error = predicted / measured - 1 (planner.calibrate.accuracy). Run alone: it takes the 2 cores.

    flock /tmp/planner-cpu.lock .venv/bin/python benchmarks/executor_fidelity.py [--steps 8] [--profile P]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from planner import dsconfig  # noqa: E402
from planner.calibrate.accuracy import mape  # noqa: E402
from planner.cost import estimate  # noqa: E402
from planner.runtime.train.launch import run_plan  # noqa: E402
from planner.rundir import atomic_write_json, plan_document  # noqa: E402
from planner.specs import Plan, TrainSpec, load_profile, parse_cluster, preset, scale  # noqa: E402

PLANS = [
    dict(dp=2, zero=0, micro_batch=4, grad_accum=1, precision="fp32"),
    dict(dp=2, zero=1, micro_batch=2, grad_accum=2, precision="fp32"),
    dict(dp=2, zero=2, micro_batch=2, grad_accum=2, precision="bf16", bucket_elements=2_000_000),
    dict(dp=2, zero=3, micro_batch=2, grad_accum=2, precision="bf16", bucket_elements=2_000_000),
    dict(dp=2, zero=1, micro_batch=1, grad_accum=4, precision="bf16", recompute="full"),
    dict(dp=2, zero=0, micro_batch=4, grad_accum=1, precision="bf16", recompute="selective"),
    dict(pp=2, zero=1, micro_batch=2, grad_accum=4, precision="fp32", stage_layers=(2, 2)),
    dict(pp=2, zero=0, micro_batch=1, grad_accum=8, precision="bf16", stage_layers=(3, 1),
         recompute="full", recompute_layers=(2, 0)),
    dict(tp=2, zero=1, micro_batch=4, grad_accum=2, precision="bf16"),
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--profile", default=None)
    args = ap.parse_args()
    model = scale(preset("chatglm3-6b"), "tiny")
    prof = load_profile(args.profile) if args.profile else None
    cluster = parse_cluster("2xcpu", prof)
    rows, t0 = [], time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for i, kw in enumerate(PLANS):
            plan = Plan(**kw)
            train = TrainSpec(global_batch=plan.global_batch, seq_len=args.seq_len, precision=plan.precision)
            est = estimate(model, cluster, train, plan)
            d = Path(tmp) / f"p{i}"
            atomic_write_json(d / "plan.json", plan_document(plan, model, cluster, train, scale="tiny"))
            atomic_write_json(d / "ds_config.json", dsconfig.ds_config(plan, model, train, cluster))
            atomic_write_json(d / "estimate.json", {"plan": plan.to_dict(), "estimate": est.to_json()})
            m = run_plan(d, steps=args.steps, warmup=args.warmup, batching="static")
            rows.append((plan.describe(), m))
    print(f"tiny GLM ({model.name}, {model.params / 1e6:.2f}M params), seq {args.seq_len}, 2 CPU processes, "
          f"{args.steps} steps ({args.warmup} warm-up), profile {cluster.device.path or cluster.device.name}")
    print(f"{'plan':<92} {'step s':>7} {'pred':>7} {'err':>6}   {'mem GB':>6} {'pred':>6} {'err':>6}")
    terr, merr = [], []
    for desc, m in rows:
        p, e = m["predicted"], m["relative_error"]
        terr.append(e["step_time_s"])
        merr.append(e["peak_memory_gb"])
        print(f"{desc:<92} {m['step_time_s']:7.3f} {p['step_time_s']:7.3f} {e['step_time_s']:+6.0%}   "
              f"{m['peak_memory_gb']:6.3f} {p['peak_memory_gb']:6.3f} {e['peak_memory_gb']:+6.0%}")
    print(f"mean absolute error: step time {mape(terr):.0%}, peak memory {mape(merr):.0%} "
          f"over {len(rows)} plans ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
