"""metrics.json (docs/CONTRACTS.md): measured figures beside the estimate's predictions."""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from planner.calibrate.accuracy import rel_error
from planner.runtime.files import RANKS_DIR
from planner.specs.estimate import GB

VERSION = 2
"""2: model states by the estimate's classes (params, grads, optimizer, buckets, other; 1 put
buckets under optimizer), allocated peak beside peak RSS, predicted states per rank."""

SCALARS = ("step_time_s", "tokens_per_s", "peak_memory_gb", "allocated_peak_gb")


def _predicted(estimate_doc: dict) -> dict[str, float | None]:
    est = estimate_doc.get("estimate", {}) if isinstance(estimate_doc, dict) else {}
    return {k: est.get(k) for k in SCALARS}


def predicted_states(run: Path, world: int) -> list[dict[str, dict[str, float]]] | None:
    """Per rank, the model states the cost model says the executor counts, in GB by class
    (planner.cost.states.rank_states), from the run directory's plan.json; None when it cannot
    be read (a run directory from an older planner)."""
    from planner.cost.states import rank_states
    from planner.errors import PlannerError
    from planner.rundir import load_run
    try:
        plan, model, cluster, train, _ = load_run(run)
    except (PlannerError, OSError, KeyError, ValueError):
        return None
    return [{loc: {k: v / GB for k, v in by.items()} for loc, by in rank_states(model, cluster, train, plan, r).items()}
            for r in range(world)]


def state_errors(measured: list[dict[str, float]], predicted: list[dict[str, float]]) -> list[dict[str, float]]:
    """Per rank and class, predicted - measured GB (a class the cost model has no buffer for,
    such as "other", is predicted 0)."""
    return [{k: p.get(k, 0.0) - v for k, v in m.items()} for m, p in zip(measured, predicted)]


