"""What a finished training run reports (planner/runtime/train/loop.py Training.finish): each
rank's measurements (model states, peaks, the blocks' recompute flags, parameter shapes, step
times, recorded activations), and rank 0's result.json and metrics.json."""
from __future__ import annotations

from planner.model.block import Block
from planner.runtime.files import RANKS_DIR
from planner.runtime.observe.measure import CPU_METHOD, GPU_METHOD, peak_bytes
from planner.runtime.observe.allocated import ALLOCATED_METHOD
from planner.rundir import atomic_write_json, read_json


def rank_measurements(run) -> dict:
    """This rank's measurements; `run` is its Training (loop.py)."""
    engine, device, states = run.engine, run.device, run.states
    blocks = [m for m in engine.module.modules() if isinstance(m, Block)]
    mine = {"rank": run.rank, "coords": [run.pp_i, run.dp_i, run.tp_i], "peak_bytes": peak_bytes(device),
            "allocated_peak_bytes": peak_bytes(device) if device == "cuda" else run.allocated,
            "allocated_steps": run.allocated_steps,
            "rss_before_model_bytes": run.rss_before, "model_state": states["device"],
            "host_model_state": states["host"], "model_state_buffers": states["buffers"],
            "checkpointed_blocks": [bool(m.checkpoint) for m in blocks],
            "selective_blocks": [bool(m.self_attention.checkpoint_core) for m in blocks],
            "local_params": sum(int(getattr(p, "ds_numel", p.numel())) for p in engine.module.parameters()),
            "param_shapes": {p.canonical: list(getattr(p, "ds_shape", p.shape)) for p in engine.module.parameters()},
            "step_times_s": [run.times.get(s) for s in range(run.opts.steps)]}
    if run.recorder is not None:
        mine["activations"] = run.recorder.result
    return mine


def write_result(run, gathered: list) -> None:
    """Rank 0: result.json (every rank's measurements) and metrics.json, so a launch.sh
    (deepspeed launcher) run has one too."""
    from planner.runtime.observe.metrics import build_metrics
    opts, state, run_dir = run.opts, run.state, run.run_dir
    result = {
        "device": run.device, "world_size": run.world, "resumed_at": run.resumed_at, "batching": opts.batching,
        "memory_method": GPU_METHOD if run.device == "cuda" else CPU_METHOD,
        "allocated_method": ALLOCATED_METHOD[run.device],
        "loss": state["loss"], "events": state["events"], "skipped_batches": state["skip"],
        "real_tokens": state["tokens"], "padding_tokens": state["padding"],
        "step_tokens": state.get("step_tokens", []),
        "lr": state.get("lr", []), "lr_schedule": run.lr_info, "eval_loss": state.get("eval", []),
        "allreduce_s": state.get("allreduce_s", []) if run.timer is not None else None,
        "loader": run.loading.to_dict(),
        "data": {"corpus": opts.data or "synthetic", "tokenizer": opts.tokenizer or None, "seed": opts.seed},
        "ranks": gathered}
    atomic_write_json(run_dir / RANKS_DIR / "result.json", result)
    estimate = (read_json(run_dir / "estimate.json", "estimate.json")
                if (run_dir / "estimate.json").exists() else {})
    atomic_write_json(run_dir / "metrics.json",
                      build_metrics(result, run.plan, run.spec, opts.warmup, opts.steps, estimate, run_dir))
