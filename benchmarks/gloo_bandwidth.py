"""Measured gloo all-reduce bus bandwidth between 2 processes vs the fitted alpha-beta model.

    flock /tmp/planner-cpu.lock .venv/bin/python benchmarks/gloo_bandwidth.py [--profile P] [--quick]

Without --profile it runs the sweep (1 KB .. 256 MB) now; with one it reads the profile's
measured sweep. busbw = algbw x 2(n-1)/n (nccl-tests).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from planner.profiler import comm


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--procs", type=int, default=2)
    args = ap.parse_args()
    if args.profile:
        groups = json.loads(Path(args.profile).read_text())["measured"]["comm"]["groups"]
        summary = groups[str(args.procs)]
        print(f"from {args.profile}")
    else:
        t0 = time.perf_counter()
        raw = comm.run_group(args.procs, comm.message_sizes(args.quick, "cpu"), backend="gloo", window_s=0.1)
        summary = comm.summarize_group(raw)
        print(f"measured now: gloo, {args.procs} processes, {time.perf_counter() - t0:.1f} s")
    for op in comm.OPS:
        s = summary[op]
        fit = s["fit"]
        print(f"\n{op} n={args.procs}: fit alpha {fit['alpha_us']:.0f} us, busbw {fit['busbw_gbps']:.3f} GB/s, "
              f"max error {100 * fit['max_rel_error']:.0f}%")
        print(f"{'bytes':>12} {'time us':>10} {'spread':>7} {'busbw GB/s':>11} {'fit busbw':>10} {'err %':>6}")
        factor = s["points"][0]["busbw_gbps"] / s["points"][0]["algbw_gbps"]
        for p in s["points"]:
            pred_bus = p["bytes"] / p["predicted_s"] / 1e9 * factor
            err = 100 * (p["predicted_s"] - p["time_s"]["median"]) / p["time_s"]["median"]
            print(f"{p['bytes']:>12} {1e6 * p['time_s']['median']:>10.1f} {p['time_s']['spread']:>7.2f} "
                  f"{p['busbw_gbps']:>11.3f} {pred_bus:>10.3f} {err:>6.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
