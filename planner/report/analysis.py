"""What the page says, computed from the run directory: headline numbers, the top-plans
table with each plan's DeepSpeed knobs and why it lost, the Pareto front, reason classes."""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import numpy as np
import pandas as pd

from planner.errors import PlannerError
from planner.report.data import PLAN_FIELDS, RunData
from planner.report.plan_text import (headroom_gb, headroom_text, host_memory, memory_flag, option_labels,
                                      short_variants)
from planner.specs.estimate import GB
from planner.specs import MemoryBreakdown, Plan, TimeBreakdown
from planner.specs.estimate import MEMORY_LABELS, TIME_LABELS as TIME_BREAKDOWN_LABELS
from planner.specs.problems import MEMORY
from planner.search.trials import plan_from_row as trials_plan_from_row
from planner import dsconfig
from planner.specs.cluster import ClusterSpec
from planner.specs.knobs import KNOBS
from planner.specs.model import ModelSpec
from planner.specs.train import TrainSpec

TIME_PARTS = [f.name for f in dataclasses.fields(TimeBreakdown)]
MEM_PARTS = [f.name for f in dataclasses.fields(MemoryBreakdown)]
TIME_LABELS = TIME_BREAKDOWN_LABELS
MEM_LABELS = MEMORY_LABELS
DEFAULT_TARGETS = {"throughput_ratio": 3.0, "memory_reduction": 0.333}
"""docs/CONTRACTS.md verify.json "targets" (the 3x / one-third-less-memory claims)."""
TOKENS_PER_PARAM = 20
"""Default training length: ~20 tokens per parameter, the compute-optimal ratio of
Hoffmann et al. 2022 ("Chinchilla", arXiv 2203.15556, Table 3)."""


def plan_from_row(row: pd.Series | dict[str, Any]) -> Plan | None:
    """A trials.csv row as a Plan (planner.search.trials.plan_from_row), or None if it is not one."""
    try:
        return trials_plan_from_row(row)
    except (PlannerError, TypeError, ValueError):
        return None


def short_label(plan: Plan) -> str:
    """Two short lines for a figure: "TP4·PP8·DP2" and "Z1 mb1 sel-rc"."""
    rc = {"none": "", "selective": " sel-rc", "full": " full-rc"}[plan.recompute]
    extra = (" SP" if plan.sequence_parallel else "") + (f" v{plan.interleave}" if plan.interleave > 1 else "")
    extra += (f" EP{plan.ep}" if plan.ep > 1 else "") + (f" {plan.cp_kind[0].upper()}CP{plan.cp}" if plan.cp > 1 else "")
    extra += "".join(f" {v}" for v in option_labels(plan))
    return f"TP{plan.tp}·PP{plan.pp}·DP{plan.dp}\nZ{plan.zero} mb{plan.micro_batch}{rc}{extra}"


def pareto_mask(memory: np.ndarray, throughput: np.ndarray) -> np.ndarray:
    """True for points no other point beats on both axes (less memory, more throughput)."""
    n = len(memory)
    mask = np.zeros(n, dtype=bool)
    if n == 0:
        return mask
    order = np.lexsort((-throughput, memory))          # memory ascending, throughput descending
    best = -np.inf
    for i in order:
        if throughput[i] > best:
            mask[i] = True
            best = throughput[i]
    return mask


_NUM = re.compile(r"\d+(?:\.\d+)?")


def reason_category(reason: str, code: str = "") -> str:
    """A short class for an infeasibility reason, so thousands of reasons become a legend.

    By the problem's code (trials.csv reason_code, planner/specs/problems.py): memory problems
    ("memory:activations") are classed by what dominates; the others by the statement with its
    numbers taken out (the table of reasons keeps the detail)."""
    text = (reason or "").strip()
    if not text:
        return "infeasible (no reason given)"
    code = (code or "").split(";")[0].strip()
    if code == MEMORY or code.startswith(MEMORY + ":"):
        part = code.partition(":")[2]
        return f"out of memory ({MEMORY_LABELS[part]})" if part in MEMORY_LABELS else "out of memory"
    first = text.split(";")[0].strip()
    # the statement without its parenthetical detail, never cut mid-word: the legend wraps it
    return _NUM.sub("#", first.split(" (", 1)[0].strip())


