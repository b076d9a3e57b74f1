"""Matplotlib figures as PNG data URIs (Agg, no pyplot state): the page embeds them inline.

User-supplied text never goes into a figure: titles and labels are built from numbers and
fixed words, so a model name cannot break mathtext or the page.
"""
from __future__ import annotations

import base64
import io
import textwrap
import math
from typing import Any, Callable

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from planner.report.analysis import MEM_LABELS, MEM_PARTS, TIME_LABELS, TIME_PARTS, pareto_mask, reason_category

matplotlib.use("Agg")
DPI = 110
STYLE = {"font.size": 9, "axes.titlesize": 10, "axes.labelsize": 9, "legend.fontsize": 8,
         "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.3,
         "figure.dpi": DPI, "savefig.dpi": DPI}
MEM_COLORS = dict(zip(MEM_PARTS, ["#4c72b0", "#55a868", "#c44e52", "#dd8452", "#8172b3", "#937860", "#b0b0b0"]))
TIME_COLORS = dict(zip(TIME_PARTS, ["#4c72b0", "#6b8fd4", "#8172b3", "#dd8452", "#da8bc3", "#e6b800", "#c44e52",
                                    "#55a868", "#2a9d8f", "#937860", "#b0b0b0"]))
REASON_MARKERS = ["x", "+", "1", "v", "^", "s"]
REASON_COLORS = ["#c44e52", "#dd8452", "#8172b3", "#937860", "#da8bc3", "#8c8c8c"]


def render(draw: Callable[[Figure], None], size: tuple[float, float]) -> str:
    """Draw into a new figure and return it as a data:image/png;base64 URI."""
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=size, layout="constrained")
        draw(fig)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=DPI)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _kilo(ax: Any) -> None:
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(
        lambda v, _: f"{v / 1e6:g}M" if abs(v) >= 1e6 else (f"{v / 1e3:g}k" if abs(v) >= 1e3 else f"{v:g}")))


