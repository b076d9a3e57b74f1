"""Predicted vs measured step time and memory for tiny-GLM plans run by the executor, before and
after calibration (issue 4, "Numbers to report").

    flock /tmp/planner-cpu.lock .venv/bin/python benchmarks/calibration_fidelity.py \
        [--profile PROFILE.JSON] [--steps 12] [--warmup 4] [--rounds 2] [--out-dir reports/bench-calibration]

Without --profile it first measures this machine with `planner profile --quick`. Every plan
runs for real (DeepSpeed on CPU, gloo, 2 or 4 processes), --rounds times in round-robin order;
its step time is the median over rounds of each run's median step after warm-up. "before" is the measured profile with
default factors, "after" the calibrated profile on the runs it was fitted to, "held out" each
run predicted by a fit that did not see it (leave-one-out): the honest figure.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from planner.calibrate import apply, calibrate
from planner.calibrate.runs import MeasuredRun
from planner.cost import estimate
from planner.errors import PlannerError
from planner.rundir import atomic_write_json, plan_document
from planner.specs import Plan, TrainSpec, load_profile, parse_cluster, preset, scale

MODEL = scale(preset("chatglm3-6b"), "tiny")
GLOBAL_BATCH, SEQ = 8, 128
PLANS = [
    Plan(dp=2, zero=0, micro_batch=4, grad_accum=1),
    Plan(dp=2, zero=1, micro_batch=2, grad_accum=2),
    Plan(dp=2, zero=2, micro_batch=1, grad_accum=4),
    Plan(dp=2, zero=3, micro_batch=4, grad_accum=1),
    Plan(dp=2, zero=1, micro_batch=4, grad_accum=1, recompute="full"),
    Plan(dp=2, zero=0, micro_batch=4, grad_accum=1, precision="fp32"),
    Plan(pp=2, zero=1, micro_batch=2, grad_accum=4),
    Plan(pp=2, zero=0, micro_batch=1, grad_accum=8),
    Plan(tp=2, zero=0, micro_batch=4, grad_accum=2),
    Plan(dp=2, pp=2, zero=1, micro_batch=2, grad_accum=2),
    Plan(dp=2, tp=2, zero=1, micro_batch=2, grad_accum=2),
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default=None)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--out-dir", default="reports/bench-calibration")
    ap.add_argument("--rounds", type=int, default=2, help="runs of every plan, round-robin; the median is used")
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    profile_path = args.profile
    if profile_path is None:
        profile_path = str(out / "cpu-measured.json")
        t0 = time.perf_counter()
        subprocess.run([str(Path(sys.executable).with_name("planner")), "profile", "--quick", "--out", profile_path],
                       check=True)
        print(f"profiled this machine (--quick) in {time.perf_counter() - t0:.1f} s -> {profile_path}")
    device = load_profile(profile_path)
    from planner.executor.launch import run_plan
    setups = []
    for i, plan in enumerate(PLANS):
        cluster = parse_cluster(f"{plan.world_size}xcpu", device)
        train = TrainSpec(global_batch=GLOBAL_BATCH, seq_len=SEQ, precision=plan.precision)
        d = out / f"plan-{i:02d}"
        est = estimate(MODEL, cluster, train, plan)
        atomic_write_json(d / "plan.json", plan_document(plan, MODEL, cluster, train, scale="tiny",
                                                         model_arg="chatglm3-6b", command="calibration_fidelity"))
        atomic_write_json(d / "estimate.json", {"plan": plan.to_dict(), "estimate": est.to_json()})
        setups.append((i, plan, cluster, train, d))
    steps: dict[int, list[float]] = {i: [] for i, *_ in setups}
    mems: dict[int, list[float]] = {i: [] for i, *_ in setups}
    for rnd in range(args.rounds):  # round-robin, so slow drift of the machine's load hits every plan alike
        for i, plan, cluster, train, d in setups:
            t0 = time.perf_counter()
            try:
                m = run_plan(d, steps=args.steps, warmup=args.warmup)
            except PlannerError as exc:
                print(f"round {rnd} plan {i}: {plan.describe()}: FAILED {exc.line()}")
                continue
            timed = m["step_times_s"][m["warmup"]:]
            steps[i].append(statistics.median(timed))
            mems[i].append(m["peak_memory_gb"])
            (d / f"metrics-round{rnd}.json").write_text(json.dumps(m))
            print(f"round {rnd} plan {i}: {plan.describe()}: median {steps[i][-1]:.3f} s/step "
                  f"(min {min(timed):.3f}, max {max(timed):.3f}), {m['peak_memory_gb']:.3f} GB "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    runs: list[MeasuredRun] = []
    for i, plan, cluster, train, d in setups:
        if not steps[i]:
            continue
        if len(steps[i]) > 1:
            print(f"plan {i}: step time over {len(steps[i])} rounds: "
                  + ", ".join(f"{x:.3f}" for x in steps[i])
                  + f" (max/min {max(steps[i]) / min(steps[i]):.2f})")
        runs.append(MeasuredRun(path=str(d), model=MODEL, cluster=cluster, train=train, plan=plan,
                                step_time_s=statistics.median(steps[i]), peak_memory_gb=statistics.median(mems[i])))
    t0 = time.perf_counter()
    cal = calibrate(device, runs)
    fit_s = time.perf_counter() - t0
    atomic_write_json(out / "cpu-calibrated.json", apply(json.loads(Path(profile_path).read_text()), cal))
    atomic_write_json(out / "calibration.json", cal.to_dict())
    print()
    print(f"{'plan':<78} {'step s':>7} {'before':>7} {'after':>7} {'held':>7} | {'mem GB':>6} {'before':>6} "
          f"{'after':>6} {'held':>6}")
    for r in cal.rows:
        t, m = r["step_time_s"], r["peak_memory_gb"]
        print(f"{r['plan']:<78} {t['measured']:7.3f} {t['before']:7.3f} {t['after']:7.3f} {t['held_out']:7.3f} | "
              f"{m['measured']:6.3f} {m['before']:6.3f} {m['after']:6.3f} {m['held_out']:6.3f}")
    s = cal.summary
    print()
    for key, label, target in (("step_time_mape_pct", "step time", 15), ("memory_mape_pct", "memory", 10)):
        v = s[key]
        print(f"{label:9} MAPE: before {v['before']:6.1f}%   after (in-sample) {v['after']:5.1f}%   "
              f"held out (leave-one-out) {v['held_out']:5.1f}%   target <= {target}%")
    if s["layer_points"]:
        v = s["layer_time_mape_pct"]
        print(f"block time MAPE over {s['layer_points']} profiler points: before {v['before']:.1f}%, after {v['after']:.1f}%")
    print("fitted factors: " + ", ".join(f"{k}={v:.4g}" for k, v in cal.factors.items()))
    print(f"ridge weight (LOO): time {s['lambda']['time']}, memory {s['lambda']['memory']}; fit + LOO {fit_s:.1f} s; "
          f"{len(runs)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
