"""How long the report takes for a large study (issue 5: "under a few seconds").

Builds a run directory for GLM-130B on 96x8xA100-40GB (global batch 4224, sequence 2048):
every outer point of the sample space priced by the real cost model in trials.csv (thousands
of rows) and an Optuna study.db (`--study-trials` is the trial budget; the study stops once
every shape was tried, a few hundred trials for GLM-130B: planner.report.sample), then times

  * write_report in this process (imports already paid), per phase, best and median of 3;
  * `planner report RUN_DIR` as a user runs it: a fresh process, imports included.

    python benchmarks/report_speed.py [--study-trials 2000] [--keep DIR] [--run-dir EXISTING]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--study-trials", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keep", type=Path, default=None, help="build the run directory here and keep it")
    ap.add_argument("--run-dir", type=Path, default=None, help="time an existing run directory instead")
    args = ap.parse_args()

    from planner.report import build, data
    from planner.report.sample import write_sample_run

    with tempfile.TemporaryDirectory() as tmp:
        run = args.run_dir
        if run is None:
            run = (args.keep or Path(tmp)) / "glm-130b_96x8xA100-40GB"
            t = time.perf_counter()
            write_sample_run(run, model="glm-130b", gpus="96x8xA100-40GB", global_batch=4224, seq_len=2048,
                             study_trials=args.study_trials, metrics=True, verify=True)
            print(f"built sample run directory in {time.perf_counter() - t:.1f} s (not timed below): {run}")
        loaded = data.load(run)
        rows = 0 if loaded.trials is None else len(loaded.trials)
        study = 0 if loaded.study is None else len(loaded.study.history)
        print(f"trials.csv rows: {rows}; Optuna study trials: {study}; "
              f"metrics.json: {'yes' if loaded.metrics else 'no'}")

        loads, renders, totals = [], [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            r = data.load(run)
            t1 = time.perf_counter()
            build.render(r, price_per_gpu_hour=2.0)
            t2 = time.perf_counter()
            build.write_report(run, price_per_gpu_hour=2.0)
            t3 = time.perf_counter()
            loads.append(t1 - t0)
            renders.append(t2 - t1)
            totals.append(t3 - t2)
        for name, xs in (("load run directory (trials.csv + study.db)", loads),
                         ("analysis + figures + template", renders), ("write_report total", totals)):
            print(f"{name:45s} best {min(xs):6.2f} s   median {statistics.median(xs):6.2f} s")

        cli = [str(Path(sys.executable).with_name("planner")), "report", str(run), "--price-per-gpu-hour", "2"]
        walls = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            subprocess.run(cli, check=True, capture_output=True)
            walls.append(time.perf_counter() - t)
        print(f"{'`planner report` fresh process (with imports)':45s} best {min(walls):6.2f} s   "
              f"median {statistics.median(walls):6.2f} s")
        size = (run / "report.html").stat().st_size
        print(f"report.html: {size / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
