"""The seed article's cost questions, answered (issue 23, point 5).

For GLM-130B on 32 A100s (the article: "15 days, over one million yuan", "down to 5 days"),
a 1T-parameter model on 8 A100s and GLM-130B on 4 A6000s: the plan benchmarks/low_cost.py's
exhaustive search picks, and the days and dollars to train 400B tokens (GLM-130B's run) on
it, on-demand and on spot, with each price's source (profiles/prices.json), and the yuan at the
dated exchange rate on file there (the article counts in yuan). Figures are the
cost model's predictions; the prices are published list prices; the preemption rate is an
assumption (no published rate is on file): pass --preemption-rate for yours. Nothing is
asserted.

    .venv/bin/python benchmarks/cost_questions.py [--json] [--preemption-rate R] [--restart-min M]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from low_cost import SCENARIOS, TOKENS, missing, search  # noqa: E402

from planner.cost.bill import (BillSpec, bill_lines, check_rate, check_restart, duration_text,  # noqa: E402
                               exchange_rate, plan_bill, price_for)
from planner.errors import SpecError  # noqa: E402

QUESTIONS = SCENARIOS[:3]
ARTICLE = {
    "4x8xA100": "the article: 15 days and over one million yuan on 32 A100s, 'down to 5 days' with its tricks",
    "8xA100": "the article: a 1T-parameter model trains on 8 A100s",
    "4xA6000": "the article: GLM-130B on 4 A6000s for a small team",
}


def question(title: str, model, gpus: str, batch: int, seq: int, rate: float, restart_min: float) -> dict:
    cluster, trials, ranked = search(model, gpus, batch, seq)
    device = cluster.device.name
    spec = BillSpec(tokens=TOKENS, tokens_note="GLM-130B's 400B tokens (Zeng et al. 2022)",
                    price=price_for(device, "on_demand"), spot=True, spot_price=price_for(device, "spot"),
                    preemption_rate=rate, restart_min=restart_min)
    out = {"question": title, "gpus": gpus, "device": device, "model": model.name, "params_b": model.params / 1e9,
           "article": ARTICLE.get(gpus, ""), "plans": len(trials)}
    if not ranked:
        out["missing"] = missing(cluster, trials)
        return out
    best = ranked[0]
    b = plan_bill(spec, best.estimate, best.plan, model.params, cluster)
    out.update(plan=best.plan.describe(), tokens_per_s=best.tokens_per_s, bill=b.to_dict(), lines=bill_lines(b))
    rate = exchange_rate("CNY")
    if rate is not None:
        d = b.to_dict()
        out["cny"] = {"per_usd": rate[0], "source": rate[1],
                      "on_demand": None if d["cost_usd"] is None else d["cost_usd"] * rate[0],
                      "spot": None if d["spot"]["cost_usd"] is None else d["spot"]["cost_usd"] * rate[0]}
    return out


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--preemption-rate", type=float, default=0.05,
                    help="assumed spot preemptions per node-hour (default 0.05: one per 20 node-hours)")
    ap.add_argument("--restart-min", type=float, default=10.0, help="assumed minutes from preemption to training")
    args = ap.parse_args(argv)
    try:
        rate, restart = check_rate(args.preemption_rate), check_restart(args.restart_min)
    except SpecError as exc:
        ap.exit(2, exc.line() + "\n")
    rows = []
    for title, model, gpus, batch, seq in QUESTIONS:
        try:
            rows.append(question(title, model(), gpus, batch, seq, rate, restart))
        except SpecError as exc:
            rows.append({"question": title, "gpus": gpus, "missing": exc.line()})
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "lines"} for r in rows], indent=1))
        return rows
    print(f"spot: {rate:g} preemptions per node-hour and {restart:g} min to restart, ASSUMED (no published rate is "
          "on file; --preemption-rate, --restart-min)")
    cny = exchange_rate("CNY")
    if cny is not None:
        print(f"yuan: {cny[0]:g} CNY per USD, {cny[1]}")
    for r in rows:
        print(f"\n{r['question']}  [{r.get('model', '')}, {r.get('params_b', 0):,.0f}B parameters, "
              f"{r.get('plans', 0)} plans]")
        if r.get("article"):
            print(f"  {r['article']}")
        if "missing" in r:
            print(f"  {r['missing']}")
            continue
        b = r["bill"]
        print(f"  plan: {r['plan']}; {r['tokens_per_s']:,.0f} tokens/s")
        s = b["spot"]
        od = f"${b['cost_usd']:,.0f}" if b["cost_usd"] is not None else "no on-demand price on file"
        sp = f"${s['cost_usd']:,.0f}" if s["cost_usd"] is not None else (
            "no spot price on file" if s["finishes"] else "never finishes")
        print(f"  on-demand: {duration_text(b['days'] * 86400)}, {od};  spot: "
              f"{duration_text(s['days'] * 86400) if s['finishes'] else 'never'}, {sp}")
        cny = r.get("cny")
        if cny and cny["on_demand"] is not None:
            sp = f", spot CNY {cny['spot']:,.0f}" if cny["spot"] is not None else ""
            print(f"  in yuan: on-demand CNY {cny['on_demand']:,.0f}{sp} (at {cny['per_usd']:g} CNY per USD)")
        for line in r["lines"]:
            print(f"  {line}")
    return rows


if __name__ == "__main__":
    main()
