"""The chosen plan's pipeline schedule as a Gantt chart: warm-up, steady 1F1B, cool-down, bubble.

The schedule is PipeDream-Flush / 1F1B (Narayanan et al. 2021, arXiv 2104.04473, sec. 2.2.1):
stage i runs min(p-1-i, m) warm-up forwards, then alternates one forward and one backward,
then drains the remaining backwards. Each operation starts when its stage is free and its
input has arrived (forward j from stage i-1, backward j from stage i+1); the idle time this
leaves is the bubble, (p-1)/m of the ideal step for balanced stages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from planner.report.plots import render


@dataclass(frozen=True, slots=True)
class Op:
    stage: int
    kind: str
    """F (forward) or B (backward, recompute included)."""
    micro: int
    start: float
    end: float
    phase: str
    """warm-up, steady or cool-down (of its stage)."""


def stage_order(p: int, m: int, i: int) -> list[tuple[str, int, str]]:
    """The 1F1B order of (kind, micro-batch, phase) on stage i."""
    warm = min(p - 1 - i, m)
    out = [("F", j, "warm-up") for j in range(warm)]
    for j in range(m - warm):
        out.append(("F", warm + j, "steady"))
        out.append(("B", j, "steady"))
    out += [("B", j, "cool-down") for j in range(m - warm, m)]
    return out


def simulate(fwd: list[float], bwd: list[float], m: int) -> list[Op]:
    """Start and end of every operation of one step (no send/recv time: it is drawn apart)."""
    p = len(fwd)
    orders = [stage_order(p, m, i) for i in range(p)]
    pos = [0] * p
    free = [0.0] * p
    done: dict[tuple[str, int, int], float] = {}
    ops: list[Op] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for i in range(p):
            while pos[i] < len(orders[i]):
                kind, j, phase = orders[i][pos[i]]
                dep = ("F", i - 1, j) if kind == "F" and i > 0 else ("B", i + 1, j) if kind == "B" and i < p - 1 \
                    else ("F", i, j) if kind == "B" else None
                if dep is not None and dep not in done:
                    break
                start = max(free[i], done[dep] if dep is not None else 0.0)
                end = start + (fwd[i] if kind == "F" else bwd[i])
                done[(kind, i, j)] = end
                free[i] = end
                ops.append(Op(i, kind, j, start, end, phase))
                pos[i] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # cannot happen for a 1F1B order; guards against an endless loop
            raise RuntimeError("pipeline schedule deadlocked")
    return ops


def stage_times(estimate: dict[str, Any], layers_per_stage: tuple[int, ...], m: int) -> tuple[list[float], list[float], str]:
    """Per-micro-batch forward and backward seconds of each stage, and how they were obtained.

    Uses estimate["stage_time_s"] ([{"forward", "backward"}] per stage and micro-batch) when the
    cost model wrote it; otherwise the critical stage's compute from time_breakdown_s divided
    by m, scaled to each stage by its share of transformer blocks."""
    per_stage = estimate.get("stage_time_s")
    if isinstance(per_stage, list) and len(per_stage) == len(layers_per_stage) and all(
            isinstance(s, dict) and isinstance(s.get("forward"), (int, float)) for s in per_stage):
        return ([float(s["forward"]) for s in per_stage],
                [float(s.get("backward", 0.0)) + float(s.get("recompute", 0.0)) for s in per_stage],
                "per-stage times from estimate.json")
    t = estimate.get("time_breakdown_s") or {}
    f = float(t.get("forward", 0.0)) / m
    b = (float(t.get("backward", 0.0)) + float(t.get("recompute", 0.0))) / m
    top = max(layers_per_stage) or 1
    share = [n / top for n in layers_per_stage]
    return ([f * s for s in share], [b * s for s in share],
            "critical-stage compute per micro-batch, scaled to each stage by its block count")


def windows(ops: list[Op], m: int, cycle: float, end: float, detail: int = 16) -> list[tuple[float, float]]:
    """Time windows to draw: the whole step, or, when m > detail, the start (warm-up and two
    steady cycles) and the end (two steady cycles and cool-down) with the repeating middle cut."""
    s0 = [o for o in ops if o.stage == 0]
    if m <= detail or not s0:
        return [(0.0, end)]
    first_b = min(o.start for o in s0 if o.kind == "B")
    last_f = max(o.end for o in s0 if o.kind == "F")
    left, right = (0.0, first_b + 2 * cycle), (last_f - 2 * cycle, end)
    return [(0.0, end)] if right[0] <= left[1] else [left, right]


def gantt(estimate: dict[str, Any], layers_per_stage: tuple[int, ...], m: int, schedule: str) -> tuple[str, dict[str, Any]]:
    """The Gantt image and facts for the caption (simulated bubble fraction, source of times)."""
    fwd, bwd, source = stage_times(estimate, layers_per_stage, m)
    p = len(fwd)
    ops = simulate(fwd, bwd, m)
    end = max(o.end for o in ops) if ops else 0.0
    busy = [sum(o.end - o.start for o in ops if o.stage == i) for i in range(p)]
    idle = sum(end - b for b in busy) / (p * end) if end > 0 else 0.0
    cycle = max((f + b for f, b in zip(fwd, bwd)), default=0.0)
    wins = windows(ops, m, cycle, end) if end > 0 else [(0.0, 1.0)]
    colors = {("F", "warm-up"): "#9ecae1", ("F", "steady"): "#4c72b0", ("F", "cool-down"): "#4c72b0",
              ("B", "warm-up"): "#dd8452", ("B", "steady"): "#dd8452", ("B", "cool-down"): "#f2b98a"}
    s0 = [o for o in ops if o.stage == 0]
    phases = []
    if s0 and p > 1:
        first_b = min(o.start for o in s0 if o.kind == "B")
        last_f = max(o.end for o in s0 if o.kind == "F")
        phases = [(0.0, first_b, "warm-up"), (first_b, last_f, "steady 1F1B"), (last_f, end, "cool-down")]

    spans_by: dict[tuple[int, str, str], list[Op]] = {}
    for o in ops:
        spans_by.setdefault((o.stage, o.kind, o.phase), []).append(o)

    def draw(fig: Figure) -> None:
        axes = fig.subplots(1, len(wins), sharey=True, squeeze=False,
                            width_ratios=[hi - lo for lo, hi in wins])[0]
        for k, (ax, (lo, hi)) in enumerate(zip(axes, wins)):
            for i in range(p):
                ax.broken_barh([(0, end)], (i - 0.4, 0.8), facecolors="#f6d5d5", lw=0)   # idle = bubble
                for key, color in colors.items():
                    spans = [(o.start, o.end - o.start) for o in spans_by.get((i, *key), [])
                             if o.end > lo and o.start < hi]
                    if spans:
                        ax.broken_barh(spans, (i - 0.4, 0.8), facecolors=color, edgecolors="white", lw=0.3)
            for o in ops:
                if o.end > lo and o.start < hi and (o.end - o.start) > (hi - lo) / 45:
                    ax.text((max(o.start, lo) + min(o.end, hi)) / 2, o.stage, str(o.micro + 1), ha="center",
                            va="center", fontsize=6, color="white" if o.kind == "F" and o.phase != "warm-up" else "black",
                            clip_on=True)
            for x0, x1, text in phases:
                a, b = max(x0, lo), min(x1, hi)
                if b > a:
                    ax.annotate("", (a, -0.75), (b, -0.75), arrowprops={"arrowstyle": "<->", "color": "#555", "lw": 0.8})
                    ax.text((a + b) / 2, -0.85, text, ha="center", va="bottom", fontsize=8, color="#333")
            ax.set_xlim(lo, hi)
            ax.grid(axis="y", visible=False)
            if k > 0:
                ax.spines["left"].set_visible(False)
                ax.tick_params(axis="y", length=0)
                cut = sum(1 for o in ops if o.stage == 0 and o.kind == "F" and o.start >= wins[k - 1][1] and o.end <= lo)
                ax.text(0, 0.5, f"{cut} steady micro-batches not drawn", rotation=90, transform=ax.transAxes,
                        ha="center", va="center", fontsize=7, color="#333",
                        bbox={"fc": "white", "ec": "#999", "pad": 2, "lw": 0.5})
        axes[0].set_ylim(p - 0.5, -1.2)
        axes[0].set_yticks(range(p), [f"stage {i}" for i in range(p)])
        fig.supxlabel("seconds into the step (compute only; send/recv, DP sync and optimizer not drawn)", fontsize=9)
        handles = [Patch(color="#9ecae1", label="forward (warm-up)"), Patch(color="#4c72b0", label="forward"),
                   Patch(color="#dd8452", label="backward (+ recompute)"),
                   Patch(color="#f2b98a", label="backward (cool-down)"), Patch(color="#f6d5d5", label="idle: bubble")]
        axes[-1].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)

    height = max(2.6, 1.6 + 0.32 * p)
    facts = {"simulated_bubble": idle, "source": source, "stages": p, "micro_batches": m,
             "step_compute_s": end, "interleaved": schedule == "interleaved", "cut": len(wins) > 1}
    return render(draw, (10.5, min(height, 7.0))), facts


__all__ = ["Op", "gantt", "simulate", "stage_order", "stage_times", "windows"]
