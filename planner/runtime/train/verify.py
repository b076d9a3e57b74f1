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
from planner.data.corpus import DataSpec
from planner.data.batching import Layout, Rows, batches_for_tokens, padding_stats
from planner.runtime.preflight.lab import check_run_dir
from planner.runtime.train.launch import check_counts, run_plan
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
    check_inputs(run)
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
    # memory as a GPU counts it: live tensor bytes (allocated); peak RSS beside it (CPU)
    measured = {"throughput_ratio": planned["tokens_per_s"] / base["tokens_per_s"],
                "memory_ratio": _ratio(planned.get("allocated_peak_gb"), base.get("allocated_peak_gb")),
                "rss_ratio": _ratio(_rss(planned), _rss(base)),
                "model_state_ratio": max(planned["model_state_gb_per_rank"]) / max(base["model_state_gb_per_rank"]),
                "model_states_by_class": class_ratios(planned, base)}
    # the cost model predicts all-token throughput; real tokens = (1 - padding) of them
    pb, pp = 1 - bpad / (breal + bpad), 1 - ppad / (preal + ppad)
    predicted = {"throughput_ratio": (pest.tokens_per_s * pp) / (best.tokens_per_s * pb),
                 "memory_ratio": _ratio(pest.allocated_peak_bytes, best.allocated_peak_bytes),
                 "rss_ratio": pest.peak_memory_gb / best.peak_memory_gb if base.get("device") == "cpu" else None,
                 "model_states_by_class": class_ratios(planned.get("predicted") or {}, base.get("predicted") or {})}
    met = {"throughput_ratio": measured["throughput_ratio"] >= TARGET_THROUGHPUT,
           "memory_reduction": measured["memory_ratio"] is not None
           and 1 - measured["memory_ratio"] >= TARGET_MEMORY_REDUCTION,
           "rss_reduction": None if measured["rss_ratio"] is None
           else 1 - measured["rss_ratio"] >= TARGET_MEMORY_REDUCTION}
    lines = [
        f"throughput: measured {measured['throughput_ratio']:.2f}x (predicted {predicted['throughput_ratio']:.2f}x), "
        f"target {TARGET_THROUGHPUT:.0f}x (the article's 12,000 -> 36,000 tokens/s): "
        + ("met" if met["throughput_ratio"] else f"MISSED by {TARGET_THROUGHPUT - measured['throughput_ratio']:.2f}x"),
        _memory_line("peak allocated memory (what a GPU counts; the target is judged on it)",
                     measured["memory_ratio"], predicted["memory_ratio"], met["memory_reduction"]),
    ]
    if measured["rss_ratio"] is not None:
        lines.append(_memory_line("peak RSS (shown, not judged: the process's own memory does not shrink)",
                                  measured["rss_ratio"], predicted["rss_ratio"], met["rss_reduction"]))
    lines += [
        "model states by class, planned / baseline: " + ", ".join(
            f"{k} {v['measured']:.2f}x (predicted {v['predicted']:.2f}x)" if v["predicted"] is not None
            else f"{k} {v['measured']:.2f}x" for k, v in _merge(measured, predicted).items()),
        f"targets from {TARGETS_SOURCE}; baseline here: {bplan.describe()}, padded static batches",
    ]
    out = {"baseline": base, "planned": planned, "measured": measured, "predicted": predicted,
           "targets": {"throughput_ratio": TARGET_THROUGHPUT, "memory_reduction": round(TARGET_MEMORY_REDUCTION, 3)},
           "met": met, "summary": "; ".join(lines)}
    atomic_write_json(run / "verify.json", out)
    for ln in lines:
        echo(ln)
    return out


def check_inputs(run: Path) -> None:
    """The run directory's profile serves both predictions (planner.runtime.preflight.lab): before
    load_run, which falls back to a built-in profile when the named one is not here."""
    check_run_dir(Path(run), ("fp32", _precision(Path(run))))  # the baseline runs in fp32


def _precision(run: Path) -> str:
    """The plan's precision as plan.json records it (load_run reports an unreadable one)."""
    try:
        return str(read_json(run / "plan.json", "plan.json")["plan"].get("precision", "bf16"))
    except Exception:  # noqa: BLE001 -- load_run says what is wrong with plan.json
        return "bf16"


def _rss(metrics: dict) -> float | None:
    """Peak RSS in GB (a CPU run's peak_memory_gb; a GPU run reports max_memory_allocated there)."""
    return metrics["peak_memory_gb"] if metrics.get("device") == "cpu" else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _memory_line(what: str, measured: float | None, predicted: float | None, met: bool | None) -> str:
    if measured is None:
        return f"{what}: not measured (metrics.json has no such figure: rerun with this planner)"
    pred = f" (predicted {predicted:.2f}x)" if predicted is not None else ""
    return (f"{what}: measured {measured:.2f}x of baseline, {memory_change(measured)}{pred}, target 33% less "
            "(the article's 48 -> 32 GB per GPU): " + ("met" if met else
            f"MISSED by {100 * (TARGET_MEMORY_REDUCTION - (1 - measured)):.0f} percentage points"))


def class_ratios(planned: dict, base: dict) -> dict[str, float]:
    """planned / baseline of the largest rank's model-state bytes per class (metrics.json's
    model_state_breakdown_gb_per_rank, measured or predicted), device plus host; a class both
    runs hold none of is left out."""
    def per_class(m: dict) -> dict[str, float]:
        out: dict[str, float] = {}
        for key in ("model_state_breakdown_gb_per_rank", "host_model_state_breakdown_gb_per_rank"):
            for r, by in enumerate(m.get(key) or []):
                for k, v in by.items():
                    out[(k, r)] = out.get((k, r), 0.0) + v
        best: dict[str, float] = {}
        for (k, _), v in out.items():
            best[k] = max(best.get(k, 0.0), v)
        return best
    p, b = per_class(planned), per_class(base)
    return {k: p.get(k, 0.0) / b[k] for k in b if b[k] > 0}


def _merge(measured: dict, predicted: dict) -> dict[str, dict]:
    mp = predicted.get("model_states_by_class") or {}
    return {k: {"measured": v, "predicted": mp.get(k)} for k, v in measured["model_states_by_class"].items()}
