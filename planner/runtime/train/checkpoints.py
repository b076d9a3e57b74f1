"""Checkpoints of the training loop: save with an atomic `latest`, resume, and rollback after a
non-finite loss or gradient norm (docs/trainer.md, "Checkpoints, resume, and `kill -9` while
saving")."""
from __future__ import annotations

import math
import shutil
from pathlib import Path

from planner.data.batching import Layout
from planner.runtime.files import progress
from planner.rundir import atomic_write_json


def latest_tag(ckpt: Path) -> str | None:
    """The checkpoint tag `latest` names, if that tag directory exists. `latest` is written by
    us, atomically, only after every rank has finished saving the tag (see `save`), so a tag it
    names is complete; a kill mid-save leaves it naming the previous one."""
    try:
        tag = (ckpt / "latest").read_text().strip()
    except OSError:
        return None
    return tag if tag and (ckpt / tag).is_dir() else None


def save(engine, ckpt: Path, run_dir: Path, rank: int, state: dict, step: int, slow_save: dict) -> None:
    """Save checkpoint `step<step>` with the loop's `state` as client state (every rank calls
    this), then name it in `latest`. `slow_save` is the switch of hooks.slow_saves (or {})."""
    import deepspeed.comm as dist

    from planner.runtime.observe.watch import format_progress
    from planner.rundir import atomic_write_text
    tag = f"step{step}"
    if rank == 0 and (ckpt / tag).exists() and latest_tag(ckpt) != tag:
        shutil.rmtree(ckpt / tag)  # a partial save of an earlier, killed run
    # every rank writes its files, then DeepSpeed's closing barrier; only then does rank 0
    # name the tag in `latest` (atomic rename). DeepSpeed's own `latest` (save_latest=True)
    # is written by rank 0 before the other ranks are done, with a plain open("w").
    slow_save["on"] = step > 0
    engine.save_checkpoint(str(ckpt), tag=tag, client_state={"planner": dict(state)}, save_latest=False)
    dist.barrier()
    if rank == 0:
        atomic_write_text(ckpt / "latest", tag)
        rec = {"step": step, "kind": "checkpoint", "tag": tag}
        progress(run_dir, rec)
        print(format_progress(rec), flush=True)


def resume(engine, ckpt: Path, state: dict) -> str | None:
    """Load the checkpoint `latest` names into `engine` and its client state into `state`, with
    a "resume" event; the tag, or None (and nothing loaded) when there is none."""
    tag = latest_tag(ckpt)
    if tag is not None:
        _, client = engine.load_checkpoint(str(ckpt), tag=tag)
        state.update(client["planner"])
        state["events"].append({"step": state["step"], "kind": "resume",
                                "message": f"resumed from checkpoint {tag} (step {state['step']})"})
    return tag


def rollback(engine, run_dir: Path, rank: int, state: dict, step: int, batch: int, loss: float,
             gnorm: float | None, ckpt: Path, layout: Layout) -> None:
    """NaN/Inf: snapshot, reload the last good checkpoint, skip the bad batch. `step` is the
    loop's 0-based index; events and files name it as the progress lines count (step + 1)."""
    reason = f"loss {loss}" if not math.isfinite(loss) else f"gradient norm {gnorm}"
    step += 1
    if rank == 0:
        atomic_write_json(run_dir / "debug" / f"nan_step{step}.json", {
            "step": step, "batch": batch, "reason": reason, "loss_history": state["loss"],
            "rows": [list(layout.rows(batch, m, d)) for m in range(layout.grad_accum) for d in range(layout.dp)],
            "skipped_before": state["skip"]})
    events = state["events"] + [{"step": step, "kind": "nan", "message": f"non-finite {reason} at step {step} "
                                 f"(batch {batch}); snapshot debug/nan_step{step}.json"}]
    tag = latest_tag(ckpt)
    if tag is None:
        raise RuntimeError(f"non-finite {reason} at step {step} and no checkpoint to roll back to "
                           "(run with --checkpoint-every K)")
    _, client = engine.load_checkpoint(str(ckpt), tag=tag)
    engine.optimizer.zero_grad()
    good = client["planner"]
    skip = sorted(set(good["skip"]) | set(state["skip"]) | {batch})
    state.clear()
    state.update(good)
    state["skip"] = skip
    state["events"] = events + [{"step": good["step"], "kind": "rollback",
                                 "message": f"rolled back to checkpoint step {good['step']}, skipping batch {batch}"}]
    if rank == 0:
        progress(run_dir, {"step": step, "kind": "rollback", "to": good["step"], "skip": batch})
