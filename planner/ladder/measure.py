"""`planner ladder --measure`: every rung that runs here, run with the executor.

Like `planner verify` (planner/runtime/train/verify.py): every rung reads the same document stream
from its start (same seed, same corpus); a static (padded) rung runs `steps` steps, a dynamic
(packed) rung as many as it needs to train on at least the baseline's real tokens. Each rung
gets its own run directory under RUN_DIR/ladder/NN-technique/. A rung that cannot run here
says why: it does not fit (the cost model's reason), DeepSpeed would run it exactly as the
rung before (planner.ladder.techniques.inert), the machine lacks its devices, memory or cores
(planner.runtime.preflight.checks), or the run failed (the executor's one line).
"""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any, Callable

from planner.errors import PlannerError
from planner.specs.model import ModelSpec
from planner.specs.cluster import ClusterSpec
from planner.specs.plan import Plan
from planner.specs.train import TrainSpec

LADDER_DIR = "ladder"


def _claim(technique: str, m: dict[str, Any], prev: dict[str, Any]) -> str:
    """The measured counterpart of the article's figure, in words."""
    if technique == "batching":
        return f"{prev['real_share']:.0%} -> {m['real_share']:.0%} real tokens"
    if technique == "zero" and prev.get("optimizer_gb") and m.get("optimizer_gb"):
        return f"{m['optimizer_gb'] / prev['optimizer_gb']:.2f}x optimizer states"
    if technique == "recompute":
        return f"{m['peak_memory_gb'] / prev['peak_memory_gb']:.2f}x peak memory, {m['gain']:.2f}x tokens/s"
    return f"{m['gain']:.2f}x tokens/s (whole step)"


def optimizer_gb(metrics: dict[str, Any]) -> float | None:
    """The most optimizer-state GB a rank holds, on the device or offloaded: the "optimizer" class
    of metrics.json's model states (Adam's moments and the fp32 master weights: what the
    article's 3N -> 1.5N and the cost model's "optimizer" count; planner.runtime.observe.measure
    storage_class). ZeRO-3's reduce bucket is a bucket, the flat gradient partition a gradient."""
    return states_gb(metrics).get("optimizer") or None


def states_gb(metrics: dict[str, Any]) -> dict[str, float]:
    """Per class (the estimate's: params, grads, optimizer, buckets, other), the most GB a rank
    holds on the device or offloaded, as metrics.json's model_state_breakdown_gb_per_rank."""
    dev = metrics.get("model_state_breakdown_gb_per_rank") or []
    host = metrics.get("host_model_state_breakdown_gb_per_rank") or [{} for _ in dev]
    out: dict[str, float] = {}
    for d, h in zip(dev, host):
        for k, v in d.items():
            out[k] = max(out.get(k, 0.0), v + h.get(k, 0.0))
    return out


