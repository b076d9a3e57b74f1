"""Timing with warm-up and a summary (median, spread, sample count) for every figure.

Measure after warm-up, then a timed window (nanoGPT bench.py: burn-in, then timing).
Every figure a profile records is a `Sample`: the median of n repeats with its spread,
so a reader can tell a stable number from a noisy one.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """A measured quantity: median of `n` repeats with min, max and relative spread."""

    median: float
    min: float
    max: float
    n: int
    unit: str

    @property
    def spread(self) -> float:
        """(max - min) / median: 0.05 means the repeats lie within 5% of each other."""
        return (self.max - self.min) / self.median if self.median else 0.0

    def to_dict(self) -> dict[str, float | int | str]:
        return {"median": self.median, "min": self.min, "max": self.max, "n": self.n,
                "spread": round(self.spread, 4), "unit": self.unit}


def summarize(values: list[float], unit: str) -> Sample:
    if not values:
        raise ValueError("no samples")
    return Sample(median=statistics.median(values), min=min(values), max=max(values), n=len(values), unit=unit)


def time_call(fn: Callable[[], object], *, sync: Callable[[], None] = lambda: None, warmup: int = 2,
              repeats: int = 5, min_window_s: float = 0.0, max_repeats: int = 1000) -> Sample:
    """Median wall time of `fn` in seconds after `warmup` calls.

    Takes at least `repeats` samples and keeps sampling until `min_window_s` has passed
    (short kernels need many repeats for a stable median), at most `max_repeats`.
    `sync` waits for the device (torch.cuda.synchronize on GPU).
    """
    for _ in range(warmup):
        fn()
    sync()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_repeats and (len(times) < repeats or time.perf_counter() - start < min_window_s):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return summarize(times, "s")
