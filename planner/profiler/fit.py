"""Alpha-beta fit of collective times, with nccl-tests bus-bandwidth conventions.

Model (Hockney; Thakur, Rabenseifner & Gropp 2005, "Optimization of collective
communication operations in MPICH"): t(S) = alpha + S / algbw, S the message size in
bytes as nccl-tests defines it (all-reduce: the buffer; all-gather: the gathered output;
reduce-scatter: the input; send/recv: the message). Bus bandwidth (nccl-tests
doc/PERFORMANCE.md): busbw = algbw x 2(n-1)/n for all-reduce, x (n-1)/n for all-gather and
reduce-scatter, x 1 for send/recv.

Fitted by the package's one line fit (planner/calibrate/solver.py line_relative: least squares
on relative error, so that the KB-sized messages (latency-bound) count as much as the 100 MB
ones (bandwidth-bound), alpha kept >= 0).
"""
from __future__ import annotations

from dataclasses import dataclass

OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for a collective over n ranks (nccl-tests PERFORMANCE.md)."""
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if op == "send_recv":
        return 1.0
    raise ValueError(f"unknown collective {op!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class AlphaBeta:
    op: str
    n: int
    alpha_s: float
    """Fixed latency per call, seconds."""
    beta_s_per_byte: float
    """Seconds per byte of message (1 / algbw)."""
    max_rel_error: float
    """Largest |predicted - measured| / measured over the fitted points."""
    points: int

    @property
    def algbw_gbps(self) -> float:
        return 1.0 / self.beta_s_per_byte / 1e9

    @property
    def busbw_gbps(self) -> float:
        return self.algbw_gbps * bus_factor(self.op, self.n)

    def predict(self, nbytes: float) -> float:
        return self.alpha_s + self.beta_s_per_byte * nbytes

    def to_dict(self) -> dict[str, float | int | str]:
        return {"op": self.op, "n": self.n, "alpha_us": self.alpha_s * 1e6, "algbw_gbps": self.algbw_gbps,
                "busbw_gbps": self.busbw_gbps, "max_rel_error": self.max_rel_error, "points": self.points}


def fit_alpha_beta(op: str, n: int, sizes: list[float], times: list[float]) -> AlphaBeta:
    """Least-squares alpha and beta from (bytes, seconds) pairs (line_relative: a negative
    alpha, or one message size only, refits beta alone with alpha 0); alpha >= 0, beta > 0."""
    import numpy as np

    from planner.calibrate.solver import line_relative

    if len(sizes) != len(times) or len(sizes) < 2:
        raise ValueError("need at least two (size, time) points")
    s = np.asarray(sizes, dtype=float)
    t = np.asarray(times, dtype=float)
    beta, alpha = line_relative(s, t)
    if beta <= 0:  # no bandwidth term resolved (all messages tiny): use the largest point
        i = int(np.argmax(s))
        beta = max(float(t[i] - alpha), 1e-12) / float(s[i])
    pred = alpha + beta * s
    return AlphaBeta(op=op, n=n, alpha_s=float(alpha), beta_s_per_byte=float(beta),
                     max_rel_error=float(np.max(np.abs(pred - t) / t)), points=len(sizes))
