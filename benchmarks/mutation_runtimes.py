"""Targeted mutation check of issue 19's new terms: each mutant removes or halves one term,
and the tests that pin it must fail (benchmarks/mutation.py runs mutmut over all of
planner/cost; this is the quick, hand-listed check of the runtime and fp8 terms).

    flock /tmp/planner-cpu.lock .venv/bin/python benchmarks/mutation_runtimes.py   # ~2-4 min
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ["tests/unit/test_runtimes.py", "tests/unit/test_fp8.py"]
GOLDEN = ["tests/golden/test_fidelity_golden.py"]

MUTANTS = [
    # (name, file, original, mutated, tests)
    ("tp overlap removed", "planner/cost/block.py",
     "tp_fwd, tp_bwd = overlapped_tp(tp_fwd, tp_bwd, gemm_f)", "pass", TESTS),
    ("tp overlap window halved", "planner/cost/tp.py",
     "return max(tp_fwd - gemm_fwd, 0.0), max(tp_bwd - 2.0 * gemm_fwd, 0.0)",
     "return max(tp_fwd - 0.5 * gemm_fwd, 0.0), max(tp_bwd - 1.0 * gemm_fwd, 0.0)", TESTS),
    ("p2p overlap removed", "planner/cost/estimate.py",
     "pp_comm = m * v * max(max(p2p) - min(times) / v, 0.0)", "pass", TESTS),
    ("flash not forced", "planner/cost/block.py",
     'if kernel == "plan" or kernel == train.attention:', "if True:", TESTS),
    ("runtime factors ignored", "planner/cost/runtime.py", "    out.update(rt.factors)\n", "", TESTS),
    ("flat parameters removed", "planner/cost/estimate.py", "us = zero.flat_units(us)", "pass", TESTS),
    ("fp8 GEMMs at bf16", "planner/cost/block.py",
     "gemm_f, core_f = compute.block_compute_times(model, dev, s, b, t, prec,",
     "gemm_f, core_f = compute.block_compute_times(model, dev, s, b, t, compute.bf16_part(prec),", TESTS),
    ("fp8 core not bf16", "planner/cost/compute.py", 'return "bf16" if precision == "fp8" else precision',
     "return precision", TESTS),
    ("fp8 weight copies halved", "planner/cost/memory.py", "FP8_WEIGHT_BYTES = 2.0", "FP8_WEIGHT_BYTES = 1.0", TESTS),
    ("fp8 bytes dropped from the estimate", "planner/cost/stage.py",
     'params += memory.fp8_bytes(blocks, lc.block_psi, plan.zero == 3)', "pass", TESTS),
    ("fp8 bytes dropped from the solver", "planner/search/checkpoint.py",
     "fp8 = memory.fp8_bytes(n, self.lc.block_psi, self.fp8[1]) if self.fp8[0] else 0.0", "fp8 = 0.0", TESTS),
    ("zero-3 fp8 copies not limited", "planner/cost/memory.py", "live = min(blocks, 2) if zero3 else blocks",
     "live = blocks", TESTS),
    ("deepspeed offers fp8", "planner/cost/runtime.py", "    if plan.precision not in rt.precisions:",
     "    if False:", TESTS),
    ("fp8 not searched", "planner/search/evaluate.py", 'and "fp8" in get_runtime(self.runtime).precisions else ())',
     "and False else ())", TESTS),
    ("megatron compute_scale halved", "profiles/runtimes/megatron-core.json", '"compute_scale": 1.346',
     '"compute_scale": 0.673', TESTS),
]


CONTROL = ("control (no mutation)", "planner/cost/runtime.py", "DEFAULT = NAMES[0]", "DEFAULT = NAMES[0]", TESTS)
"""Run first: the unmutated copy must pass, or every "killed" below would mean nothing."""


def main() -> int:
    survived = []
    for name, rel, old, new, tests in [CONTROL, *MUTANTS]:
        with tempfile.TemporaryDirectory(prefix="i19-mut-") as d:
            work = Path(d)
            for part in ("planner", "profiles", "tests", "benchmarks"):
                shutil.copytree(ROOT / part, work / part, ignore=shutil.ignore_patterns("__pycache__"))
            f = work / rel
            text = f.read_text()
            if text.count(old) != 1:
                print(f"STALE  {name}: {rel} does not hold the original once")
                survived.append(name)
                continue
            f.write_text(text.replace(old, new))
            r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                               cwd=work, capture_output=True, text=True, env={"PYTHONPATH": str(work), "PATH": ""})
            killed = r.returncode != 0
            if (name, rel) == CONTROL[:2]:
                if killed:
                    print(f"the unmutated copy fails its tests:\n{r.stdout[-2000:]}")
                    return 2
                print("control passes")
                continue
            print(f"{'killed ' if killed else 'SURVIVED'} {name}")
            if not killed:
                survived.append(name)
    print(f"{len(MUTANTS) - len(survived)} of {len(MUTANTS)} mutants killed" +
          (f"; survived: {', '.join(survived)}" if survived else ""))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
