"""Training stability monitor: NaN/Inf, gradient-norm spikes, loss stalls.

Pure Python so its rules are unit-tested without a training run. NaN/Inf is an error the
worker acts on (snapshot + rollback); spikes and stalls are warnings recorded as events.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True, kw_only=True)
class MonitorSettings:
    spike_factor: float = 5.0
    """A gradient norm above spike_factor x the median of the window is a spike."""
    window: int = 20
    """Steps the spike median and the stall test look back over."""
    stall_tolerance: float = 0.01
    """Loss stalled: the window's mean improved by less than this fraction over the window before it."""


@dataclass(slots=True)
class StabilityMonitor:
    settings: MonitorSettings = field(default_factory=MonitorSettings)
    losses: list[float] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    stalled: bool = False

    @staticmethod
    def bad(loss: float, grad_norm: float | None) -> str | None:
        """The reason a step must be rolled back, or None."""
        if not math.isfinite(loss):
            return f"loss is {loss}"
        if grad_norm is not None and not math.isfinite(grad_norm):
            return f"gradient norm is {grad_norm}"
        return None

    def observe(self, step: int, loss: float, grad_norm: float | None) -> list[dict]:
        """Record a good step; return spike/stall events (dicts with step, kind, message)."""
        s, events = self.settings, []
        if grad_norm is not None:
            recent = self.norms[-s.window:]
            if len(recent) >= 3:
                med = statistics.median(recent)
                if med > 0 and grad_norm > s.spike_factor * med:
                    events.append({"step": step, "kind": "spike",
                                   "message": f"gradient norm {grad_norm:.3g} is {grad_norm / med:.1f}x "
                                              f"the median {med:.3g} of the last {len(recent)} steps"})
            self.norms.append(grad_norm)
        self.losses.append(loss)
        w = s.window
        if len(self.losses) >= 2 * w:
            before = statistics.fmean(self.losses[-2 * w:-w])
            now = statistics.fmean(self.losses[-w:])
            stalled = before - now < s.stall_tolerance * abs(before)
            if stalled and not self.stalled:
                events.append({"step": step, "kind": "stall",
                               "message": f"loss stalled: mean {now:.4f} over the last {w} steps vs "
                                          f"{before:.4f} before (< {s.stall_tolerance:.0%} better)"})
            self.stalled = stalled
        return events
