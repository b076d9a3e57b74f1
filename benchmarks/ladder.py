"""The measured optimisation ladder of a small CPU model (issue 12).

`planner search --model chatglm3-6b --scale tiny --gpus 2xcpu`, then `planner ladder --measure`:
every rung from the conventional baseline (fp32, plain DP, ZeRO-0, padded static batches) to the
chosen plan is run with the executor on the same document stream and printed beside the
prediction, with the article's figure per technique. About 30 s on 2 cores.

    flock /tmp/planner-cpu.lock .venv/bin/python benchmarks/ladder.py [--steps N] [--scale tiny|small] [--profile P]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
PLANNER = [sys.executable, "-c", "from planner.cli import entry; entry()"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--scale", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--profile", default=None,
                    help="a measured profile with the step probes (e.g. benchmarks/agreement.py's cpu-calibrated.json); "
                         "default the built-in cpu profile")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "ladder"
        search = subprocess.run(PLANNER + ["search", "--model", "chatglm3-6b", "--scale", args.scale, "--gpus", "2xcpu",
                                           "--out-dir", tmp, "--name", "ladder",
                                           *(["--profile", str(Path(args.profile).resolve())] if args.profile else [])],
                                capture_output=True, text=True)
        if search.returncode:
            print(search.stdout[-2000:], search.stderr[-2000:])
            return 1
        print(next((ln for ln in search.stdout.splitlines() if ln.startswith("chosen")), search.stdout[-400:]))
        lad = subprocess.run(PLANNER + ["ladder", str(run), "--measure", "--each-alone", "--steps", str(args.steps)],
                             text=True)
        return lad.returncode


if __name__ == "__main__":
    sys.exit(main())
