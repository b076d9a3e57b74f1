"""The bill of a search and of one plan: days and cost to train --tokens for the chosen plan
(and, for the report's cost/days Pareto, for the top plans), --objective cost.

The arithmetic is planner.cost.bill; this module only applies it to a search result and shapes
estimate.json's "bill" section and the printed lines (`planner search`, `planner estimate`,
and write_outputs for every other writer of a search's run directory).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from planner.cost.bill import Bill, BillSpec, bill_lines, default_tokens, plan_bill, price_for, tokens_text

OBJECTIVES = ("throughput", "cost")
PARETO_PLANS = 40
"""Plans (fastest first, or cheapest with --objective cost) whose bills estimate.json keeps."""


def _row(plan: Any, bill: Bill, chosen: bool) -> dict[str, Any]:
    s = bill.spot
    return {"description": plan.describe(), "tokens_per_s": bill.tokens_per_s, "days": bill.days,
            "cost_usd": bill.cost, "spot_days": s.days if s and math.isfinite(s.wall_s) else None,
            "spot_cost_usd": s.cost if s else None, "chosen": chosen}


def bill_doc(spec: BillSpec, chosen: Bill, rows: list[dict[str, Any]], objective: str) -> dict[str, Any]:
    """estimate.json's "bill": the chosen plan's bill, the objective, and the rows of the Pareto."""
    return {"objective": objective, **chosen.to_dict(), "restart_min": spec.restart_min if spec.spot else None,
            "plans": rows}


def default_spec(model: Any, cluster: Any) -> BillSpec:
    """The bill with no cost flags: the model's published tokens, the GPU's on-demand price on file."""
    tokens, note = default_tokens(model.name)
    return BillSpec(tokens=tokens, tokens_note=note, price=price_for(cluster.device.name, "on_demand"))


def search_bill(spec: BillSpec, result: Any, model: Any, cluster: Any, objective: str) -> tuple[Any, dict[str, Any],
                                                                                              list[str]]:
    """(result re-ranked when objective is cost, estimate.json's "bill", the printed lines)."""
    params = model.params
    bills = {t.plan: plan_bill(spec, t.estimate, t.plan, params, cluster) for t in result.ranked}
    if objective == "cost":
        ranked = tuple(sorted(result.ranked, key=lambda t: (bills[t.plan].objective(), -t.tokens_per_s)))
        result = dataclasses.replace(result, ranked=ranked)
    best = result.best
    rows = [_row(t.plan, bills[t.plan], t is best) for t in result.ranked[:PARETO_PLANS]]
    if not any(r["chosen"] for r in rows):
        rows.append(_row(best.plan, bills[best.plan], True))
    lines = bill_lines(bills[best.plan])
    if objective == "cost":
        what = "spot cost" if spec.spot and bills[best.plan].spot and bills[best.plan].spot.cost is not None else \
            ("on-demand cost" if bills[best.plan].price else "GPU-hours (no price on file)")
        lines.insert(0, f"--objective cost: plans ranked by {what} to train {tokens_text(spec.tokens)} tokens")
    return result, bill_doc(spec, bills[best.plan], rows, objective), lines


def estimate_bill(spec: BillSpec, est: Any, plan: Any, model: Any, cluster: Any) -> tuple[dict[str, Any], list[str]]:
    """(estimate.json's / --json's "bill", the printed lines) of one plan."""
    bill = plan_bill(spec, est, plan, model.params, cluster)
    return bill_doc(spec, bill, [_row(plan, bill, True)], "throughput"), bill_lines(bill)
