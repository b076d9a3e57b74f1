"""`planner verify` where memory means something (issue 8, point 8): chatglm3-6b `--scale small`
(33M parameters: model states, not the Python process, dominate a rank's memory) on this CPU.

    flock /tmp/planner-cpu.lock .venv/bin/python benchmarks/verify_small.py [--profile P] [--gpus 2xcpu]

1. `planner search --model chatglm3-6b --scale small --gpus 2xcpu --profile P` (P: the
   calibrated profile benchmarks/agreement.py wrote, reports/bench-agreement/cpu-calibrated.json,
   when it exists, else the built-in cpu profile; its factors were fitted on other runs, so
   these two runs are held out);
2. `planner verify` of that run directory: the conventional baseline (fp32, plain DP, ZeRO-0,
   padded static batches) and the plan (packed batches), back to back;
3. prints the measured and predicted throughput and peak-memory ratios, the prediction's
   error against the measurement (target: within 15%), the same predictions from the
   built-in, uncalibrated cpu profile, and whether 3x throughput and one-third less memory
   are met on this CPU, with the measured parts that say why.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
ROOT = Path(__file__).resolve().parents[1]
PLANNER = [sys.executable, "-c", "from planner.cli import entry; entry()"]
CALIBRATED = ROOT / "reports" / "bench-agreement" / "cpu-calibrated.json"
TARGET_ERR = 15.0


def _planner(args: list[str], echo: bool = False) -> str:
    p = subprocess.run(PLANNER + args, capture_output=not echo, text=True)
    if p.returncode:
        raise SystemExit(f"planner {' '.join(args)} failed ({p.returncode}): {(p.stderr or '')[-800:]}")
    return p.stdout or ""


def predicted_ratios(run: Path, profile: str | None) -> dict[str, float]:
    """The cost model's figures for the two plans verify ran, under `profile` (None: the
    built-in one); `tokens_ratio` counts every token (verify scales it by each run's
    real-token fraction)."""
    from planner.cost import estimate
    from planner.rundir import load_run
    from planner.search.baseline import conventional_baseline
    from planner.specs import load_profile, parse_cluster
    plan, model, cluster, train, _ = load_run(run)
    cluster = parse_cluster(f"{cluster.world_size}xcpu", load_profile(profile) if profile else None)
    bplan, best = conventional_baseline(model, cluster, train, precision="fp32")
    pest = estimate(model, cluster, train, plan)
    ran = json.loads((run / "verify.json").read_text())["baseline"]["plan"]
    if (bplan.micro_batch, bplan.grad_accum, bplan.dp) != (ran["micro_batch"], ran["grad_accum"], ran["dp"]):
        print(f"note: under {profile or 'the built-in profile'} the baseline would be {bplan.describe()}")
    return {"tokens_ratio": pest.tokens_per_s / best.tokens_per_s,
            "memory_ratio": pest.allocated_peak_bytes / best.allocated_peak_bytes,
            "rss_ratio": pest.peak_memory_gb / best.peak_memory_gb,
            "baseline_step_s": best.step_time_s, "planned_step_s": pest.step_time_s,
            "baseline_gb": best.peak_memory_gb, "planned_gb": pest.peak_memory_gb}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=str(CALIBRATED) if CALIBRATED.exists() else None)
    ap.add_argument("--gpus", default="2xcpu")
    ap.add_argument("--scale", default="small")
    ap.add_argument("--keep", type=Path, default=None, help="keep the run directory here")
    args = ap.parse_args()
    t0 = time.perf_counter()
    profile = str(Path(args.profile).resolve()) if args.profile else None
    print(f"profile: {profile or 'built-in cpu (uncalibrated: run benchmarks/agreement.py first)'}")
    with tempfile.TemporaryDirectory() as tmp:
        parent = args.keep or Path(tmp)
        name = f"verify-{args.scale}"
        search = ["search", "--model", "chatglm3-6b", "--scale", args.scale, "--gpus", args.gpus,
                  "--out-dir", str(parent), "--name", name] + (["--profile", profile] if profile else [])
        out = _planner(search)
        print("\n".join(ln for ln in out.splitlines() if ln.startswith(("chosen", "baseline"))) or out[-600:])
        run = parent / name
        _planner(["verify", str(run)], echo=True)
        v = json.loads((run / "verify.json").read_text())
        m, p = v["measured"], v["predicted"]
        builtin = predicted_ratios(run, None)
        cal = predicted_ratios(run, profile) if profile else builtin
        padding = p["throughput_ratio"] / cal["tokens_ratio"]  # verify's real-token correction
        builtin["throughput_ratio"] = builtin["tokens_ratio"] * padding

        from planner.calibrate.accuracy import rel_error

        def err(pred: float, meas: float) -> float:
            return 100.0 * rel_error(pred, meas)

        b, pl = v["baseline"], v["planned"]
        print()
        print(f"{'ratio (plan / baseline)':<26} {'measured':>9} {'predicted':>10} {'error':>8}   "
              f"{'built-in profile':>16} {'error':>8}")
        for key, label in (("throughput_ratio", "throughput (real tokens/s)"),
                           ("memory_ratio", "peak allocated (judged)"), ("rss_ratio", "peak RSS (shown)")):
            if m.get(key) is None or p.get(key) is None:
                print(f"{label:<26} not measured")
                continue
            e = err(p[key], m[key])
            print(f"{label:<26} {m[key]:>8.2f}x {p[key]:>9.2f}x {e:>+7.1f}%   {builtin[key]:>15.2f}x "
                  f"{err(builtin[key], m[key]):>+7.1f}%   {'pass' if abs(e) <= TARGET_ERR else 'FAIL'} "
                  f"(target {TARGET_ERR:.0f}%)")
        for cls, r in (m.get("model_states_by_class") or {}).items():
            pr = (p.get("model_states_by_class") or {}).get(cls)
            print(f"{'model states: ' + cls:<26} {r:>8.2f}x " + (f"{pr:>9.2f}x {err(pr, r):>+7.1f}%" if pr else ""))
        print()
        print(f"baseline: {b['plan']['dp']} ranks fp32 ZeRO-0, micro-batch {b['plan']['micro_batch']} x "
              f"{b['plan']['grad_accum']}: {b['step_time_s']:.3f} s/step (predicted {cal['baseline_step_s']:.3f}), "
              f"{b['tokens_per_s']:.0f} real tokens/s, padding {b['padding_fraction']:.0%}, allocated peak "
              f"{b['allocated_peak_gb']:.3f} GB/rank (predicted {b['predicted']['allocated_peak_gb']:.3f}), peak RSS "
              f"{b['peak_memory_gb']:.3f} GB/rank (predicted {cal['baseline_gb']:.3f}), model states "
              f"{max(b['model_state_gb_per_rank']):.3f} GB")
        pp = pl["plan"]
        print(f"planned:  TP {pp['tp']} x PP {pp['pp']} x DP {pp['dp']} ZeRO-{pp['zero']} {pp['precision']}, "
              f"micro-batch {pp['micro_batch']} x {pp['grad_accum']}, {pp['recompute']} recompute: "
              f"{pl['step_time_s']:.3f} s/step (predicted {cal['planned_step_s']:.3f}), {pl['tokens_per_s']:.0f} real "
              f"tokens/s, padding {pl['padding_fraction']:.0%}, allocated peak {pl['allocated_peak_gb']:.3f} GB/rank "
              f"(predicted {pl['predicted']['allocated_peak_gb']:.3f}), peak RSS {pl['peak_memory_gb']:.3f} GB/rank "
              f"(predicted {cal['planned_gb']:.3f}), model states {max(pl['model_state_gb_per_rank']):.3f} GB")
        tr, mr = m["throughput_ratio"], m["memory_ratio"]
        pad_gain = (1 - pl["padding_fraction"]) / (1 - b["padding_fraction"])
        print()
        print(f"3x throughput on this CPU: {'MET' if tr >= 3 else 'NOT MET'} ({tr:.2f}x measured; packing alone "
              f"gives {pad_gain:.2f}x more real tokens per token computed, the rest {tr / pad_gain:.2f}x is "
              f"per-token speed: bf16 vs fp32 kernels on this CPU and the plan's micro-batch)")
        state_share = max(b["model_state_gb_per_rank"]) / b["peak_memory_gb"]
        rr = m.get("rss_ratio")
        print(f"one-third less memory on this CPU, judged on allocated bytes (what a GPU counts): "
              f"{'MET' if 1 - mr >= 1 / 3 else 'NOT MET'} ({1 - mr:+.0%} measured); peak RSS "
              + (f"{'MET' if 1 - rr >= 1 / 3 else 'NOT MET'} ({1 - rr:+.0%}; model states are {state_share:.0%} "
                 f"of the baseline's RSS peak, the Python/torch process does not shrink)" if rr else "not measured"))
        print(f"total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
