"""Measured speed of the quantized weight kernels (profiles/serving/kernels.json).

A weight-only int4/int8 GEMM of `rows` tokens runs at its roofline (the quantized weight bytes
at the bandwidth, the FLOPs at the fp16 tensor rate: planner/serve/terms.py step_terms) divided
by the kernel's measured efficiency at that row count: Marlin's speedup over FP16 divided by
the ideal speedup (sources in the file): 1 up to 32 rows, 0.945 at 64-128 (its README's figure,
A10); 0.74 at 256 falling to 0.60-0.61 at 2048-4000 rows (Marlin's bench.py on an A100, vLLM
PR #2497: beyond 64 rows Marlin repeats its 64-row tile and stays at ~141 TFLOP/s while FP16
GEMMs run faster, so a 4-bit prefill is slower than a bf16 one), held beyond 4000. int8 uses
the int4 curve (no 8-bit curve published). fp8 (W8A8): vLLM's FP8-vs-BF16 GEMM benchmark on H100
(PR #49363), the FP8 speedup over BF16 divided by the ideal 2x: 0.88 at 1 row, 0.78 at 128,
held beyond; bf16: 1.
"""
from __future__ import annotations

import functools
import json
import math

from planner.specs.hardware import PROFILES_DIR

KERNELS_FILE = PROFILES_DIR / "serving" / "kernels.json"


CURVES = {"int4": ("int4", "speedup_over_fp16"), "int8": ("int4", "speedup_over_fp16"),
          "fp8": ("fp8", "speedup_over_bf16")}
"""weight precision -> (kernels.json entry, its measured speedup column): int8 takes the int4 curve."""


@functools.lru_cache(maxsize=4)
def _curve(entry: str = "int4", column: str = "speedup_over_fp16") -> tuple[tuple[float, ...], tuple[float, ...]]:
    data = json.loads(KERNELS_FILE.read_text())[entry]
    rows = tuple(float(r) for r in data["rows"])
    eff = tuple(min(1.0, s / i) for s, i in zip(data[column], data["ideal_speedup"]))
    return rows, eff


def kernel_efficiency(weight_precision: str, rows: int) -> float:
    """Share of its roofline speed a linear layer of `rows` tokens reaches at this weight
    precision: the Marlin curve for int4 and int8, the measured FP8 curve for fp8 (log-linear
    between the measured row counts, the end values outside them), 1 otherwise."""
    if weight_precision not in CURVES:
        return 1.0
    xs, ys = _curve(*CURVES[weight_precision])
    r = max(1.0, float(rows))
    if r <= xs[0]:
        return ys[0]
    if r >= xs[-1]:
        return ys[-1]
    k = next(i for i in range(1, len(xs)) if r <= xs[i])
    w = (math.log(r) - math.log(xs[k - 1])) / (math.log(xs[k]) - math.log(xs[k - 1]))
    return ys[k - 1] + w * (ys[k] - ys[k - 1])
