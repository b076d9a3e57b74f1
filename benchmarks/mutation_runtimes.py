"""Targeted mutation check of issue 19's new terms: each mutant removes or halves one term,
and the tests that pin it must fail (benchmarks/mutation.py runs mutmut over all of
planner/cost; this is the quick, hand-listed check of the runtime and fp8 terms).

    flock /tmp/planner-cpu.lock .venv/bin/python benchmarks/mutation_runtimes.py   # ~2-4 min
    nice -n 19 .venv/bin/python benchmarks/mutation_runtimes.py --only capacity    # names containing a word

The golden mutants (tests/golden: benchmarks/fidelity.py's rows) take 1-3 min each.
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
DP_SYNC = ["tests/unit/test_megatron_dp_sync.py"]
KERNELS = ["tests/unit/test_kernel_curves.py"]
CAPACITY = ["tests/unit/test_device_capacity.py"]

MUTANTS = [
    # (name, file, original, mutated, tests)
    ("tp overlap removed", "planner/cost/block.py",
     "tp_fwd, tp_bwd = overlapped_tp(tp_fwd, tp_bwd, gemm_f, gemm_b)", "pass", TESTS),
    ("tp overlap window halved", "planner/cost/tp.py",
     "return max(tp_fwd - gemm_fwd, 0.0), max(tp_bwd - (2.0 * gemm_fwd if gemm_bwd is None else gemm_bwd), 0.0)",
     "return max(tp_fwd - 0.5 * gemm_fwd, 0.0), max(tp_bwd - 0.5 * (2.0 * gemm_fwd if gemm_bwd is None else gemm_bwd), 0.0)",
     TESTS),
    ("p2p overlap removed", "planner/cost/estimate.py",
     "pp_comm = m * v * max(max(p2p) - min(times) / v, 0.0)", "pass", TESTS),
    ("flash not forced", "planner/cost/block.py",
     'if kernel == "plan" or kernel == train.attention:', "if True:", TESTS),
    ("runtime factors ignored", "planner/cost/runtime.py", "    out.update(rt.factors)\n", "", TESTS),
    ("flat parameters removed", "planner/cost/estimate.py", "us = zero.flat_units(us)", "pass", TESTS),
    ("fp8 GEMMs at bf16", "planner/cost/block.py",
     "bc = compute.block_compute_times(model, dev, s, b, t, prec,",
     "bc = compute.block_compute_times(model, dev, s, b, t, compute.bf16_part(prec),", TESTS),
    ("fp8 core not bf16", "planner/cost/compute.py", 'return "bf16" if precision == "fp8" else precision',
     "return precision", TESTS),
    ("fp8 weight copies halved", "planner/cost/memory.py", "FP8_WEIGHT_BYTES = 2.0", "FP8_WEIGHT_BYTES = 1.0", TESTS),
    ("fp8 bytes dropped from the estimate", "planner/cost/stage.py",
     'params += memory.fp8_bytes(blocks, lc.block_psi, plan.zero == 3, memory.fp8_param_gather(plan))', "pass",
     TESTS),
    ("fp8 bytes dropped from the solver", "planner/search/checkpoint.py",
     "fp8 = memory.fp8_bytes(n, self.lc.block_psi, self.fp8[1], self.fp8[2]) if self.fp8[0] else 0.0", "fp8 = 0.0",
     TESTS),
    # Megatron-Bridge's fp8 recipes: weights in FP8 only (--fp8-param-gather), no bf16 copy
    ("fp8 param gather off", "profiles/runtimes/megatron-core.json", '"fp8_param_gather": true',
     '"fp8_param_gather": false', TESTS),
    ("fp8 param gather's bf16 copy halved", "planner/cost/memory.py", "BF16_WEIGHT_BYTES = 2.0",
     "BF16_WEIGHT_BYTES = 1.0", TESTS),
    ("fp8 param gather without the distributed optimizer", "planner/cost/memory.py",
     'return plan.precision == "fp8" and plan.zero == 1 and', 'return plan.precision == "fp8" and', TESTS),
    ("zero-3 fp8 copies not limited", "planner/cost/memory.py", "live = min(blocks, 2) if zero3 else blocks",
     "live = blocks", TESTS),
    ("deepspeed offers fp8", "planner/cost/runtime.py", "    if plan.precision not in rt.precisions:",
     "    if False:", TESTS),
    ("fp8 not searched", "planner/search/evaluate.py", 'and "fp8" in get_runtime(self.runtime).precisions else ())',
     "and False else ())", TESTS),
    ("megatron H100 trim halved", "profiles/runtimes/megatron-core.json", '"compute_scale": 1.326',
     '"compute_scale": 0.663', GOLDEN),
    # last session's terms (issue 19, round 3 session 4) and the driver's capacity
    ("megatron gradients reduced in 16 bits", "profiles/runtimes/megatron-core.json", '"grad_reduce_fp32": true',
     '"grad_reduce_fp32": false', DP_SYNC),
    ("megatron parameter gather exposed", "profiles/runtimes/megatron-core.json", '"param_gather_overlap": true',
     '"param_gather_overlap": false', DP_SYNC),
    ("fp32 reduce bytes halved", "planner/cost/estimate.py",
     'grad_bytes = 4.0 if rt.grad_reduce_fp32', 'grad_bytes = 2.0 if rt.grad_reduce_fp32', DP_SYNC),
    ("interleaving 1-8 only", "benchmarks/reference_rows.py",
     "return tuple(v for v in range(1, per + 1) if per % v == 0)",
     "return tuple(v for v in (1, 2, 3, 4, 6, 8) if per % v == 0)", GOLDEN),
    ("H100 fp8 MAMF ceiling halved", "profiles/H100-SXM.json", '"fp8": 0.66', '"fp8": 0.33', TESTS),
    ("B200 bf16 MAMF ceiling halved", "profiles/B200.json", '"bf16": 0.722', '"bf16": 0.361', KERNELS),
    ("H200 fp8 MAMF ceiling halved", "profiles/H200.json", '"fp8": 0.683', '"fp8": 0.3415', KERNELS),
    ("A100-80GB capacity halved", "profiles/A100-80GB.json", '"memory_total_mib": 81039,',
     '"memory_total_mib": 40519,', CAPACITY),
    ("driver's capacity ignored", "planner/specs/hardware.py",
     "return self.memory_total_mib * 2.0 ** 20 if self.memory_total_mib else self.memory_gb * 1e9",
     "return self.memory_gb * 1e9", CAPACITY),
    ("driver's capacity ignored (reference runs)", "planner/specs/hardware.py",
     "return self.memory_total_mib * 2.0 ** 20 if self.memory_total_mib else self.memory_gb * 1e9",
     "return self.memory_gb * 1e9", GOLDEN),
]


CONTROL = ("control (no mutation)", "planner/cost/runtime.py", "DEFAULT = NAMES[0]", "DEFAULT = NAMES[0]", TESTS)
"""Run first: the unmutated copy must pass, or every "killed" below would mean nothing."""


def main() -> int:
    only = sys.argv[sys.argv.index("--only") + 1].lower() if "--only" in sys.argv else ""
    mutants = [m for m in MUTANTS if only in m[0].lower()]
    survived = []
    for name, rel, old, new, tests in [CONTROL, *mutants]:
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
    print(f"{len(mutants) - len(survived)} of {len(mutants)} mutants killed" +
          (f"; survived: {', '.join(survived)}" if survived else ""))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
