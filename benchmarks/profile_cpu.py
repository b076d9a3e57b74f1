"""Profile this CPU with `planner profile --quick` and the full pass; print wall times and figures.

    flock /tmp/planner-cpu.lock .venv/bin/python benchmarks/profile_cpu.py [--out-dir reports/bench-profile]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default="reports/bench-profile")
    ap.add_argument("--skip-full", action="store_true")
    args = ap.parse_args()
    out = Path(args.out_dir)
    planner = str(Path(sys.executable).with_name("planner"))
    for label, flags in (("quick", ["--quick"]), ("full", [])):
        if label == "full" and args.skip_full:
            continue
        path = out / f"cpu-{label}.json"
        t0 = time.perf_counter()
        subprocess.run([planner, "profile", *flags, "--out", str(path)], check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        d = json.loads(path.read_text())
        m = d["measured"]
        ar = m["comm"]["groups"].get("2", {}).get("all_reduce", {}).get("fit", {})
        print(f"planner profile {' '.join(flags) or '(full)'}: wall {wall:.1f} s (measuring {m['wall_s']:.1f} s) -> {path}")
        print(f"  device {m['environment']['device']}, torch {m['environment']['torch']}, "
              f"deepspeed {m['environment']['deepspeed']}, {m['environment']['torch_threads']} threads")
        print("  peak TFLOP/s " + ", ".join(f"{p} {v:.4g}" for p, v in d["peak_tflops"].items())
              + f"; GEMMs measured {len(m['gemm']) + len(m['gemm_square'])}")
        print("  GEMM efficiency curve " + ", ".join(f"{f:.2g}:{e:.2f}" for f, e in d["gemm_efficiency"]))
        print(f"  copy bandwidth {d['hbm_bandwidth_gbps']:.1f} GB/s (spread {m['copy']['time_s']['spread']:.2f})")
        if ar:
            print(f"  gloo all-reduce n=2: busbw {ar['busbw_gbps']:.3f} GB/s, alpha {ar['alpha_us']:.0f} us, "
                  f"fit max error {100 * ar['max_rel_error']:.0f}%")
        for row in m["layers"]:
            cm = row["cost_model"]
            print(f"  block b={row['micro_batch']} s={row['seq']} tp={row['tp']}: fwd {1e3 * row['forward_s']['median']:.2f} ms "
                  f"bwd {1e3 * row['backward_s']['median']:.2f} ms recompute {1e3 * row['recompute_s']:.2f} ms "
                  f"(spread {row['forward_s']['spread']:.2f}); saved {row['saved_activation_bytes'] / 1e6:.3f} MB "
                  f"(cost model {cm.get('block_act_bytes', float('nan')) / 1e6:.3f}), checkpointed "
                  f"{row['saved_activation_bytes_checkpointed'] / 1e6:.3f} MB "
                  f"(cost model {cm.get('block_act_bytes_full_recompute', float('nan')) / 1e6:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
