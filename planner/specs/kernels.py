"""Measured kernel curves of a device profile: the "kernels" section of profiles/<gpu>.json.

What the cost model times compute from (planner/cost/compute.py, planner/cost/attention.py),
the same schema whether a built-in profile took the numbers from published measurements or
`planner profile` measured them on the machine (docs/profiler.md "Kernel curves"):

    "kernels": {
      "sms": 108,                                   # streaming multiprocessors (0: a CPU)
      "gemm_tiles": [[128, 256], [256, 128], [128, 128]],
      "gemm_ceiling": {"bf16": 0.75, "fp16": 0.75}, # fraction of the dense peak a full wave reaches
      "hbm_efficiency": 0.84,                       # achievable fraction of hbm_bandwidth_gbps
      "attention": {                                # throughput of one attention kernel family
        "fa2": [{"pass": "fwd_bwd", "head_dim": 128, "causal": true,
                 "seq": [512, 1024, ...], "tflops": [99, 133, ...]}, ...]
      }
    }

A GEMM [m, k] x [k, n] is cut into output tiles of one of `gemm_tiles` (the candidate the
library's heuristic picks: the one that fills its waves best); the tiles run in waves of `sms`
(one tile per SM at a time), each full wave at `gemm_ceiling` x the peak. Attention curves
follow the flash-attention benchmark convention (Dao 2023, benchmarks/benchmark_flash_attention.py):
forward FLOPs 4 b s^2 a d, halved under a causal mask; backward 2.5x forward (it recomputes
QK^T); "fwd_bwd" 3.5x. Every number's origin is in the profile's "sources" under
"kernels.<field>" (e.g. "kernels.attention.fa2"). Pure stdlib: loaded with the profile.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from planner.errors import ProfileError

PASSES = ("fwd", "bwd", "fwd_bwd")
PASS_FLOPS = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
"""FLOPs of each pass as a multiple of the forward's 4 b s^2 a d (/2 causal): the flash-attention
benchmark's convention, which the published TFLOP/s figures use."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionCurve:
    """Measured throughput of one attention kernel for one pass, head dim and mask, vs sequence."""

    kind: str
    """fwd, bwd or fwd_bwd (PASSES)."""
    head_dim: int
    causal: bool
    points: tuple[tuple[float, float], ...]
    """(sequence length, TFLOP/s) sorted by sequence; interpolated in log(seq), clamped at both ends."""

    def tflops(self, seq: float) -> float:
        return _interp_log(self.points, seq)


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelCurves:
    """A device's measured kernel curves (all optional: empty means "not measured")."""

    sms: int = 0
    """Streaming multiprocessors (GPU spec sheet or torch.cuda.get_device_properties); 0: no
    tile/wave model (a CPU, or a profile without it): GEMMs use the FLOPs-only gemm_efficiency curve."""
    gemm_tiles: tuple[tuple[int, int], ...] = ()
    """Candidate output tiles (rows, columns) of one thread block."""
    gemm_ceiling: Mapping[str, float] = field(default_factory=dict)
    """Per precision, the fraction of the dense peak one full wave of tiles reaches."""
    hbm_efficiency: float = 1.0
    """Achievable fraction of the datasheet memory bandwidth for streaming element-wise kernels."""
    attention: Mapping[str, tuple[AttentionCurve, ...]] = field(default_factory=dict)
    """Per kernel family (fa1, fa2, fa3, cudnn, sdpa), its measured curves."""

    @property
    def tiled(self) -> bool:
        return self.sms > 0 and bool(self.gemm_tiles)

    def attention_tflops(self, kernel: str, kind: str, head_dim: float, seq: float, causal: bool) -> float | None:
        """TFLOP/s of `kernel` for one pass at (head_dim, seq, causal), or None when the profile
        has no curve for that kernel. A pass without its own curve uses the kernel's fwd_bwd curve
        (the same throughput over the forward's and the backward's FLOPs); a mask without its own
        curve uses the other mask's; head dims between two measured ones are interpolated
        linearly, outside them clamped."""
        curves = self.attention.get(kernel)
        if not curves:
            return None
        mine = [c for c in curves if c.kind == kind] or [c for c in curves if c.kind == "fwd_bwd"]
        if not mine:
            return None
        masked = [c for c in mine if c.causal == causal] or mine
        dims = sorted({c.head_dim for c in masked})
        lo = max((d for d in dims if d <= head_dim), default=dims[0])
        hi = min((d for d in dims if d >= head_dim), default=dims[-1])

        def at(d: int) -> float:
            return next(c for c in masked if c.head_dim == d).tflops(seq)
        if lo == hi:
            return at(lo)
        w = (head_dim - lo) / (hi - lo)
        return at(lo) + w * (at(hi) - at(lo))