def measure(run_dir: str | Path, ladder: dict[str, Any], model: ModelSpec, cluster: ClusterSpec,
            train: TrainSpec, doc: dict[str, Any], *, steps: int = 6, warmup: int = 2, timeout: float = 600.0,
            seed: int = 1234, data: str = "", tokenizer: str = "",
            echo: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Adds "measured" to every legal rung of `ladder` (in place) and "measured_ratio" to the
    ladder when both the baseline and the last rung ran; returns the ladder."""
    from planner import dsconfig
    from planner.runtime.preflight import checks as preflight
    from planner.data.corpus import DataSpec
    from planner.data.batching import Layout, Rows, batches_for_tokens, padding_stats
    from planner.cost import estimate
    from planner.runtime.train.launch import run_plan
    from planner.runtime.train.verify import prepare_run_dir

    from planner.runtime.preflight.lab import check_run_dir
    run = Path(run_dir).resolve()
    check_run_dir(run, tuple(dict.fromkeys(["fp32"] + [r["plan"]["precision"] for r in ladder["rungs"]
                                                         if "illegal" not in r])))  # before any rung runs
    root = run / LADDER_DIR
    spec = DataSpec(seq_len=train.seq_len, vocab=model.vocab, seed=seed, token_file=data, tokenizer=tokenizer)
    legal = [r for r in ladder["rungs"] if "illegal" not in r]
    base = Plan.from_dict(legal[0]["plan"])
    breal, _ = padding_stats(Rows(spec, "static"), Layout(base.micro_batch, base.grad_accum, base.dp), steps)
    shutil.rmtree(root, ignore_errors=True)
    prev_m: dict[str, Any] | None = None
    for r in legal:
        plan = Plan.from_dict(r["plan"])
        rtrain = dataclasses.replace(train, global_batch=r["global_batch"], precision=plan.precision)
        name = f"{r['index']:02d}-{r['technique']}"
        why = ""
        if not r["feasible"]:
            why = f"does not fit: {r['reasons'][0] if r['reasons'] else 'the cost model says so'}"
        elif r.get("inert"):
            why = f"DeepSpeed runs it as the rung before: {r['inert']}"
        else:
            try:
                preflight.check(root / name, plan, model, cluster, rtrain, doc)
            except PlannerError as exc:
                why = f"cannot run here: {exc.problem}"
        if why:
            r["measured"] = {"not_run": why}
            echo(f"rung {r['index']} ({r['technique']}): not run, {why}")
            continue
        rdir = root / name
        prepare_run_dir(rdir, plan, model, cluster, rtrain, doc["inputs"], estimate(model, cluster, rtrain, plan),
                        dsconfig.ds_config(plan, model, rtrain, cluster), command="planner ladder --measure")
        n = steps
        if r["batching"] == "dynamic":
            n = max(batches_for_tokens(Rows(spec, "dynamic"), Layout(plan.micro_batch, plan.grad_accum, plan.dp), breal),
                    warmup + 2)
        echo(f"rung {r['index']} ({r['technique']}): {plan.describe()}, {r['batching']} batches, {n} steps")
        try:
            got = run_plan(rdir, steps=n, warmup=warmup, timeout=timeout, batching=r["batching"], seed=seed,
                           data=data, tokenizer=tokenizer)
        except PlannerError as exc:
            r["measured"] = {"not_run": f"the run failed: {exc.line()}"}
            echo(f"rung {r['index']} ({r['technique']}): {r['measured']['not_run']}")
            continue
        real, pad = got.get("real_tokens") or 0, got.get("padding_tokens") or 0
        m = {"tokens_per_s": got.get("tokens_per_s"), "peak_memory_gb": got.get("peak_memory_gb"),
             "allocated_peak_gb": got.get("allocated_peak_gb"),
             "step_time_s": got.get("step_time_s"), "steps": n, "dir": str(rdir.relative_to(run)),
             "real_share": real / (real + pad) if real + pad else None,
             "model_state_gb": max(got.get("model_state_gb_per_rank") or [0.0]) or None,
             "optimizer_gb": optimizer_gb(got), "model_states_gb": states_gb(got)}
        if prev_m is not None and m["tokens_per_s"] and prev_m.get("tokens_per_s"):
            m["gain"] = m["tokens_per_s"] / prev_m["tokens_per_s"]
            m["memory_ratio"] = m["peak_memory_gb"] / prev_m["peak_memory_gb"]
            m["over"] = prev_m["index"]
            m["claim"] = _claim(r["technique"], m, prev_m)
        m["index"] = r["index"]
        r["measured"] = m
        echo(f"rung {r['index']} ({r['technique']}): measured {m['tokens_per_s']:,.0f} tokens/s, "
             f"{m['peak_memory_gb']:.3f} GB peak (predicted {r['tokens_per_s']:,.0f}, {r['peak_memory_gb']:.3f})")
        prev_m = m
    first, last = legal[0].get("measured") or {}, legal[-1].get("measured") or {}
    if first.get("tokens_per_s") and last.get("tokens_per_s"):
        ladder["measured_ratio"] = {"throughput": last["tokens_per_s"] / first["tokens_per_s"],
                                    "memory": last["peak_memory_gb"] / first["peak_memory_gb"],
                                    "allocated": (last["allocated_peak_gb"] / first["allocated_peak_gb"]
                                                  if last.get("allocated_peak_gb") and first.get("allocated_peak_gb")
                                                  else None)}
    return ladder
