"""`planner search --model chatglm3-6b --scale tiny --gpus 2xcpu`, then `planner verify`.

Prints the measured throughput and memory ratios of the plan against the conventional
baseline (fp32, plain DP, ZeRO-0, padded static batches), with the predicted ratios.

    flock /tmp/planner-cpu.lock .venv/bin/python benchmarks/verify_tiny.py
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
PLANNER = [sys.executable, "-c", "from planner.cli import entry; entry()"]


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "tiny"
        search = subprocess.run(PLANNER + ["search", "--model", "chatglm3-6b", "--scale", "tiny", "--gpus", "2xcpu",
                                           "--out-dir", tmp, "--name", "tiny"], capture_output=True, text=True)
        if search.returncode:
            print(search.stdout[-2000:], search.stderr[-2000:])
            return 1
        print([ln for ln in search.stdout.splitlines() if ln.startswith("chosen")][:1] or search.stdout[-400:])
        v = subprocess.run(PLANNER + ["verify", str(run)], text=True)
        return v.returncode


if __name__ == "__main__":
    sys.exit(main())