def knobs(plan: Plan, model: ModelSpec, train: TrainSpec, cluster: ClusterSpec) -> list[tuple[str, str, str]]:
    """The settings a plan turns into: (short label, value, full config key). The DeepSpeed ones
    are read from the config planner/dsconfig.py writes for the plan (one row per key of
    planner/specs/knobs.py: always, or when the plan moves it off its default); the layout the
    executor builds itself (TP, sequence parallelism, stages, checkpointing) is said in words."""
    cfg = dsconfig.ds_config(plan, model, train, cluster)
    default = Plan()
    deepspeed = []
    for name, knob in KNOBS.items():
        value = _lookup(cfg, knob.ds_key) if knob.ds_key and knob.label else None
        if value is None or not (knob.always or getattr(plan, name) != getattr(default, name)):
            continue
        if isinstance(value, bool):
            text = ("on" if value else "off") if knob.always else ""
        else:
            text = _elements(value) if name.endswith("_elements") else str(value)
        deepspeed.append((name, (knob.label, text, knob.ds_key + (f" ({knob.note})" if knob.note else ""))))
    out = [row for name, row in deepspeed if name in ("zero", "micro_batch", "grad_accum")]
    out.append((plan.precision, "", f"{plan.precision}.enabled" if plan.precision != "fp32"
                else "fp32 (no bf16/fp16 block)"))
    layers = model.layers
    if plan.tp > 1:
        # not a DeepSpeed key: the executor's own Megatron-style layers (docs/runtime.md)
        out.append(("tp", str(plan.tp), "tensor parallel degree: Megatron-style layers in planner/model/parallel"))
    if plan.sequence_parallel:
        out.append(("seq-parallel", "", "Megatron sequence parallelism in the TP group"))
    if plan.pp > 1:
        parts = "/".join(str(n) for n in plan.layers_per_stage(layers))
        out.append(("stages", parts, f"PipelineModule(num_stages={plan.pp}), blocks per stage"))
    if plan.schedule == "interleaved":
        out.append(("chunks", str(plan.interleave), "interleaved virtual stages per pipeline stage"))
    if plan.recompute == "full":
        ck = plan.checkpointed_per_stage(layers)
        out.append(("ckpt", f"{sum(ck)}/{layers}", "activation checkpointing: full recompute of these blocks"))
    elif plan.recompute == "selective":
        out.append(("ckpt", "selective", "activation checkpointing of the attention core only"))
    return out + [row for name, row in deepspeed if name not in ("zero", "micro_batch", "grad_accum")]


def _lookup(cfg: dict[str, Any], key: str) -> Any:
    """cfg at a dotted key, or None where the config has no such entry."""
    for part in key.split("."):
        if not isinstance(cfg, dict) or part not in cfg:
            return None
        cfg = cfg[part]
    return cfg


def _elements(n: int) -> str:
    """50000000 -> "5e7"."""
    return f"{n:.0e}".replace("e+0", "e").replace("e+", "e")


def why_lost(row: pd.Series, winner: dict[str, Any]) -> str:
    """One line: how a plan compares with the chosen one (winner = estimate.json estimate)."""
    if not bool(row.get("feasible", True)):
        return str(row.get("reason") or "infeasible")
    w_tps, tps = winner.get("tokens_per_s", math.nan), row.get("tokens_per_s", math.nan)
    w_mem, mem = winner.get("peak_memory_gb", math.nan), row.get("peak_memory_gb", math.nan)
    if not (w_tps > 0 and tps == tps):
        return "no estimate to compare"
    rel = (w_tps - tps) / w_tps
    extra_mem = mem - w_mem
    mem_text = ("same memory" if not abs(extra_mem) >= 0.05 else
                f"{abs(extra_mem):.1f} GB {'more' if extra_mem > 0 else 'less'} per GPU")
    if rel > 5e-4:
        w_time = winner.get("time_breakdown_s", {})
        diffs = [(row.get(f"time_{p}", math.nan) - w_time.get(p, math.nan), p) for p in TIME_PARTS]
        diffs = sorted(((d, p) for d, p in diffs if d == d and d > 0), reverse=True)
        step = row.get("step_time_s", math.nan) - winner.get("step_time_s", math.nan)
        causes = ", ".join(f"{TIME_LABELS[p]} +{_secs(d)}" for d, p in diffs[:2] if step != step or d >= 0.05 * step)
        return f"{rel:.1%} slower" + (f": {causes}" if causes else "") + f"; {mem_text}"
    if rel < -5e-4:
        return f"{-rel:.1%} faster in the estimate but not chosen; {mem_text}"
    return f"as fast; {mem_text}"


def _secs(x: float) -> str:
    return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"