def frontier(trials: pd.DataFrame, chosen: dict[str, Any], baseline: dict[str, Any] | None,
             capacity_gb: float) -> tuple[str, dict[str, int]]:
    """Throughput vs per-GPU memory of every trial: Pareto front, infeasible by reason.
    Returns the image and the count of trials per infeasibility class."""
    tps = trials["tokens_per_s"].to_numpy(dtype=float)
    mem = trials["peak_memory_gb"].to_numpy(dtype=float)
    feas = trials["feasible"].to_numpy(dtype=bool) & np.isfinite(tps) & np.isfinite(mem)
    bad = ~trials["feasible"].to_numpy(dtype=bool)
    codes = trials["reason_code"] if "reason_code" in trials.columns else pd.Series("", index=trials.index)
    cats = pd.Series([reason_category(r, c) for r, c in zip(trials.loc[bad, "reason"], codes[bad])],
                     index=trials.index[bad], dtype=object)
    counts = cats.value_counts()
    top = list(counts.index[:len(REASON_MARKERS) - 1])

    finite_mem = mem[np.isfinite(mem)]
    xmax = float(finite_mem.max()) if finite_mem.size else 1.0
    if math.isfinite(capacity_gb):
        # memory far past capacity says only "does not fit": clamp it to the edge, keep the scale readable
        near = max(capacity_gb * 3, float(np.nanmax(mem[feas])) * 1.2 if feas.any() else 0.0)
        xmax = min(xmax * 1.03, near)

    def draw(fig: Figure) -> None:
        ax = fig.add_subplot()
        ymax = np.nanmax(tps) if np.isfinite(tps).any() else 1.0
        clipped = 0
        for i, cat in enumerate(top + (["other"] if len(counts) > len(top) else [])):
            sel = cats.index[cats.isin(top) == False] if cat == "other" else cats.index[cats == cat]  # noqa: E712
            sub = trials.loc[sel]
            y = sub["tokens_per_s"].to_numpy(dtype=float)
            x = sub["peak_memory_gb"].to_numpy(dtype=float)
            y = np.where(np.isfinite(y), y, 0.0)        # no estimate: drawn on the floor
            ok = np.isfinite(x)
            clipped += int((x[ok] > xmax).sum())
            ax.scatter(np.minimum(x[ok], xmax), y[ok], s=14, marker=REASON_MARKERS[i], c=REASON_COLORS[i], lw=0.8,
                       alpha=0.5, label=f"{cat} ({len(sub)})", rasterized=True, zorder=1, clip_on=False)
        ax.scatter(mem[feas], tps[feas], s=10, c="#4c72b0", alpha=0.5, lw=0, label=f"feasible ({feas.sum()})",
                   rasterized=True, zorder=2)
        if feas.any():
            front = pareto_mask(mem[feas], tps[feas])
            fm, ft = mem[feas][front], tps[feas][front]
            o = np.argsort(fm)
            ax.plot(fm[o], ft[o], "-o", color="#1f3d7a", ms=4, lw=1.2, label=f"Pareto front ({front.sum()})", zorder=3)
        if math.isfinite(capacity_gb) and capacity_gb <= xmax:
            ax.axvline(capacity_gb, color="#c44e52", ls="--", lw=1)
            ax.text(capacity_gb, ymax * 1.02, f" capacity {capacity_gb:.0f} GB", color="#c44e52", va="bottom",
                    fontsize=8)
        elif math.isfinite(capacity_gb):
            # the capacity is far right of every plan: say so instead of drawing text off the axes
            # (which also collapsed the constrained layout)
            ax.text(0.99, 0.02, f"capacity {capacity_gb:.0f} GB (off scale)", transform=ax.transAxes,
                    ha="right", va="bottom", color="#c44e52", fontsize=8)
        ax.scatter([chosen.get("peak_memory_gb")], [chosen.get("tokens_per_s")], marker="*", s=260,
                   c="#e6b800", edgecolors="black", lw=0.8, zorder=5, label="chosen plan")
        if baseline and baseline.get("tokens_per_s"):
            ax.scatter([min(baseline["peak_memory_gb"], xmax)], [baseline["tokens_per_s"]], marker="D", s=60,
                       c="white", edgecolors="black", lw=1.2, zorder=5, label="baseline", clip_on=False)
        ax.set_xlabel("predicted peak memory per GPU (GB)" +
                      (f"; {clipped} plans needing more than {xmax:.0f} GB are drawn at the right edge" if clipped else ""))
        ax.set_ylabel("predicted tokens/s")
        ax.set_ylim(bottom=0, top=ymax * 1.1)
        ax.set_xlim(left=0, right=xmax)
        _kilo(ax)
        handles, labels = ax.get_legend_handles_labels()
        reason_labels = {f"{c} ({n})" for c, n in counts.items()} | {lab for lab in labels if lab.startswith("other (")}
        order = sorted(range(len(labels)), key=lambda k: (labels[k] in reason_labels, k))
        # long infeasibility reasons are wrapped so the legend never pushes the plot off the figure
        ax.legend([handles[k] for k in order], [textwrap.fill(labels[k], 42) for k in order], loc="upper left",
                  bbox_to_anchor=(1.01, 1), frameon=False)

    return render(draw, (10.5, 4.6)), {str(k): int(v) for k, v in counts.items()}


OVERHEAD_HIDDEN = 0.75
"""The runtime allowance is left out of the memory bars (and stated) when it is at least this
share of every bar: the rest would be slivers (tiny chatglm3 on CPU: 0.25 of 0.28 GB, 89%)."""