def _interp_log(points: tuple[tuple[float, float], ...], x: float) -> float:
    if x <= points[0][0]:
        return points[0][1]
    if x >= points[-1][0]:
        return points[-1][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + w * (y1 - y0)
    return points[-1][1]


def _num(v: Any, where: str, *, lo: float = 0.0, hi: float = math.inf, strict: bool = True) -> float:
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) \
        and (lo < v if strict else lo <= v) and v <= hi
    if not ok:
        raise ProfileError(where, f"must be a number in {'(' if strict else '['}{lo:g}, {hi:g}], got {v!r}",
                           "fix the profile (docs/profiler.md, 'Kernel curves')")
    return float(v)


def _curve(raw: Any, where: str) -> AttentionCurve:
    if not isinstance(raw, Mapping):
        raise ProfileError(where, "must be an object with pass, head_dim, causal, seq, tflops",
                           "see docs/profiler.md, 'Kernel curves'")
    kind = raw.get("pass")
    if kind not in PASSES:
        raise ProfileError(f"{where}.pass", f"must be one of {', '.join(PASSES)}, got {kind!r}", "fix the profile")
    d = int(_num(raw.get("head_dim"), f"{where}.head_dim"))
    causal = raw.get("causal")
    if not isinstance(causal, bool):
        raise ProfileError(f"{where}.causal", f"must be true or false, got {causal!r}", "fix the profile")
    seq, tf = raw.get("seq"), raw.get("tflops")
    if not isinstance(seq, list) or not isinstance(tf, list) or len(seq) != len(tf) or not seq:
        raise ProfileError(where, "needs seq and tflops lists of the same, non-zero length", "fix the profile")
    pts = tuple(sorted((_num(s, f"{where}.seq"), _num(t, f"{where}.tflops")) for s, t in zip(seq, tf)))
    return AttentionCurve(kind=kind, head_dim=d, causal=causal, points=pts)


def kernels_from_dict(raw: Any, precisions: tuple[str, ...]) -> KernelCurves:
    """Validate a profile's "kernels" object (absent: an empty KernelCurves)."""
    if raw is None:
        return KernelCurves()
    if not isinstance(raw, Mapping):
        raise ProfileError("kernels", "must be a JSON object", "see docs/profiler.md, 'Kernel curves'")
    known = {"sms", "gemm_tiles", "gemm_ceiling", "hbm_efficiency", "attention"}
    if set(raw) - known:
        raise ProfileError("kernels", f"unknown field(s) {sorted(set(raw) - known)}", f"use {', '.join(sorted(known))}")
    sms = int(_num(raw.get("sms", 0), "kernels.sms", strict=False, hi=1e6))
    tiles_raw = raw.get("gemm_tiles", [])
    if not isinstance(tiles_raw, list) or any(not isinstance(t, list) or len(t) != 2 for t in tiles_raw):
        raise ProfileError("kernels.gemm_tiles", "must be a list of [rows, columns] pairs", "e.g. [[128, 128]]")
    tiles = tuple((int(_num(a, "kernels.gemm_tiles")), int(_num(b, "kernels.gemm_tiles"))) for a, b in tiles_raw)
    ceil_raw = raw.get("gemm_ceiling", {})
    if not isinstance(ceil_raw, Mapping) or any(k not in precisions for k in ceil_raw):
        raise ProfileError("kernels.gemm_ceiling", f"must map precisions ({', '.join(precisions)}) to fractions",
                           "fix the profile")
    ceiling = {k: _num(v, f"kernels.gemm_ceiling.{k}", hi=1.0) for k, v in ceil_raw.items()}
    if sms and not tiles:
        raise ProfileError("kernels.gemm_tiles", "missing (sms is given)", "give the candidate tiles, e.g. [[128, 128]]")
    hbm = _num(raw.get("hbm_efficiency", 1.0), "kernels.hbm_efficiency", hi=1.0)
    att_raw = raw.get("attention", {})
    if not isinstance(att_raw, Mapping):
        raise ProfileError("kernels.attention", "must map kernel names to lists of curves", "fix the profile")
    att = {}
    for name, curves in att_raw.items():
        if not isinstance(curves, list) or not curves:
            raise ProfileError(f"kernels.attention.{name}", "must be a non-empty list of curves", "fix the profile")
        att[str(name)] = tuple(_curve(c, f"kernels.attention.{name}[{i}]") for i, c in enumerate(curves))
    return KernelCurves(sms=sms, gemm_tiles=tiles, gemm_ceiling=ceiling, hbm_efficiency=hbm, attention=att)
