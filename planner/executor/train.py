"""The training loop of one rank: steps, measurement, stability monitor, checkpoints, rollback."""
from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path

import torch

from planner.executor.build import build_engine, check_topology, loader, rank_coords, set_poison
from planner.executor.data import DataSpec, Layout, Rows
from planner.executor.measure import (CPU_METHOD, GPU_METHOD, ActivationRecorder, model_states, peak_bytes,
                                      reset_peak, rss_bytes)
from planner.executor.model import Block
from planner.executor.monitor import StabilityMonitor
from planner.executor.files import CKPT_DIR, RANKS_DIR, progress
from planner.rundir import atomic_write_json, load_run, read_json


def _next_batch(cursor: int, skip: set[int]) -> int:
    while cursor in skip:
        cursor += 1
    return cursor


def _grad_norm(engine) -> float | None:
    try:
        g = engine.get_global_grad_norm()
    except Exception:  # some optimizer wrappers do not track it
        return None
    if g is None:
        return None
    return float(g.item() if isinstance(g, torch.Tensor) else g)


def train(args, run_dir: Path, rank: int, status) -> None:
    rss_before = rss_bytes()
    import deepspeed
    import deepspeed.comm as dist

    plan, spec, cluster, trainspec, _ = load_run(run_dir)
    cfg = read_json(run_dir / "ds_config.json", "ds_config.json")
    device = "cuda" if cluster.device.kind != "cpu" and torch.cuda.is_available() else "cpu"
    deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo")
    world = dist.get_world_size()
    if world != plan.world_size:
        raise RuntimeError(f"launched {world} processes, the plan needs {plan.world_size}")
    torch.manual_seed(args.seed)
    status.write(phase="init")
    os.chdir(run_dir)  # the monitor's relative output paths land in the run directory
    engine, groups = build_engine(plan, spec, cfg, attention=trainspec.attention, seed=args.seed)
    check_topology(engine, groups, plan, rank)
    pp_i, dp_i, tp_i = rank_coords(rank, plan)
    if args.dump_grads:
        _dump_first_grads(engine, Path(args.dump_grads), rank, (pp_i, dp_i, tp_i))
    pipe = plan.pp > 1
    last_stage = pp_i == plan.pp - 1
    # --measure-activations: what each layer keeps for backward in the first micro-batch of the
    # second step (the first is warm-up), or of the only step
    recorder = ActivationRecorder(engine.module) if args.measure_activations else None
    measure_step = min(1, args.steps - 1)
    if recorder is not None and pipe:
        _record_first_forward(engine, recorder)

    data = DataSpec(seq_len=trainspec.seq_len, vocab=spec.vocab, seed=args.seed, token_file=args.data)
    rows = Rows(data, args.batching)
    layout = Layout(plan.micro_batch, plan.grad_accum, plan.dp)
    ckpt = run_dir / CKPT_DIR
    monitor = StabilityMonitor()
    state = {"step": 0, "cursor": 0, "skip": [], "loss": [], "events": [], "times": [], "tokens": 0, "padding": 0}
    if args.resume and (ckpt / "latest").exists():
        _, client = engine.load_checkpoint(str(ckpt))
        state.update(client["planner"])
        state["events"].append({"step": state["step"], "kind": "resume",
                                "message": f"resumed from checkpoint step {state['step']}"})
    resumed_at = state["step"]

    def save(step: int) -> None:
        engine.save_checkpoint(str(ckpt), tag=f"step{step}", client_state={"planner": dict(state)})
        if rank == 0:
            progress(run_dir, {"step": step, "kind": "checkpoint"})

    if args.checkpoint_every and not (ckpt / "latest").exists():
        save(0)  # a good state to roll back to before the first checkpoint interval
    reset_peak(device)
    status.write(phase="train")
    times: dict[int, float] = {int(k): v for k, v in state.get("times_by_step", {}).items()}
    poisoned_batches: set[int] = set()
    stream = None
    states = None
    rollbacks = 0
    while state["step"] < args.steps:
        step = state["step"]
        if stream is None:  # (re)started after init or a rollback: one DataLoader for the rest of the run
            ids_left, c = [], state["cursor"]
            for _ in range(args.steps - step):
                c = _next_batch(c, set(state["skip"]))
                ids_left.append(c)
                c += 1
            stream = iter(loader(rows, layout, ids_left, dp_i, device, args.data_workers))
            pending = list(ids_left)
        b = pending.pop(0)
        micro = [next(stream) for _ in range(plan.grad_accum)]
        poison = step == args.inject_nan and not poisoned_batches  # the test injects once
        if poison:
            poisoned_batches.add(b)
        set_poison(engine, poison)
        record = recorder is not None and step == measure_step and recorder.result is None
        if record and pipe:
            recorder.armed = True
        t0 = time.perf_counter()
        if pipe:
            it = iter(((ids.to(device), pos.to(device), seg.to(device)), lab.to(device)) for ids, pos, seg, lab in micro)
            loss = float(engine.train_batch(data_iter=it))
        else:
            losses = []
            for k, (ids, pos, seg, lab) in enumerate(micro):
                with recorder.window() if record and k == 0 else contextlib.nullcontext():
                    logits = engine(ids.to(device), pos.to(device), seg.to(device))
                    l = engine.module.loss_fn(logits, lab.to(device))
                del logits  # not kept for backward: only the loss's fp32 softmax is (docs/runtime.md)
                engine.backward(l)
                if step >= 1 and k == len(micro) - 1 and states is None:
                    # gradients reduced and optimizer state allocated: count model states here
                    states = model_states(engine.module, engine.optimizer, device)
                engine.step()
                losses.append(float(l.detach()))
            loss = sum(losses) / len(losses)
        dt = time.perf_counter() - t0
        gnorm = _grad_norm(engine)
        set_poison(engine, False)
        # one collective per step: loss (from ranks holding it), bad flag, real/padded tokens
        holds_loss = (last_stage or not pipe) and tp_i == 0
        reads = pp_i == 0 and tp_i == 0
        real = sum(rows.real_tokens(i) for m in range(plan.grad_accum) for i in layout.rows(b, m, dp_i)) if reads else 0
        total = plan.grad_accum * plan.micro_batch * trainspec.seq_len if reads else 0
        bad = 0.0 if (math.isfinite(loss) and (gnorm is None or math.isfinite(gnorm))) else 1.0
        vec = torch.tensor([loss if (holds_loss and not bad) else 0.0, 1.0 if holds_loss else 0.0, bad,
                            float(real), float(total)], dtype=torch.float64)
        dist.all_reduce(vec)
        step_loss = vec[0].item() / max(vec[1].item(), 1.0)
        if vec[2].item() > 0:
            rollbacks += 1
            if rollbacks > 3:
                raise RuntimeError(f"non-finite loss/gradients persist after {rollbacks - 1} rollbacks at step {step}")
            _rollback(engine, run_dir, rank, state, step, b, loss, gnorm, ckpt, layout)
            stream = None
            continue
        times[step] = dt
        rollbacks = 0
        state["tokens"] += int(vec[3].item())
        state["padding"] += int(vec[4].item() - vec[3].item())
        state["loss"] = state["loss"][:step] + [step_loss]
        state["step_tokens"] = state.get("step_tokens", [])[:step] + [int(vec[3].item())]
        for ev in monitor.observe(step, step_loss, gnorm):
            state["events"].append(ev)
        state["step"], state["cursor"] = step + 1, b + 1
        state["times_by_step"] = {str(k): v for k, v in times.items()}
        if rank == 0 and getattr(engine, "monitor", None) is not None and engine.monitor.enabled:
            # DeepSpeed's own monitor (tensorboard/csv in ds_config.json) logs what we measure
            engine.monitor.write_events([("Train/planner/loss", step_loss, step + 1),
                                         ("Train/planner/step_time_s", dt, step + 1),
                                         ("Train/planner/peak_memory_gb", peak_bytes(device) / 1e9, step + 1)])
        if rank == 0:
            progress(run_dir, {"step": step + 1, "kind": "step", "loss": step_loss, "time_s": dt,
                               "grad_norm": gnorm})
        status.write(step=step + 1)
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            save(step + 1)
            state["events"].append({"step": step + 1, "kind": "checkpoint", "message": f"saved step{step + 1}"})

    status.write(phase="measure")
    if states is None or pipe:  # pipeline: after the last step (train_batch has freed the gradients)
        states = model_states(engine.module, engine.optimizer, device)
    mine = {"rank": rank, "coords": [pp_i, dp_i, tp_i], "peak_bytes": peak_bytes(device),
            "rss_before_model_bytes": rss_before, "model_state": states["device"],
            "host_model_state": states["host"], "model_state_buffers": states["buffers"],
            "checkpointed_blocks": [bool(m.checkpoint) for m in engine.module.modules() if isinstance(m, Block)],
            "selective_blocks": [bool(m.self_attention.checkpoint_core) for m in engine.module.modules()
                                 if isinstance(m, Block)],
            "local_params": sum(int(getattr(p, "ds_numel", p.numel())) for p in engine.module.parameters()),
            "param_shapes": {p.canonical: list(getattr(p, "ds_shape", p.shape)) for p in engine.module.parameters()},
            "step_times_s": [times.get(s) for s in range(args.steps)]}
    if recorder is not None:
        mine["activations"] = recorder.result
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        atomic_write_json(run_dir / RANKS_DIR / "result.json", {
            "device": device, "world_size": world, "resumed_at": resumed_at, "batching": args.batching,
            "memory_method": GPU_METHOD if device == "cuda" else CPU_METHOD,
            "loss": state["loss"], "events": state["events"], "skipped_batches": state["skip"],
            "real_tokens": state["tokens"], "padding_tokens": state["padding"],
            "step_tokens": state.get("step_tokens", []),
            "ranks": gathered})
    dist.barrier()