def memory_stacks(groups: list[dict[str, Any]], capacity_gb: float) -> str:
    """Stacked per-GPU memory, one bar per pipeline stage, grouped by plan.

    groups: [{"label": str, "stages": [{part: GB}], "note": str, "needs_gb": float|None}]"""

    # a small model's bars are nearly all runtime allowance (a fixed GB or so): drawn stacked, the
    # model states are invisible slivers. Then the allowance is stated, not drawn.
    bars = [st for g in groups for st in g["stages"]]
    allowance = [float(st.get("overhead", 0.0) or 0.0) for st in bars]
    hide = bool(bars) and all(a >= OVERHEAD_HIDDEN * sum(float(v or 0.0) for v in st.values())
                              for a, st in zip(allowance, bars)) and max(allowance) > 0
    parts = [p for p in MEM_PARTS if not (hide and p == "overhead")]
    totals = [sum(float(st.get(p, 0.0) or 0.0) for p in parts) for st in bars]
    fitting = [t for t in totals if t <= capacity_gb] or [capacity_gb]
    top = max(capacity_gb * 1.3, max(fitting) * 1.1)     # far-over-capacity bars are clipped and labelled
    # when every plan uses a sliver of the capacity (a tiny model on a CPU host), scale to the
    # bars and state the capacity instead of drawing invisible bars under a far-away line
    capacity_on_scale = max(totals, default=0.0) * 10 >= capacity_gb
    if not capacity_on_scale:
        top = max(totals) * 1.25

    def draw(fig: Figure) -> None:
        ax = fig.add_subplot()
        x, ticks, labels, sep = 0.0, [], [], []
        width = 0.8
        for g in groups:
            stages = g["stages"]
            pad = max(0.0, (2.2 - max(1, len(stages))) / 2)   # room for a three-line label
            x += pad
            start = x
            if not stages and g.get("needs_gb"):
                ax.bar(x, min(g["needs_gb"], top), width, color="white", edgecolor="#c44e52", hatch="//", lw=1)
                ax.text(x, min(g["needs_gb"], top * 0.97), f"needs\n{g['needs_gb']:.0f} GB", ha="center", va="top",
                        fontsize=7, color="#c44e52", bbox={"fc": "white", "ec": "none", "pad": 1})
                x += 1
            for si, st in enumerate(stages):
                bottom = 0.0
                for part in parts:
                    v = float(st.get(part, 0.0) or 0.0)
                    if v > 0:
                        ax.bar(x, v, width, bottom=bottom, color=MEM_COLORS[part], lw=0)
                        bottom += v
                if bottom > top:
                    ax.text(x, top * 0.97, f"{bottom:.0f} GB\n\u2191", ha="center", va="top", fontsize=7,
                            color="#c44e52", bbox={"fc": "white", "ec": "none", "pad": 1})
                if 1 < len(stages) <= 16:
                    ax.text(x, -0.01, str(si), ha="center", va="top", fontsize=6, color="#555",
                            transform=ax.get_xaxis_transform())
                x += 1
            ticks.append((start + x - 1) / 2)
            labels.append(g["label"])
            x += 0.8 + pad
            sep.append(x - 0.9)
        ax.set_ylim(0, top)
        for s in sep[:-1]:
            ax.axvline(s, color="#ddd", lw=0.8)
        if capacity_on_scale:
            ax.axhline(capacity_gb, color="#c44e52", ls="--", lw=1.2)
            ax.text(0.005, capacity_gb, f"capacity {capacity_gb:.0f} GB", color="#c44e52", va="bottom", fontsize=8,
                    transform=ax.get_yaxis_transform())
        else:
            ax.text(0.005, 0.97, f"capacity {capacity_gb:.0f} GB (off scale: every bar is under a tenth of it)",
                    color="#c44e52", va="top", fontsize=8, transform=ax.transAxes)
        ax.set_xticks(ticks, labels, fontsize=8)
        ax.tick_params(axis="x", length=0, pad=12)
        ax.set_ylabel("GB per GPU (bars: pipeline stages)")
        ax.grid(axis="x", visible=False)
        if hide:
            lo, hi = min(allowance), max(allowance)
            amount = f"{lo:.2g} GB" if hi - lo < 0.005 else f"{lo:.2g}-{hi:.2g} GB"
            ax.text(0.995, 0.97, f"+ runtime allowance {amount} per GPU, not drawn (it is over "
                    f"{OVERHEAD_HIDDEN:.0%} of every bar)", ha="right", va="top", fontsize=8, color="#555",
                    transform=ax.transAxes)
        handles = [Patch(color=MEM_COLORS[p], label=MEM_LABELS[p]) for p in parts]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)

    return render(draw, (10.5, 4.2))


