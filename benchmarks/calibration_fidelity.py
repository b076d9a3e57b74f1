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
import sys
import time
from pathlib import Path

from planner.calibrate import apply, calibrate
from planner.tune.bench import Setup, measured_run, profile_machine, round_robin, timed_steps
from planner.rundir import atomic_write_json
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
    out = Path(args.out_dir).resolve()  # run directories name the profile by its path
    out.mkdir(parents=True, exist_ok=True)
    profile_path = str(Path(args.profile).resolve()) if args.profile else profile_machine(out / "cpu-measured.json")
    device = load_profile(profile_path)
    setups = []
    for i, plan in enumerate(PLANS):
        s = Setup(name=f"plan {i}", model=MODEL, cluster=parse_cluster(f"{plan.world_size}xcpu", device),
                  train=TrainSpec(global_batch=GLOBAL_BATCH, seq_len=SEQ, precision=plan.precision), plan=plan,
                  run_dir=out / f"plan-{i:02d}", scale="tiny", model_arg="chatglm3-6b")
        s.write("calibration_fidelity")
        setups.append(s)
    measured = round_robin(setups, rounds=args.rounds, steps=args.steps, warmup=args.warmup,
                           echo=lambda line: print(line, flush=True))
    runs = []
    for s in setups:
        rounds = measured[s.name]
        if not rounds:
            continue
        if len(rounds) > 1:
            per = [statistics.median(timed_steps(m)) for m in rounds]
            print(f"{s.name}: step time over {len(per)} rounds: " + ", ".join(f"{x:.3f}" for x in per)
                  + f" (max/min {max(per) / min(per):.2f})")
        runs.append(measured_run(s, rounds))
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
