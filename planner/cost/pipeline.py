"""Pipeline schedule: bubble, in-flight micro-batches, and the step's critical path.

Narayanan et al. 2021 (arXiv 2104.04473), section 2.2: the 1F1B bubble fraction is (p-1)/m;
with v interleaved chunks per device it is (1/v)(p-1)/m. Korthikanti et al. 2022 (arXiv
2205.05198), section 4.2.3: under 1F1B the first stage holds p micro-batches in flight, and
interleaving multiplies its activation memory by (1 + (p-1)/(p m)).
"""
from __future__ import annotations


def bubble_fraction(p: int, m: int, v: int) -> float:
    """Idle fraction relative to the ideal m micro-batches of work."""
    return (p - 1) / (v * m)


def in_flight(p: int, m: int, v: int) -> tuple[float, ...]:
    """Micro-batches whose activations stage i holds at its peak under 1F1B: min(p - i, m);
    interleaving scales this by (1 + (p-1)/(p m)) (Korthikanti et al. 2022, eq. for 1F1B-int)."""
    scale = 1.0 + (p - 1) / (p * m) if v > 1 else 1.0
    return tuple(min(p - i, m) * scale for i in range(p))


def pipeline_time(stage_times: tuple[float, ...], m: int, v: int) -> tuple[float, float]:
    """(steady-state time, fill/drain bubble time) for m micro-batches.

    Each micro-batch takes T_i (forward + backward) on stage i; the slowest stage sets the
    steady-state rate (m x T_max); filling and draining the pipe costs the time of the other
    stages once, divided by v when interleaved. For equal stages this is the paper's
    (p-1)/m bubble: (p-1) T / (m T).
    """
    t_max = max(stage_times)
    return m * t_max, (sum(stage_times) - t_max) / v
