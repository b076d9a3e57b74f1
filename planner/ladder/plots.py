"""Waterfalls of the ladder: throughput and peak memory per GPU, rung by rung.

Each legal rung is a floating bar from the rung before to its own value (green: better,
red: worse), the baseline and the plan as full bars; measured values, where a rung ran, are a
narrower bar beside the predicted one. Labels are built from technique names and numbers
only (no user text goes into a figure).
"""
from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path
from typing import Any

FILES = {"throughput": "ladder-throughput.png", "memory": "ladder-memory.png"}

_KEYS = {"throughput": ("tokens_per_s", "real tokens/s", True), "memory": ("peak_memory_gb", "peak GB per GPU", False)}



def _label(v: float) -> str:
    """A bar's value in a few characters: 629, 9.4k, 21.3k, 1.2M; 0.48 (memory in GB)."""
    if abs(v) >= 1e6:
        return f"{v / 1e6:.1f}M"
    if abs(v) >= 1e3:
        return f"{v / 1e3:.1f}k"
    return f"{v:.3g}"

def _series(rungs: list[dict[str, Any]], key: str, measured: bool) -> list[float | None]:
    out = []
    for r in rungs:
        src = r.get("measured") if measured else r
        v = (src or {}).get(key)
        out.append(float(v) if v else None)
    return out


def draw(ladder: dict[str, Any], what: str) -> bytes:
    """One waterfall as PNG bytes."""
    import matplotlib
    from matplotlib.figure import Figure
    matplotlib.use("Agg")
    key, ylabel, up_good = _KEYS[what]
    rungs = [r for r in ladder["rungs"] if "illegal" not in r]
    labels = ["baseline"] + ["+ " + "\n+ ".join(r.get("adds") or [r["technique"]]) for r in rungs[1:]] + ["plan"]
    pred = _series(rungs, key, False)
    meas = _series(rungs, key, True)
    has_meas = any(v is not None for v in meas)
    fig = Figure(figsize=(max(6.0, 1.15 * len(labels)), 3.8), layout="constrained")
    ax = fig.add_subplot()
    w = 0.38 if has_meas else 0.6
    off = w / 2 if has_meas else 0.0

    def bars(vals: list[float | None], shift: float, alpha: float, tag: str) -> None:
        prev = None
        for i, v in enumerate(vals):
            if v is None:
                continue
            if i == 0 or prev is None:
                ax.bar(i + shift, v, w, color="#4c72b0", alpha=alpha)
            else:
                good = (v >= prev) == up_good
                ax.bar(i + shift, v - prev, w, bottom=prev, color="#55a868" if good else "#c44e52", alpha=alpha)
            ax.annotate(_label(v), (i + shift, v), ha="center", va="bottom", fontsize=7)
            prev = v
        last = next((v for v in reversed(vals) if v is not None), None)
        if last is not None and vals[-1] is not None:
            ax.bar(len(vals) + shift, last, w, color="#4c72b0", alpha=alpha, label=tag)

    bars(pred, -off, 0.95, "predicted")
    if has_meas:
        bars(meas, off, 0.5, "measured")
        ax.legend(loc="best")
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{'Throughput' if what == 'throughput' else 'Peak memory'} across the ladder "
                 f"({'predicted and measured' if has_meas else 'predicted'})")
    ax.grid(axis="y", alpha=0.3)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()


def write(run_dir: str | Path, ladder: dict[str, Any]) -> list[Path]:
    """Both waterfalls into the run directory (temporary file + rename each)."""
    out = []
    for what, name in FILES.items():
        data = draw(ladder, what)
        path = Path(run_dir) / name
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        out.append(path)
    return out
