"""GEMM throughput over the shapes a model's layers use, and the peak per precision.

The shapes are the per-TP-rank GEMMs of one transformer block and the output layer
(Megatron-LM column/row parallel split, Shoeybi et al. 2019, arXiv 1909.08053 sec. 3):
QKV [T, h] x [h, (q + 2 kv)/t], attention output [T, q/t] x [q/t, h], FFN up (fused with
the gate for GLU) [T, h] x [h, k f/t], FFN down [T, f/t] x [f/t, h], output layer [T, h] x [h, V/t],
with T = micro-batch x sequence tokens. A GEMM [M, K] x [K, N] does 2 M N K FLOPs.

Peak TFLOP/s per precision is the best GEMM measured in that precision (sweep plus square
probes); the efficiency curve is measured / peak, binned by log10(FLOPs).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable

from planner.profiler.device import Target
from planner.profiler.stats import Sample, time_call
from planner.specs.model import ModelSpec

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass(frozen=True, slots=True, kw_only=True)
class GemmShape:
    name: str
    """qkv, attn_out, ffn_up, ffn_gate, ffn_down, output or square."""
    m: int
    k: int
    n: int
    tp: int = 1
    tokens: int = 0

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n


def model_shapes(model: ModelSpec, tokens: int, tp: int) -> list[GemmShape]:
    """The distinct GEMMs of one TP rank for `tokens` rows."""
    h, q, kv, f = model.hidden, model.q_size, model.kv_size, model.ffn_hidden
    shapes = [GemmShape(name="qkv", m=tokens, k=h, n=(q + 2 * kv) // tp, tp=tp, tokens=tokens),
              GemmShape(name="attn_out", m=tokens, k=q // tp, n=h, tp=tp, tokens=tokens),
              # GLU: gate and up fused into one [h, 2f/t] GEMM, as ChatGLM2's dense_h_to_4h (and the executor)
              GemmShape(name="ffn_up" + ("+gate" if model.glu else ""), m=tokens, k=h,
                        n=model.ffn_in_matrices * f // tp, tp=tp, tokens=tokens),
              GemmShape(name="ffn_down", m=tokens, k=f // tp, n=h, tp=tp, tokens=tokens),
              GemmShape(name="output", m=tokens, k=h, n=-(-model.vocab // tp), tp=tp, tokens=tokens)]
    return shapes


def legal_tp(model: ModelSpec, max_tp: int) -> list[int]:
    """TP degrees (powers of two up to max_tp) that divide heads, KV groups and FFN size."""
    out, t = [], 1
    while t <= max_tp:
        if model.heads % t == 0 and model.kv_heads % t == 0 and model.ffn_hidden % t == 0:
            out.append(t)
        t *= 2
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class GemmResult:
    shape: GemmShape
    precision: str
    time: Sample

    @property
    def tflops(self) -> float:
        return self.shape.flops / self.time.median / 1e12

    def to_dict(self) -> dict:
        s = self.shape
        return {"name": s.name, "m": s.m, "k": s.k, "n": s.n, "tp": s.tp, "tokens": s.tokens,
                "precision": self.precision, "flops": s.flops, "tflops": self.tflops, "time_s": self.time.to_dict()}


def measure(shape: GemmShape, precision: str, target: Target, *, window_s: float) -> GemmResult:
    import torch
    dtype = getattr(torch, DTYPES[precision])
    a = torch.randn(shape.m, shape.k, device=target.device).to(dtype)
    b = torch.randn(shape.k, shape.n, device=target.device).to(dtype)
    t = time_call(lambda: torch.matmul(a, b), sync=target.sync, warmup=1, repeats=3, min_window_s=window_s)
    return GemmResult(shape=shape, precision=precision, time=t)


def square_probe(precision: str, target: Target, sizes: list[int], *, window_s: float, call_budget_s: float,
                 tick: Callable[[str], None] = lambda _: None) -> list[GemmResult]:
    """Square GEMMs of growing size; stops growing once one call exceeds `call_budget_s`
    (fp16 on a CPU without native support runs at a few GFLOP/s)."""
    out = []
    for n in sizes:
        r = measure(GemmShape(name="square", m=n, k=n, n=n), precision, target, window_s=window_s)
        out.append(r)
        tick(f"GEMM {precision} {n}^3")
        if r.time.median > call_budget_s:
            break
    return out


def peak_tflops(results: list[GemmResult]) -> dict[str, GemmResult]:
    """Best GEMM per precision."""
    best: dict[str, GemmResult] = {}
    for r in results:
        if r.precision not in best or r.tflops > best[r.precision].tflops:
            best[r.precision] = r
    return best


def efficiency_curve(results: list[GemmResult], peak: float, bins_per_decade: int = 2) -> list[list[float]]:
    """[[flops, efficiency]] sorted by flops: the median efficiency of the GEMMs in each
    1/bins_per_decade of a decade of FLOPs, placed at their geometric-mean FLOPs."""
    groups: dict[int, list[GemmResult]] = {}
    for r in results:
        groups.setdefault(math.floor(math.log10(r.shape.flops) * bins_per_decade), []).append(r)
    curve = []
    for key in sorted(groups):
        rs = groups[key]
        flops = math.exp(statistics.fmean(math.log(r.shape.flops) for r in rs))
        eff = statistics.median(r.tflops / peak for r in rs)
        curve.append([flops, min(1.0, max(eff, 1e-6))])
    return curve
