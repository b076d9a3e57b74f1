"""metrics.json (docs/CONTRACTS.md): measured figures beside the estimate's predictions."""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from planner.executor.files import RANKS_DIR
from planner.specs.estimate import GB

VERSION = 1


def _predicted(estimate_doc: dict) -> dict[str, float | None]:
    est = estimate_doc.get("estimate", {}) if isinstance(estimate_doc, dict) else {}
    return {k: est.get(k) for k in ("step_time_s", "tokens_per_s", "peak_memory_gb")}


def relative_error(measured: float | None, predicted: float | None) -> float | None:
    """(predicted - measured) / measured: +0.2 means the estimate was 20% high."""
    if measured is None or predicted is None or measured == 0:
        return None
    return (predicted - measured) / measured


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
    states = [sum(r["model_state"].values()) / GB for r in ranks]
    host = [r.get("host_model_state") or {} for r in ranks]  # offloaded states (planner.executor.measure)
    predicted = _predicted(estimate_doc)
    measured = {"step_time_s": step_time, "tokens_per_s": tokens_per_s, "peak_memory_gb": max(peaks)}
    m = _base(plan, model, result["world_size"], warmup, steps, result["batching"])
    m.update({
        "device": result["device"], "step_times_s": step_times, "step_time_s": step_time,
        "step_time_std_s": statistics.pstdev(step_times[s] for s in timed) if len(timed) > 1 else 0.0,
        "tokens_per_s": tokens_per_s, "real_tokens": real, "padding_tokens": pad,
        "padding_fraction": pad / (real + pad) if real + pad else 0.0,
        "peak_memory_gb_per_rank": peaks, "peak_memory_gb": max(peaks), "memory_method": result["memory_method"],
        "model_state_gb_per_rank": states,
        "model_state_breakdown_gb_per_rank": [{k: v / GB for k, v in r["model_state"].items()} for r in ranks],
        "host_model_state_gb_per_rank": [sum(h.values()) / GB for h in host],
        "host_model_state_breakdown_gb_per_rank": [{k: v / GB for k, v in h.items()} for h in host],
        "model_state_buffers_bytes_per_rank": [r.get("model_state_buffers") or {} for r in ranks],
        "rss_before_model_gb_per_rank": [r["rss_before_model_bytes"] / GB for r in ranks],
        "loss": result["loss"], "resumed_at": result["resumed_at"], "skipped_batches": result["skipped_batches"],
        "predicted": predicted,
        "relative_error": {k: relative_error(measured[k], predicted[k]) for k in measured},
        "events": result["events"],
        # the trainer's figures (planner/executor/train.py): the rate each step used, the schedule
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
        # backward in one micro-batch (planner.executor.measure.ActivationRecorder)
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
              "host_model_state_gb_per_rank": [],
              "memory_method": None, "padding_fraction": None,
              "predicted": _predicted(_read_json(run / "estimate.json")),
              "relative_error": {"step_time_s": None, "tokens_per_s": None, "peak_memory_gb": None},
              "events": [{"step": None, "kind": "failure", "message": cause}],
              "lr": [], "lr_schedule": None, "eval_loss": [], "allreduce_s_per_step": None})
    return m


def _read_json(p: Path) -> dict:
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