def _record_first_forward(engine, recorder: ActivationRecorder) -> None:
    """Under a pipeline, DeepSpeed's PipelineEngine runs each micro-batch's forward (and, on the
    last stage, its loss) in _exec_forward_pass, dispatched through _INSTRUCTION_MAP: record the
    first one after `recorder.armed` is set."""
    from deepspeed.runtime.pipe.schedule import ForwardPass
    forward = type(engine)._INSTRUCTION_MAP[ForwardPass]
    recorder.armed = False

    def recorded(self, buffer_id):
        if not recorder.armed:
            return forward(self, buffer_id)
        recorder.armed = False
        with recorder.window():
            return forward(self, buffer_id)

    engine._INSTRUCTION_MAP = {**type(engine)._INSTRUCTION_MAP, ForwardPass: recorded}


def _dump_first_grads(engine, out: Path, rank: int, coords: tuple[int, int, int]) -> None:
    """Test hook (worker --dump-grads DIR): just before the first optimizer step, write this
    rank's gradients as the optimizer sees them (averaged over DP; with ZeRO, DeepSpeed's
    safe_get_full_grad gathers this rank's whole TP slice), with what is needed to reassemble
    them across TP (`tp_split`) and the global gradient norm the step used."""
    from deepspeed.utils import safe_get_full_grad
    take_step = engine._take_model_step
    done = []

    def dump_then_step(*args, **kw):
        if done:
            return take_step(*args, **kw)
        grads = [{"name": p.canonical, "split": p.tp_split, "pipe_replicated": bool(getattr(p, "ds_pipe_replicated", False)),
                  "grad": safe_get_full_grad(p).detach().float().cpu().clone()} for p in engine.module.parameters()]
        result = take_step(*args, **kw)
        norm = engine.get_global_grad_norm()
        done.append(True)
        out.mkdir(parents=True, exist_ok=True)
        torch.save({"rank": rank, "coords": list(coords), "grads": grads,
                    "grad_norm": float(norm.item() if isinstance(norm, torch.Tensor) else norm)},
                   out / f"rank{rank}.pt")
        return result

    engine._take_model_step = dump_then_step


def _rollback(engine, run_dir: Path, rank: int, state: dict, step: int, batch: int, loss: float,
              gnorm: float | None, ckpt: Path, layout: Layout) -> None:
    """NaN/Inf: snapshot, reload the last good checkpoint, skip the bad batch."""
    reason = f"loss {loss}" if not math.isfinite(loss) else f"gradient norm {gnorm}"
    if rank == 0:
        atomic_write_json(run_dir / "debug" / f"nan_step{step}.json", {
            "step": step, "batch": batch, "reason": reason, "loss_history": state["loss"],
            "rows": [list(layout.rows(batch, m, d)) for m in range(layout.grad_accum) for d in range(layout.dp)],
            "skipped_before": state["skip"]})
    events = state["events"] + [{"step": step, "kind": "nan", "message": f"non-finite {reason} at step {step} "
                                 f"(batch {batch}); snapshot debug/nan_step{step}.json"}]
    if not (ckpt / "latest").exists():
        raise RuntimeError(f"non-finite {reason} at step {step} and no checkpoint to roll back to "
                           "(run with --checkpoint-every K)")
    _, client = engine.load_checkpoint(str(ckpt))
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