def time_breakdown(rows: list[dict[str, Any]]) -> str:
    """Horizontal stacked step time per plan. rows: [{"label": str, "time": {part: s}}]."""

    def draw(fig: Figure) -> None:
        ax = fig.add_subplot()
        for i, r in enumerate(rows):
            left = 0.0
            for part in TIME_PARTS:
                v = r["time"].get(part, 0.0)
                v = float(v) if v == v and v is not None else 0.0
                if v > 0:
                    ax.barh(i, v, left=left, color=TIME_COLORS[part], height=0.65, lw=0)
                    left += v
            ax.text(left, i, f" {left:.3g} s", va="center", fontsize=8)
        ax.set_yticks(range(len(rows)), [r["label"] for r in rows])
        ax.invert_yaxis()
        ax.set_xlabel("seconds per optimizer step (critical path)")
        ax.grid(axis="y", visible=False)
        ax.margins(x=0.12)
        handles = [Patch(color=TIME_COLORS[p], label=TIME_LABELS[p]) for p in TIME_PARTS]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)

    return render(draw, (10.5, max(2.8, 0.9 + 0.42 * len(rows))))


def history(hist: pd.DataFrame, direction: str) -> str:
    """Objective value per trial and the best so far (Optuna's optimisation history)."""

    def draw(fig: Figure) -> None:
        ax = fig.add_subplot()
        done = hist[hist["state"] == "COMPLETE"].sort_values("number")
        v = done["value"].to_numpy(dtype=float)
        n = done["number"].to_numpy()
        feas = done["feasible"].to_numpy(dtype=bool)
        ax.scatter(n[feas], v[feas], s=10, c="#4c72b0", alpha=0.6, lw=0, label="feasible trial", rasterized=True)
        ax.scatter(n[~feas], v[~feas], s=12, marker="x", c="#c44e52", lw=0.8, alpha=0.6,
                   label="infeasible (scored 0)", rasterized=True)
        best = np.fmax.accumulate(v) if direction == "maximize" else np.fmin.accumulate(v)
        ax.step(n, best, where="post", color="#1f3d7a", lw=1.5, label="best so far")
        ax.set_xlabel("trial")
        ax.set_ylabel("objective (tokens/s)")
        ax.set_ylim(bottom=-0.04 * (np.nanmax(v) if len(v) and np.isfinite(v).any() else 1))
        _kilo(ax)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncols=3, frameon=False)

    return render(draw, (5.2, 3.4))


def importances(imp: dict[str, float]) -> str:
    items = sorted(imp.items(), key=lambda kv: kv[1])

    def draw(fig: Figure) -> None:
        ax = fig.add_subplot()
        ax.barh(range(len(items)), [v for _, v in items], color="#4c72b0", height=0.6)
        ax.set_yticks(range(len(items)), [k for k, _ in items])
        for i, (_, v) in enumerate(items):
            ax.text(v, i, f" {v:.2f}", va="center", fontsize=8)
        ax.set_xlabel("importance for the objective (optuna.importance)")
        ax.grid(axis="y", visible=False)
        ax.margins(x=0.15)

    return render(draw, (5.2, 0.9 + 0.35 * max(3, len(items))))