def _progress_losses(run: Path) -> list[float]:
    out: dict[int, float] = {}
    try:
        for line in (run / RANKS_DIR / "progress.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if rec.get("kind") == "step":
                out[rec["step"] - 1] = rec["loss"]
    except (OSError, json.JSONDecodeError):
        pass
    return [out[k] for k in sorted(out)]


def _base(plan, model, world: int, warmup: int, steps: int, batching: str) -> dict[str, Any]:
    return {"version": VERSION, "status": "ok", "error": None, "failed_rank": None,
            "plan": plan.to_dict(), "model": model.to_dict(), "world_size": world, "steps": steps,
            "warmup": warmup, "batching": batching}


def build_metrics(result: dict, plan, model, warmup: int, steps: int, estimate_doc: dict, run: Path) -> dict[str, Any]:
    ranks = sorted(result["ranks"], key=lambda r: r["rank"])
    per_rank = [r["step_times_s"] for r in ranks]
    # a step takes as long as its slowest rank
    step_times = [max(t[s] for t in per_rank) if all(t[s] is not None for t in per_rank) else None
                  for s in range(steps)]
    timed = [s for s in range(warmup, steps) if step_times[s] is not None]
    step_time = statistics.fmean(step_times[s] for s in timed) if timed else None
    toks = result.get("step_tokens", [])
    tokens_per_s = (sum(toks[s] for s in timed if s < len(toks)) / sum(step_times[s] for s in timed)) if timed else None
    real, pad = result["real_tokens"], result["padding_tokens"]
    peaks = [r["peak_bytes"] / GB for r in ranks]
    alloc = [r.get("allocated_peak_bytes") for r in ranks]
    alloc = [a / GB for a in alloc] if all(a is not None for a in alloc) else None
    states = [sum(r["model_state"].values()) / GB for r in ranks]
    host = [r.get("host_model_state") or {} for r in ranks]  # offloaded states (planner.runtime.observe.measure)
    predicted = _predicted(estimate_doc)
    measured = {"step_time_s": step_time, "tokens_per_s": tokens_per_s, "peak_memory_gb": max(peaks),
                "allocated_peak_gb": max(alloc) if alloc else None}
    by_class = [{k: v / GB for k, v in r["model_state"].items()} for r in ranks]
    host_by_class = [{k: v / GB for k, v in h.items()} for h in host]
    pstates = predicted_states(run, len(ranks))
    if pstates is not None:
        predicted["model_state_breakdown_gb_per_rank"] = [p["device"] for p in pstates]
        predicted["host_model_state_breakdown_gb_per_rank"] = [p["host"] for p in pstates]
    m = _base(plan, model, result["world_size"], warmup, steps, result["batching"])
    m.update({
        "device": result["device"], "step_times_s": step_times, "step_time_s": step_time,
        "step_time_std_s": statistics.pstdev(step_times[s] for s in timed) if len(timed) > 1 else 0.0,
        "tokens_per_s": tokens_per_s, "real_tokens": real, "padding_tokens": pad,
        "padding_fraction": pad / (real + pad) if real + pad else 0.0,
        "peak_memory_gb_per_rank": peaks, "peak_memory_gb": max(peaks), "memory_method": result["memory_method"],
        # CPU: peak_memory is peak RSS; allocated is live tensor bytes (a GPU's max_memory_allocated)
        "allocated_peak_gb_per_rank": alloc, "allocated_peak_gb": measured["allocated_peak_gb"],
        "allocated_method": result.get("allocated_method"),
        "allocated_steps": ranks[0].get("allocated_steps"),
        "rss_peak_gb_per_rank": peaks if result["device"] == "cpu" else None,
        "model_state_gb_per_rank": states,
        "model_state_breakdown_gb_per_rank": by_class,
        "host_model_state_gb_per_rank": [sum(h.values()) / GB for h in host],
        "host_model_state_breakdown_gb_per_rank": host_by_class,
        "model_state_error_gb_per_rank": None if pstates is None else
        state_errors(by_class, predicted["model_state_breakdown_gb_per_rank"]),
        "model_state_buffers_bytes_per_rank": [r.get("model_state_buffers") or {} for r in ranks],
        "rss_before_model_gb_per_rank": [r["rss_before_model_bytes"] / GB for r in ranks],
        "loss": result["loss"], "resumed_at": result["resumed_at"], "skipped_batches": result["skipped_batches"],
        "predicted": predicted,
        "relative_error": {k: rel_error(predicted[k], measured[k]) for k in measured},
        "events": result["events"],
        # the trainer's figures (planner/runtime/train/loop.py): the rate each step used, the schedule
        # DeepSpeed ran (its ds_config "scheduler" block), held-out losses, time in all-reduce
        "lr": result.get("lr", []), "lr_schedule": result.get("lr_schedule"),
        "eval_loss": result.get("eval_loss", []),
        "allreduce_s_per_step": result.get("allreduce_s"),
        "loader": result.get("loader"),
        "data": result.get("data"),   # the corpus it trained on (the report labels verify's runs by it)
    })
    if any(r.get("activations") is not None for r in ranks):
        # worker --measure-activations: per rank, the bytes each block ("activation_bytes_per_block",
        # keyed by global block index) and the stage's shared tensors, embedding and head keep for
        # backward in one micro-batch (planner.runtime.observe.measure.ActivationRecorder)
        m["activations_per_rank"] = [
            None if r.get("activations") is None else
            {"activation_bytes_per_block": r["activations"]["blocks"],
             **{f"{k}_bytes": r["activations"][k] for k in ("shared", "embedding", "head")}}
            for r in ranks]
    return m


def failure_metrics(run: Path, plan, model, world: int, cluster, warmup: int, steps: int, batching: str,
                    rank: int | None, cause: str) -> dict[str, Any]:
    m = _base(plan, model, world, warmup, steps, batching)
    m.update({"status": "failed", "error": f"rank {rank}: {cause}" if rank is not None else cause,
              "failed_rank": rank, "device": "cpu" if cluster.device.kind == "cpu" else "cuda",
              "loss": _progress_losses(run), "step_times_s": [], "step_time_s": None, "tokens_per_s": None,
              "peak_memory_gb_per_rank": [], "peak_memory_gb": None, "model_state_gb_per_rank": [],
              "allocated_peak_gb_per_rank": None, "allocated_peak_gb": None,
              "host_model_state_gb_per_rank": [],
              "memory_method": None, "padding_fraction": None,
              "predicted": _predicted(_read_json(run / "estimate.json")),
              "relative_error": dict.fromkeys(SCALARS),
              "events": [{"step": None, "kind": "failure", "message": cause}],
              "lr": [], "lr_schedule": None, "eval_loss": [], "allreduce_s_per_step": None})
    return m


def _read_json(p: Path) -> dict:
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
