"""`planner verify`: the conventional baseline and the planned plan, run back to back.

Baseline (DESIGN/issue 3): fp32, plain DP over every device, ZeRO-0, no recompute, padded
static batches, the largest micro-batch the cost model says fits
(planner.search.baseline.conventional_baseline). Planned: the run directory's plan and
ds_config.json as written, with packed (dynamic) batches. Both read the same document stream
on the same machine; the planned run takes as many steps as it needs to train on at least
the baseline's real tokens. Each run gets its own directory under <run>/verify/.
"""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any, Callable

from planner import dsconfig
from planner.errors import ExecutionError
from planner.executor.data import DataSpec, Layout, Rows, batches_for_tokens, padding_stats
from planner.executor.launch import check_counts, run_plan
from planner.rundir import atomic_write_json, load_run, plan_document, read_json

TARGET_THROUGHPUT = 3.0
TARGET_MEMORY_REDUCTION = 1 / 3


def memory_change(ratio: float) -> str:
    """A memory ratio in words: 0.88 -> "12% less", 1.12 -> "12% more" (never "-12% reduction")."""
    change = 1 - ratio
    if round(100 * change) == 0:
        return "about the same"
    return f"{abs(change):.0%} {'less' if change > 0 else 'more'}"


def _estimate(model, cluster, train, plan):
    from planner.cost import estimate
    return estimate(model, cluster, train, plan)


def prepare_run_dir(vdir: Path, plan, model, cluster, train, doc_inputs: dict, est, cfg: dict,
                    command: str = "planner verify") -> None:
    """A fresh run directory for one comparison run (verify's baseline and plan, the ladder's
    rungs): plan.json with the run's inputs, estimate.json and ds_config.json."""
    shutil.rmtree(vdir, ignore_errors=True)
    d = plan_document(plan, model, cluster, train, scale=doc_inputs.get("scale"),
                      model_arg=doc_inputs.get("model_arg", ""), command=command)
    atomic_write_json(vdir / "plan.json", d)
    atomic_write_json(vdir / "estimate.json", {"plan": plan.to_dict(), "estimate": est.to_json()})
    atomic_write_json(vdir / "ds_config.json", cfg)


def verify(run_dir: str | Path, *, steps: int = 12, warmup: int = 2, timeout: float = 900.0, seed: int = 1234,
           data: str = "", tokenizer: str = "", echo: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    run = Path(run_dir).resolve()
    check_counts(steps, warmup, timeout)
    plan, model, cluster, train, doc = load_run(run)
    from planner.search.baseline import TARGETS_SOURCE, baseline_train, conventional_baseline
    bplan, best = conventional_baseline(model, cluster, train, precision="fp32")
    if not best.feasible:
        raise ExecutionError("baseline", f"the conventional baseline does not fit: {'; '.join(best.reasons)}",
                             "verify on a smaller --scale or a larger cluster")
    btrain = dataclasses.replace(baseline_train(cluster, train), precision="fp32")   # its (legal) global batch
    pest = _estimate(model, cluster, train, plan)
    planned_cfg = read_json(run / "ds_config.json", "ds_config.json") if (run / "ds_config.json").exists() \
        else dsconfig.ds_config(plan, model, train, cluster)
    prepare_run_dir(run / "verify" / "baseline", bplan, model, cluster, btrain, doc["inputs"], best,
             dsconfig.ds_config(bplan, model, btrain, cluster))
    prepare_run_dir(run / "verify" / "planned", plan, model, cluster, train, doc["inputs"], pest, planned_cfg)

    spec = DataSpec(seq_len=train.seq_len, vocab=model.vocab, seed=seed, token_file=data, tokenizer=tokenizer)
    brows, prows = Rows(spec, "static"), Rows(spec, "dynamic")
    blay, play = Layout(bplan.micro_batch, bplan.grad_accum, bplan.dp), Layout(plan.micro_batch, plan.grad_accum, plan.dp)
    breal, bpad = padding_stats(brows, blay, steps)
    psteps = max(batches_for_tokens(prows, play, breal), warmup + 2)
    preal, ppad = padding_stats(prows, play, psteps)
    echo(f"baseline: {bplan.describe()}, static padded batches, {steps} steps, {breal} real tokens "
         f"({bpad / (breal + bpad):.0%} padding)")
    echo(f"planned:  {plan.describe()}, packed batches, {psteps} steps, {preal} real tokens "
         f"({ppad / (preal + ppad):.0%} padding)")
    base = run_plan(run / "verify" / "baseline", steps=steps, warmup=warmup, timeout=timeout, batching="static",
                    seed=seed, data=data, tokenizer=tokenizer, echo=echo)
    planned = run_plan(run / "verify" / "planned", steps=psteps, warmup=warmup, timeout=timeout,
                       batching="dynamic", seed=seed, data=data, tokenizer=tokenizer, echo=echo)
    measured = {"throughput_ratio": planned["tokens_per_s"] / base["tokens_per_s"],
                "memory_ratio": planned["peak_memory_gb"] / base["peak_memory_gb"],
                "model_state_ratio": max(planned["model_state_gb_per_rank"]) / max(base["model_state_gb_per_rank"])}
    # the cost model predicts all-token throughput; real tokens = (1 - padding) of them
    pb, pp = 1 - bpad / (breal + bpad), 1 - ppad / (preal + ppad)
    predicted = {"throughput_ratio": (pest.tokens_per_s * pp) / (best.tokens_per_s * pb),
                 "memory_ratio": pest.peak_memory_gb / best.peak_memory_gb}
    met = {"throughput_ratio": measured["throughput_ratio"] >= TARGET_THROUGHPUT,
           "memory_reduction": 1 - measured["memory_ratio"] >= TARGET_MEMORY_REDUCTION}
    lines = [
        f"throughput: measured {measured['throughput_ratio']:.2f}x (predicted {predicted['throughput_ratio']:.2f}x), "
        f"target {TARGET_THROUGHPUT:.0f}x (the article's 12,000 -> 36,000 tokens/s): "
        + ("met" if met["throughput_ratio"] else f"MISSED by {TARGET_THROUGHPUT - measured['throughput_ratio']:.2f}x"),
        f"peak memory: measured {measured['memory_ratio']:.2f}x of baseline, "
        f"{memory_change(measured['memory_ratio'])} (predicted {predicted['memory_ratio']:.2f}x), target "
        f"33% less (the article's 48 -> 32 GB per GPU): " + ("met" if met["memory_reduction"] else
        f"MISSED by {100 * (TARGET_MEMORY_REDUCTION - (1 - measured['memory_ratio'])):.0f} percentage points"),
        f"model states alone: {measured['model_state_ratio']:.2f}x of baseline",
        f"targets from {TARGETS_SOURCE}; baseline here: {bplan.describe()}, padded static batches",
    ]
    out = {"baseline": base, "planned": planned, "measured": measured, "predicted": predicted,
           "targets": {"throughput_ratio": TARGET_THROUGHPUT, "memory_reduction": round(TARGET_MEMORY_REDUCTION, 3)},
           "met": met, "summary": "; ".join(lines)}
    atomic_write_json(run / "verify.json", out)
    for ln in lines:
        echo(ln)
    return out
