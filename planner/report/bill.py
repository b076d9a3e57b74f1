"""The report's "What the run costs" section: estimate.json's "bill" (planner/search/bill.py) as
figures and a cost/days Pareto of the top plans, on-demand and spot, the chosen plan marked."""
from __future__ import annotations

import math
from typing import Any

from planner.report.plots import render


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def points(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """(days, cost) of every plan row, on-demand and spot, with which is the chosen plan and
    which lie on the Pareto front (no other point is both faster and cheaper)."""
    out = []
    for r in doc.get("plans", []) if isinstance(doc.get("plans"), list) else []:
        if not isinstance(r, dict):
            continue
        for offer, dk, ck in (("on-demand", "days", "cost_usd"), ("spot", "spot_days", "spot_cost_usd")):
            d, c = _num(r.get(dk)), _num(r.get(ck))
            if d is not None and c is not None:
                out.append({"offer": offer, "days": d, "cost": c, "chosen": bool(r.get("chosen")),
                            "description": str(r.get("description", ""))})
    for p in out:
        p["pareto"] = not any(q["days"] <= p["days"] and q["cost"] <= p["cost"] and
                              (q["days"] < p["days"] or q["cost"] < p["cost"]) for q in out)
    return out


def section(doc: Any) -> dict[str, Any] | None:
    """The section's data, None without a bill (a run directory from before the bill existed)."""
    if not isinstance(doc, dict) or _num(doc.get("days")) is None:
        return None
    spot = doc.get("spot") if isinstance(doc.get("spot"), dict) else None
    price = doc.get("price") if isinstance(doc.get("price"), dict) else None
    return {"tokens": _num(doc.get("tokens")), "tokens_note": str(doc.get("tokens_note", "")),
            "days": _num(doc.get("days")), "gpu_hours": _num(doc.get("gpu_hours")), "cost": _num(doc.get("cost_usd")),
            "gpus": doc.get("gpus"), "over_a_year": bool(doc.get("over_a_year")), "price": price, "spot": spot,
            "objective": str(doc.get("objective", "throughput")), "points": points(doc)}


def pareto_figure(pts: list[dict[str, Any]]) -> str:
    """Cost vs days to train, every (plan, offer); the front joined, the chosen plan ringed."""
    def draw(fig: Any) -> None:
        ax = fig.add_subplot()
        for offer, marker in (("on-demand", "o"), ("spot", "^")):
            sel = [p for p in pts if p["offer"] == offer]
            if sel:
                ax.scatter([p["days"] for p in sel], [p["cost"] for p in sel], marker=marker, s=22, alpha=0.6,
                           label=offer)
        front = sorted((p for p in pts if p["pareto"]), key=lambda p: p["days"])
        if front:
            ax.plot([p["days"] for p in front], [p["cost"] for p in front], "-", color="#555", lw=1,
                    label="Pareto front")
        for p in pts:
            if p["chosen"]:
                ax.scatter([p["days"]], [p["cost"]], s=140, facecolors="none", edgecolors="#c44e52", lw=1.6,
                           label="chosen plan" if p["offer"] == "on-demand" else None)
        ax.set_xlabel("days to train")
        ax.set_ylabel("cost, USD")
        ax.legend(loc="best")
    return render(draw, (6.4, 3.6))