def measured_vs_predicted(metrics: dict[str, Any], capacity_gb: float) -> str:
    """Measured vs predicted tokens/s and memory, and per-rank peak memory."""
    pred = metrics.get("predicted") or {}

    def draw(fig: Figure) -> None:
        a1, a2 = fig.subplots(1, 2, width_ratios=[1, 2])
        vals = [("tokens/s", pred.get("tokens_per_s"), metrics.get("tokens_per_s"))]
        a1.bar([0, 1], [_num(vals[0][1]), _num(vals[0][2])], color=["#b0b0b0", "#4c72b0"])
        a1.set_xticks([0, 1], ["predicted", "measured"])
        a1.set_title("throughput (tokens/s)")
        _kilo(a1)
        per_rank = [_num(x) for x in metrics.get("peak_memory_gb_per_rank") or []]
        a2.bar(range(len(per_rank)), per_rank, color="#4c72b0", label="measured peak per rank")
        if pred.get("peak_memory_gb") is not None:
            a2.axhline(_num(pred["peak_memory_gb"]), color="#1f3d7a", ls="-.", lw=1.2, label="predicted peak")
        if math.isfinite(capacity_gb):
            a2.axhline(capacity_gb, color="#c44e52", ls="--", lw=1, label="capacity")
        a2.set_xlabel("rank")
        a2.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))   # ranks are whole numbers
        a2.set_ylabel("GB")
        a2.set_title("peak memory per rank")
        tops = [v for v in per_rank + [_num(pred.get("peak_memory_gb")), capacity_gb] if math.isfinite(v)]
        if tops:
            a2.set_ylim(0, max(tops) * 1.3)
        a2.legend(loc="upper left", ncols=3, frameon=False)

    return render(draw, (10.5, 3.2))


def loss_curve(metrics: dict[str, Any]) -> str:
    loss = [_num(x) for x in metrics.get("loss") or []]
    times = [_num(x) for x in metrics.get("step_times_s") or []]
    warm = int(metrics.get("warmup") or 0)

    def draw(fig: Figure) -> None:
        a1, a2 = fig.subplots(1, 2)
        a1.plot(range(1, len(loss) + 1), loss, color="#4c72b0", lw=1.3)
        for ev in metrics.get("events") or []:
            if isinstance(ev, dict) and isinstance(ev.get("step"), int) and 0 < ev["step"] <= len(loss):
                bad = ev.get("kind") in ("nan", "spike", "stall", "rollback")
                a1.axvline(ev["step"], color="#c44e52" if bad else "#999", ls=":", lw=1)
        evals = [(e["step"], _num(e.get("loss"))) for e in metrics.get("eval_loss") or []
                 if isinstance(e, dict) and isinstance(e.get("step"), int)]
        if evals:
            a1.plot(*zip(*evals), "s", ms=5, color="#dd8452", label="held-out loss", zorder=3)
        lr = [_num(x) for x in metrics.get("lr") or []]
        if lr:
            a3 = a1.twinx()
            a3.plot(range(1, len(lr) + 1), lr, color="#8c8c8c", ls="--", lw=1, label="learning rate")
            a3.set_ylabel("learning rate", color="#8c8c8c")
            a3.set_ylim(bottom=0)
            a3.tick_params(axis="y", labelcolor="#8c8c8c")
        handles = [h for ax in fig.axes for h in ax.get_legend_handles_labels()[0]]
        if evals or lr:
            a1.legend(handles=[a1.lines[0]] + handles, labels=["training loss"] + [h.get_label() for h in handles],
                      loc="upper right", frameon=False)
        a1.set_xlabel("step")
        a1.set_ylabel("loss")
        a1.set_title("training loss" + (", held-out loss" if evals else "") + (" and learning rate" if lr else ""))
        a2.plot(range(1, len(times) + 1), times, "-o", ms=2.5, color="#55a868", lw=1)
        if 0 < warm < len(times):
            a2.axvspan(0.5, warm + 0.5, color="#ddd", alpha=0.6, label="warm-up (not counted)")
            a2.legend(loc="upper right", frameon=False)
        pred = (metrics.get("predicted") or {}).get("step_time_s")
        if pred is not None:
            a2.axhline(_num(pred), color="#1f3d7a", ls="-.", lw=1.2)
            a2.text(len(times), _num(pred), "predicted ", ha="right", va="bottom", fontsize=8, color="#1f3d7a")
        a2.set_xlabel("step")
        a2.set_ylabel("seconds")
        a2.set_title("step time")
        a2.set_ylim(bottom=0)

    return render(draw, (10.5, 3.0))


def _num(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else math.nan


__all__ = ["frontier", "history", "importances", "loss_curve", "measured_vs_predicted", "memory_stacks",
           "render", "time_breakdown"]