def top_plans(run: RunData, n: int = 10) -> pd.DataFrame:
    """The n fastest distinct feasible plans (chosen first if it is among them), then the
    baseline row, each with its description, knobs and why it lost to the chosen plan."""
    df = run.trials
    if df is None or df.empty:
        return pd.DataFrame()
    present = [f for f in PLAN_FIELDS if f in df.columns]
    ok = df[df["feasible"] & df["tokens_per_s"].notna()]
    ok = ok[ok["source"] != "baseline"] if "source" in ok.columns else ok
    ok = ok.sort_values(["tokens_per_s", "trial"], ascending=[False, True]).drop_duplicates(present).head(n)
    base = df[df["source"] == "baseline"].head(1) if "source" in df.columns else df.iloc[:0]
    chosen_key = tuple(str(run.plan.to_dict()[f] if not isinstance(run.plan.to_dict()[f], list)
                           else ";".join(map(str, run.plan.to_dict()[f]))) for f in present)
    usable, headroom = run.cluster.usable_bytes, headroom_gb(run.cluster, run.estimate)
    rows = []
    for kind, frame in (("plan", ok), ("baseline", base)):
        for _, r in frame.iterrows():
            plan = plan_from_row(r)
            key = tuple(str(r[f]) for f in present)
            chosen = key == chosen_key or (plan is not None and plan == run.plan)
            rows.append({
                "trial": int(r["trial"]), "source": str(r.get("source", "")), "kind": kind, "chosen": chosen,
                "plan": plan.describe() if plan is not None else "(unreadable plan)",
                "short": short_label(plan) if plan is not None else "?",
                "plan_dict": plan.to_dict() if plan is not None else None,
                "tokens_per_s": r["tokens_per_s"], "step_time_s": r.get("step_time_s", math.nan),
                "mfu": r.get("mfu", math.nan), "peak_memory_gb": r["peak_memory_gb"],
                "capacity_gb": r.get("capacity_gb", math.nan), "bubble_fraction": r.get("bubble_fraction", math.nan),
                "knobs": knobs(plan, run.model, run.train, run.cluster) if plan is not None else [],
                "why": "chosen plan" if chosen else why_lost(r, run.estimate),
                "time": {p: r.get(f"time_{p}", math.nan) for p in TIME_PARTS},
                "mem": {p: r.get(f"mem_{p}", math.nan) for p in MEM_PARTS},
                "memory_flag": _flag(r["peak_memory_gb"], usable, headroom),
                "variants": list(short_variants(plan)) if plan is not None else [],
            })
    out = pd.DataFrame(rows)
    if not out.empty:
        plans = out["kind"] == "plan"
        out["rank"] = out["tokens_per_s"].where(plans).rank(ascending=False, method="min")
    return out


def _flag(peak_gb: Any, usable_bytes: float, headroom: float | None) -> dict[str, Any] | None:
    """{"short", "text"} for a plan near (or over) the usable memory, None otherwise."""
    peak = peak_gb * GB if isinstance(peak_gb, (int, float)) and not isinstance(peak_gb, bool) else None
    flag = memory_flag(peak, usable_bytes, headroom)
    return {"short": flag.short, "text": flag.text(), "over": flag.over} if flag else None


def train_cost(tokens_per_s: float | None, world: int, tokens: float, price: float | None) -> dict[str, Any]:
    if not tokens_per_s or tokens_per_s != tokens_per_s or tokens_per_s <= 0:
        return {"time_s": None, "gpu_hours": None, "cost": None}
    seconds = tokens / tokens_per_s
    gpu_hours = seconds / 3600 * world
    return {"time_s": seconds, "gpu_hours": gpu_hours, "cost": gpu_hours * price if price is not None else None}


