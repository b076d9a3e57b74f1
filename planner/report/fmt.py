"""Numbers as a reader wants them: 143.8k tokens/s, 21.9 s, 3.4 days, 40.0 GB, $1.2M."""
from __future__ import annotations

import math


def _bad(x: float | None) -> bool:
    return x is None or not isinstance(x, (int, float)) or not math.isfinite(x)


def si(x: float | None, unit: str = "", digits: int = 3) -> str:
    """Engineering notation with k/M/G/T/P prefixes: si(143750, 'tokens/s') -> '144k tokens/s'."""
    if _bad(x):
        return "n/a"
    prefixes = ["", "k", "M", "G", "T", "P", "E"]
    v, i = abs(float(x)), 0
    while v >= 999.5 and i < len(prefixes) - 1:
        v /= 1000
        i += 1
    text = f"{v:.{digits}g}"
    if "e" in text:
        text = f"{v:.0f}"
    sign = "-" if x < 0 else ""
    return f"{sign}{text}{prefixes[i]}" + (f" {unit}" if unit else "")


def duration(seconds: float | None) -> str:
    """Seconds in the largest unit that keeps the number readable."""
    if _bad(seconds):
        return "n/a"
    s = float(seconds)
    if s < 1e-3:
        return f"{s * 1e6:.3g} us"
    if s < 1:
        return f"{s * 1e3:.3g} ms"
    if s < 120:
        return f"{s:.3g} s"
    if s < 2 * 3600:
        return f"{s / 60:.3g} min"
    if s < 3 * 86400:
        return f"{s / 3600:.3g} h"
    if s < 365 * 86400:
        return f"{s / 86400:.3g} days"
    return f"{s / (365.25 * 86400):.3g} years"


def gb(x: float | None) -> str:
    return "n/a" if _bad(x) else f"{x:.1f} GB"


def pct(x: float | None, digits: int = 1) -> str:
    return "n/a" if _bad(x) else f"{100 * x:.{digits}f}%"


def less(reduction: float | None, digits: int = 1) -> str:
    """A memory reduction in words: 0.123 -> "12.3% less", -0.123 -> "12.3% more" (not "-12.3% less")."""
    if _bad(reduction):
        return "n/a"
    word = "less" if reduction >= 0 else "more"
    return f"{100 * abs(reduction):.{digits}f}% {word}"


def ratio(x: float | None) -> str:
    return "n/a" if _bad(x) else f"{x:.2f}x"


def money(x: float | None) -> str:
    if _bad(x):
        return "n/a"
    if x >= 1e4:
        return "$" + si(x, digits=3)
    return f"${x:,.2f}"


def number(x: float | None, digits: int = 4) -> str:
    return "n/a" if _bad(x) else f"{x:.{digits}g}"
