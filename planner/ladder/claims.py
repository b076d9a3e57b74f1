"""The source article's claimed effect of each technique, and the same quantity for a rung.

The article (as quoted in issue 12, the same article as the 3x / one-third targets of
planner.search.baseline.TARGETS_SOURCE) gives one figure per technique; each is compared with
the quantity our cost model (and, measured, the executor) gives for the same step:

    precision  "2.8x compute throughput"                  compute seconds per token, before / after
    overlap    "communication share of an 8-GPU step       exposed communication / step time, after
                35% -> 12%"
    batching   "GPU utilisation 65% -> over 90%"           real (non-padding) share of the tokens computed
    zero       "optimizer memory 3N -> 1.5N"               optimizer states + fp32 master per GPU, after / before
    recompute  "70% less activation memory for 20% more    activation bytes per sequence, after / before;
                compute"                                   compute seconds per token, after / before
    layout     (no figure)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from planner.specs.estimate import Estimate

SOURCE = ("the source article's per-technique figures as quoted in issue 12 (the article of the 3x / one-third "
          "targets): mixed precision 2.8x compute throughput; overlap: communication 35% -> 12% of an 8-GPU step; "
          "dynamic batching: GPU utilisation 65% -> over 90%; ZeRO: optimizer memory 3N -> 1.5N; activation "
          "checkpointing: 70% less activation memory for 20% more compute")

COMM_PARTS = ("tp_comm", "a2a_comm", "pp_comm", "dp_sync", "zero_gather")
COMPUTE_PARTS = ("forward", "backward", "recompute")


@dataclass(frozen=True, slots=True)
class Claim:
    metric: str
    """What is compared, in words."""
    article: str
    """The article's figure, as it states it."""
    article_value: float | None
    """The same figure as a number in our metric's unit (None: the article gives none)."""
    unit: str
    """"x" (a ratio after / before or before / after as the metric says) or "%" (a share after the rung)."""
    short: str
    """The metric in two or three words, printed beside our value: the rung's gain column is
    tokens/s, and precision's "15.17x" beside a 14.88x gain must say it is compute per token."""


CLAIMS: dict[str, Claim] = {
    "precision": Claim("compute throughput (compute seconds per token, before / after)", "2.8x", 2.8, "x",
                       "compute/token"),
    "overlap": Claim("exposed communication share of the step, after", "35% -> 12%", 0.12, "%", "comm share"),
    "batching": Claim("real tokens / tokens computed (the article: GPU utilisation), after", "65% -> over 90%",
                      0.90, "%", "real tokens"),
    "zero": Claim("optimizer states + fp32 master per GPU, after / before", "3N -> 1.5N (0.5x)", 0.5, "x",
                  "optimizer memory"),
    "recompute": Claim("activation memory per sequence, after / before", "-70% (0.30x) for +20% compute", 0.30, "x",
                       "activations/seq"),
    "layout": Claim("tokens/s, after / before", "no figure", None, "x", "tokens/s"),
}


def comm_share(time: dict[str, float], step: float) -> float:
    """Exposed communication (TP, PP, DP, ZeRO-3 gathers) as a share of the step."""
    return sum(time.get(k, 0.0) for k in COMM_PARTS) / step if step > 0 else 0.0


def compute_per_token(time: dict[str, float], tokens: int) -> float:
    return sum(time.get(k, 0.0) for k in COMPUTE_PARTS) / tokens


def ours(technique: str, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Our predicted value of the article's metric for a rung (`before`/`after`: rung records
    of planner.ladder.predict), with a note where a second quantity belongs to the claim."""
    c = CLAIMS[technique]
    out: dict[str, Any] = {"metric": c.metric, "article": c.article, "article_value": c.article_value, "unit": c.unit,
                           "short": c.short}
    tb, ta = before["time_breakdown_s"], after["time_breakdown_s"]
    if technique == "precision":
        v = compute_per_token(tb, before["tokens_per_step"]) / compute_per_token(ta, after["tokens_per_step"])
    elif technique == "overlap":
        v = after["comm_share"]
        out["before"] = before["comm_share"]
    elif technique == "batching":
        v = after["real_share"]
        out["before"] = before["real_share"]
    elif technique == "zero":
        ob = before["memory_breakdown_gb"]["optimizer"]
        v = after["memory_breakdown_gb"]["optimizer"] / ob if ob > 0 else None
    elif technique == "recompute" and after["plan"]["recompute"] == "none":
        v = None
        out["note"] = (f"no checkpointing in the plan: this rung only changes the micro-batch "
                       f"{before['plan']['micro_batch']} -> {after['plan']['micro_batch']}")
    elif technique == "recompute":
        ab = before["memory_breakdown_gb"]["activations"] / before["plan"]["micro_batch"]
        v = (after["memory_breakdown_gb"]["activations"] / after["plan"]["micro_batch"]) / ab if ab > 0 else None
        out["compute_ratio"] = compute_per_token(ta, after["tokens_per_step"]) / compute_per_token(
            tb, before["tokens_per_step"])
    else:
        v = after["tokens_per_s"] / before["tokens_per_s"] if before["tokens_per_s"] > 0 else None
    out["ours"] = v
    return out


def ours_text(c: dict[str, Any]) -> str:
    """Our value of a rung's claim as the CLI and the report print it, named by its metric:
    "15.17x compute/token", "43% -> 97% real tokens", "0.08x activations/seq, compute +30%"."""
    if c.get("ours") is None:
        return "-"
    text = fmt_value(c["ours"], c["unit"])
    if c.get("before") is not None:
        text = f"{fmt_value(c['before'], c['unit'])} -> {text}"
    # a ladder.json written before "short" existed: the metric names it
    short = c.get("short") or next((v.short for v in CLAIMS.values() if v.metric == c.get("metric")), "")
    text += f" {short}" if short else ""
    if c.get("compute_ratio") is not None:
        text += f", compute {c['compute_ratio'] - 1:+.0%}"
    return text


def fmt_value(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    return f"{value:.0%}" if unit == "%" else f"{value:.2f}x"


def summary(est: Estimate) -> dict[str, Any]:
    """The parts of an estimate a rung shows."""
    t = est.time.to_dict()
    return {"feasible": est.feasible, "reasons": list(est.reasons), "step_time_s": est.step_time_s,
            "time_breakdown_s": t, "comm_share": comm_share(t, est.step_time_s),
            "peak_memory_gb": est.peak_memory_gb, "capacity_gb": est.capacity_bytes / 1e9,
            "memory_breakdown_gb": est.stage_memory[est.peak_stage].to_gb(), "mfu": est.mfu}