def headline(run: RunData, price_per_gpu_hour: float | None, train_tokens: float | None) -> dict[str, Any]:
    est = run.estimate
    world = run.plan.world_size
    bill = run.bill or {}
    bill_price = (bill.get("price") or {}).get("usd_per_gpu_hour") if isinstance(bill.get("price"), dict) else None
    if price_per_gpu_hour is None and isinstance(bill_price, (int, float)):
        price_per_gpu_hour = float(bill_price)          # the search's price (estimate.json "bill")
    if train_tokens:
        tokens, tokens_note = float(train_tokens), "--train-tokens"
    elif isinstance(bill.get("tokens"), (int, float)) and bill["tokens"] > 0:
        tokens, tokens_note = float(bill["tokens"]), str(bill.get("tokens_note") or "--tokens")
    else:
        tokens = float(TOKENS_PER_PARAM * run.model.params)
        tokens_note = f"default: {TOKENS_PER_PARAM} tokens per parameter (Hoffmann et al. 2022)"
    out: dict[str, Any] = {
        "description": run.doc.get("description") or run.plan.describe(), "world": world,
        "tokens_per_s": est.get("tokens_per_s"), "step_time_s": est.get("step_time_s"), "mfu": est.get("mfu"),
        "hfu": est.get("hfu"), "tflops": est.get("tflops_per_gpu"), "peak_memory_gb": est.get("peak_memory_gb"),
        "capacity_gb": est.get("capacity_gb"), "feasible": est.get("feasible", True),
        "reasons": list(est.get("reasons", [])), "bubble_fraction": est.get("bubble_fraction"),
        "train_tokens": tokens, "train_tokens_note": tokens_note, "price": price_per_gpu_hour,
        "train": train_cost(est.get("tokens_per_s"), world, tokens, price_per_gpu_hour),
    }
    cap = est.get("capacity_gb") or math.nan
    out["memory_fraction"] = (est.get("peak_memory_gb") or math.nan) / cap if cap else math.nan
    c = run.cluster
    out["usable_gb"] = c.usable_bytes / GB
    headroom = headroom_gb(c, est)
    out["headroom"] = headroom_text(headroom)
    out["memory_flag"] = _flag(est.get("peak_memory_gb"), c.usable_bytes, headroom)
    out["variants"] = list(run.plan.variants)
    out["host_memory"] = host_memory(est, c.gpus_per_node, c.host.cpu_memory_gb)
    out["host"] = c.host
    targets = dict(DEFAULT_TARGETS)
    if run.verify and isinstance(run.verify.get("targets"), dict):
        targets.update({k: v for k, v in run.verify["targets"].items() if isinstance(v, (int, float))})
    out["targets"] = targets
    from planner.search.baseline import TARGETS_SOURCE
    out["targets_source"] = TARGETS_SOURCE
    out["baseline"] = _baseline(run, tokens, price_per_gpu_hour, targets)
    out["measured_ratios"] = _measured_ratios(run.verify, targets)
    return out


def _baseline(run: RunData, tokens: float, price: float | None, targets: dict[str, float]) -> dict[str, Any] | None:
    b = run.baseline
    if not b:
        return None
    try:
        plan = Plan.from_dict(b.get("plan", {}))
        desc = plan.describe()
        world = plan.world_size
    except PlannerError:
        desc, world = "(unreadable baseline plan)", run.plan.world_size
    est = b.get("estimate") if isinstance(b.get("estimate"), dict) else {}
    fits = b.get("fits") is not False and bool(est) and est.get("feasible", True) is not False
    needs = b.get("needs_gb", est.get("peak_memory_gb"))
    reasons = b.get("reasons") if isinstance(b.get("reasons"), list) else est.get("reasons", []) if est else []
    out: dict[str, Any] = {"description": desc, "fits": fits, "needs_gb": needs, "reasons": [str(r) for r in reasons],
                           "note": str(b.get("note") or ""), "precision": plan.precision if desc[0] != "(" else "",
                           "tokens_per_s": est.get("tokens_per_s") if fits else None,
                           "step_time_s": est.get("step_time_s") if fits else None,
                           "mfu": est.get("mfu") if fits else None, "peak_memory_gb": needs,
                           "train": train_cost(est.get("tokens_per_s") if fits else None, world, tokens, price)}
    plan_tps, plan_mem = run.estimate.get("tokens_per_s"), run.estimate.get("peak_memory_gb")
    tr = plan_tps / out["tokens_per_s"] if fits and out["tokens_per_s"] else None
    mr = plan_mem / needs if needs else None
    out["throughput_ratio"] = tr
    out["memory_ratio"] = mr
    out["memory_reduction"] = 1 - mr if mr is not None else None
    out["met"] = {"throughput_ratio": tr is not None and tr >= targets["throughput_ratio"],
                  "memory_reduction": mr is not None and 1 - mr >= targets["memory_reduction"]}
    return out


def _measured_ratios(verify: dict[str, Any] | None, targets: dict[str, float]) -> dict[str, Any] | None:
    if not verify or not isinstance(verify.get("measured"), dict):
        return None
    m = verify["measured"]
    tr, mr = m.get("throughput_ratio"), m.get("memory_ratio")
    num = (int, float)
    return {"throughput_ratio": tr if isinstance(tr, num) else None,
            "memory_ratio": mr if isinstance(mr, num) else None,
            "memory_reduction": 1 - mr if isinstance(mr, num) else None,
            "met": {"throughput_ratio": isinstance(tr, num) and tr >= targets["throughput_ratio"],
                    "memory_reduction": isinstance(mr, num) and 1 - mr >= targets["memory_reduction"]},
            "summary": str(verify.get("summary", ""))}
