"""The training loop of one rank: steps, measurement, stability monitor, checkpoints, rollback.

Its parts: settings.py (learning-rate schedule; the data spec and DataLoader settings are planner/data), checkpoints.py
(save with an atomic `latest`, resume, rollback), evaluate.py (held-out loss) and hooks.py (what
is patched into the engine for tests and --measure-activations)."""
from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path

import torch

from planner.runtime.train import checkpoints
from planner.runtime.train.build import build_engine, check_topology, loader, set_poison
from planner.runtime.train.checkpoints import latest_tag
from planner.data.batching import Layout, Rows
from planner.runtime.train.evaluate import evaluate
from planner.runtime.train.hooks import dump_first_grads, record_first_forward, slow_saves
from planner.runtime.observe.allocated import ALLOCATED_METHOD, AllocatedMeter
from planner.runtime.observe.measure import (CPU_METHOD, GPU_METHOD, ActivationRecorder, model_states, peak_bytes,
                                             reset_peak, rss_bytes)
from planner.model.glm import Block
from planner.runtime.observe.monitor import StabilityMonitor
from planner.runtime.files import CKPT_DIR, RANKS_DIR, progress
from planner.runtime.train.settings import configure_lr
from planner.data.corpus import data_spec
from planner.data.loader import loader_settings
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

    from planner.errors import ExecutionError
    from planner.runtime.observe.metrics import build_metrics
    from planner.runtime.observe.watch import (ALERTS_FILE, DASHBOARD_FILE, AllReduceTimer, alert_rules, dashboard,
                                               format_progress)
    from planner.rundir import atomic_write_text

    if args.steps < 1 or args.warmup < 0 or args.warmup >= args.steps:
        raise ExecutionError("--steps/--warmup", f"need steps >= 1 and 0 <= warmup < steps, got "
                             f"{args.steps}/{args.warmup}", "e.g. --steps 10 --warmup 2")
    plan, spec, cluster, trainspec, doc = load_run(run_dir)
    cfg = read_json(run_dir / "ds_config.json", "ds_config.json")
    device = "cuda" if cluster.device.kind != "cpu" and torch.cuda.is_available() else "cpu"
    # CPU: live tensor bytes counted from before the model is built (planner.runtime.observe.measure)
    meter = AllocatedMeter() if device == "cpu" else None
    allocated, allocated_steps = None, None
    exporter = None
    if rank == 0 and args.metrics_port:
        from planner.runtime.observe.prom import Exporter
        try:  # first: a busy port fails before the model is built
            exporter = Exporter(args.metrics_port, args.metrics_host)
        except OSError as exc:
            raise ExecutionError("--metrics-port", f"cannot listen on {args.metrics_host}:{args.metrics_port}: "
                                 f"{exc.strerror or exc}", "pick a free port or stop what listens there") from None
        atomic_write_text(run_dir / ALERTS_FILE, alert_rules())
        atomic_write_json(run_dir / DASHBOARD_FILE, dashboard(f"planner: {spec.name} {plan.describe()}"))
    timer = AllReduceTimer(cuda=device == "cuda").install() if args.metrics_port else None
    deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo")
    world = dist.get_world_size()
    if world != plan.world_size:
        raise RuntimeError(f"launched {world} processes, the plan needs {plan.world_size}")
    torch.manual_seed(args.seed)
    status.write(phase="init")
    os.chdir(run_dir)  # the monitor's relative output paths land in the run directory
    lr_info = configure_lr(cfg, args, args.steps)
    build_kw = {}
    if args.init_hf:
        build_kw["init_weights"] = _init_from_hf(Path(args.init_hf), spec, plan)
    engine, groups = build_engine(plan, spec, cfg, attention=trainspec.attention, seed=args.seed, **build_kw)
    check_topology(engine, groups, plan, rank)
    pp_i, dp_i, _, tp_i = plan.coords(rank)
    if args.dump_grads:
        dump_first_grads(engine, Path(args.dump_grads), rank, (pp_i, dp_i, tp_i))
    slow_save = slow_saves(engine, args.save_sleep) if args.save_sleep else {}
    pipe = plan.pp > 1
    last_stage = pp_i == plan.pp - 1
    # --measure-activations: what each layer keeps for backward in the first micro-batch of the
    # second step (the first is warm-up), or of the only step
    recorder = ActivationRecorder(engine.module) if args.measure_activations else None
    measure_step = min(1, args.steps - 1)
    if recorder is not None and pipe:
        record_first_forward(engine, recorder)

    data = data_spec(args.data, args.tokenizer, args.seed, trainspec, spec)
    loading = loader_settings(doc, args.data_workers, device)
    rows = Rows(data, args.batching)
    layout = Layout(plan.micro_batch, plan.grad_accum, plan.dp)
    eval_loader = None
    if args.eval_every:
        eval_rows = Rows(data, args.batching, split="eval")
        eval_ids = list(range(args.eval_batches))
    ckpt = run_dir / CKPT_DIR
    monitor = StabilityMonitor()
    state = {"step": 0, "cursor": 0, "skip": [], "loss": [], "events": [], "times": [], "tokens": 0, "padding": 0,
             "lr": [], "eval": [], "allreduce_s": []}
    tag = checkpoints.resume(engine, ckpt, state) if args.resume else None
    if args.resume and tag is None:  # launch.sh runs: `planner run` refuses this before starting ranks
        raise ExecutionError("--resume", f"no checkpoint to resume from in {ckpt}", "run without --resume")
    resumed_at = state["step"]
    if rank == 0 and tag is not None:
        rec = {"step": resumed_at, "kind": "resume", "tag": tag, "dir": str(ckpt / tag)}
        progress(run_dir, rec)
        print(format_progress(rec), flush=True)
    saved = {"step": state["step"] if tag is not None else None}

    def save(step: int) -> None:  # every rank; `latest` names the tag once all have saved it
        checkpoints.save(engine, ckpt, run_dir, rank, state, step, slow_save)
        saved["step"] = step

    if args.checkpoint_every and latest_tag(ckpt) is None:
        save(0)  # a good state to roll back to before the first checkpoint interval
    reset_peak(device)
    if meter is not None:
        meter.reset()
    status.write(phase="train")
    times: dict[int, float] = {int(k): v for k, v in state.get("times_by_step", {}).items()}
    poisoned_batches: set[int] = set()
    stream = None
    states = None
    rollbacks = 0
    if timer is not None:
        timer.take()
    while state["step"] < args.steps:
        step = state["step"]
        if stream is None:  # (re)started after init or a rollback: one DataLoader for the rest of the run
            ids_left, c = [], state["cursor"]
            for _ in range(args.steps - step):
                c = _next_batch(c, set(state["skip"]))
                ids_left.append(c)
                c += 1
            stream = iter(loader(rows, layout, ids_left, dp_i, device, loading))
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
        lr = float(engine.get_lr()[0])  # the rate this step's optimizer update uses
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
        ar_s, ar_n = timer.take() if timer is not None else (0.0, 0)
        # one collective per step: loss (from ranks holding it), bad flag, real/padded tokens, and
        # each rank's own slot: step time, peak memory, time and calls in all-reduce, GPU utilisation
        holds_loss = (last_stage or not pipe) and tp_i == 0
        reads = pp_i == 0 and tp_i == 0
        real = sum(rows.real_tokens(i) for m in range(plan.grad_accum) for i in layout.rows(b, m, dp_i)) if reads else 0
        total = plan.grad_accum * plan.micro_batch * trainspec.seq_len if reads else 0
        bad = 0.0 if (math.isfinite(loss) and (gnorm is None or math.isfinite(gnorm))) else 1.0
        vec = torch.zeros(5 + PER_RANK * world, dtype=torch.float64)
        vec[:5] = torch.tensor([loss if (holds_loss and not bad) else 0.0, 1.0 if holds_loss else 0.0, bad,
                                float(real), float(total)], dtype=torch.float64)
        vec[5 + PER_RANK * rank:5 + PER_RANK * (rank + 1)] = torch.tensor(
            [dt, float(peak_bytes(device)), ar_s, float(ar_n), _gpu_util(device)], dtype=torch.float64)
        dist.all_reduce(vec)
        if timer is not None:
            timer.take()  # not the step's own traffic
        step_loss = vec[0].item() / max(vec[1].item(), 1.0)
        if vec[2].item() > 0:
            rollbacks += 1
            if rollbacks > 3:
                raise RuntimeError(f"non-finite loss/gradients persist after {rollbacks - 1} rollbacks at step {step}")
            checkpoints.rollback(engine, run_dir, rank, state, step, b, loss, gnorm, ckpt, layout)
            stream = None
            continue
        per_rank = [dict(zip(("time_s", "peak_memory_bytes", "allreduce_seconds", "allreduce_calls",
                              "gpu_utilization_percent"), vec[5 + PER_RANK * r:5 + PER_RANK * (r + 1)].tolist()))
                    for r in range(world)]
        for m in per_rank:
            if m["gpu_utilization_percent"] < 0:
                m["gpu_utilization_percent"] = None
        times[step] = dt
        rollbacks = 0
        step_tokens = int(vec[3].item())
        state["tokens"] += step_tokens
        state["padding"] += int(vec[4].item() - vec[3].item())
        state["loss"] = state["loss"][:step] + [step_loss]
        state["lr"] = state.get("lr", [])[:step] + [lr]
        state["step_tokens"] = state.get("step_tokens", [])[:step] + [step_tokens]
        state["allreduce_s"] = state.get("allreduce_s", [])[:step] + [
            max(m["allreduce_seconds"] for m in per_rank) if timer is not None else None]
        for ev in monitor.observe(step + 1, step_loss, gnorm):  # step numbers as the progress lines count
            state["events"].append(ev)
        state["step"], state["cursor"] = step + 1, b + 1
        if meter is not None and meter.running and state["step"] >= min(max(args.warmup, ALLOCATED_STEPS), args.steps):
            # the warm-up steps' peak (at least the first two: the optimizer allocates its states in
            # the first step, the second is the steady state); peak RSS from here on
            allocated, allocated_steps = meter.stop(), state["step"] - resumed_at
            reset_peak(device)
        state["times_by_step"] = {str(k): v for k, v in times.items()}
        eval_loss = None
        if args.eval_every and (step + 1) % args.eval_every == 0:
            if eval_loader is None:
                eval_loader = loader(eval_rows, layout, eval_ids, dp_i, device,
                                          loader_settings({}, 0, device))
            eval_loss = evaluate(engine, eval_loader, plan, device, holds_loss, pipe)
            state["eval"] = [e for e in state.get("eval", []) if e["step"] <= step] + [
                {"step": step + 1, "loss": eval_loss}]
        slowest = max(m["time_s"] for m in per_rank)
        rec = {"step": step + 1, "total": args.steps, "kind": "step", "loss": step_loss, "lr": lr,
               "time_s": slowest, "tokens_per_s": step_tokens / slowest if slowest > 0 else None,
               "grad_norm": gnorm, "peak_memory_bytes": max(m["peak_memory_bytes"] for m in per_rank),
               "eval_loss": eval_loss}
        if rank == 0 and getattr(engine, "monitor", None) is not None and engine.monitor.enabled:
            # DeepSpeed's own monitor (tensorboard/csv in ds_config.json) logs what we measure
            events = [("Train/planner/loss", step_loss, step + 1), ("Train/planner/step_time_s", dt, step + 1),
                      ("Train/planner/peak_memory_gb", peak_bytes(device) / 1e9, step + 1),
                      ("Train/planner/lr", lr, step + 1)]
            if eval_loss is not None:
                events.append(("Train/planner/eval_loss", eval_loss, step + 1))
            engine.monitor.write_events(events)
        if rank == 0:
            progress(run_dir, rec)
            print(format_progress(rec), flush=True)
            if exporter is not None:
                exporter.step(rec, per_rank)
        status.write(step=step + 1)
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            save(step + 1)
            state["events"].append({"step": step + 1, "kind": "checkpoint", "message": f"saved step{step + 1}"})
        if args.step_sleep:
            time.sleep(args.step_sleep)

    if args.checkpoint_every and saved["step"] != args.steps:
        save(args.steps)  # the final state, whatever K is
        state["events"].append({"step": args.steps, "kind": "checkpoint", "message": f"saved step{args.steps}"})
    if args.save_hf:
        status.write(phase="save-hf")
        from planner.hf.weights import save_hf_weights
        save_hf_weights(engine, args.save_hf, spec, plan, groups, source=args.init_hf or None)
    status.write(phase="measure")
    if states is None or pipe:  # pipeline: after the last step (train_batch has freed the gradients)
        states = model_states(engine.module, engine.optimizer, device)
    if meter is not None and meter.running:  # a run too short for the window
        allocated, allocated_steps = meter.stop(), state["step"] - resumed_at
    mine = {"rank": rank, "coords": [pp_i, dp_i, tp_i], "peak_bytes": peak_bytes(device),
            "allocated_peak_bytes": peak_bytes(device) if device == "cuda" else allocated,
            "allocated_steps": allocated_steps,
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
        result = {
            "device": device, "world_size": world, "resumed_at": resumed_at, "batching": args.batching,
            "memory_method": GPU_METHOD if device == "cuda" else CPU_METHOD,
            "allocated_method": ALLOCATED_METHOD[device],
            "loss": state["loss"], "events": state["events"], "skipped_batches": state["skip"],
            "real_tokens": state["tokens"], "padding_tokens": state["padding"],
            "step_tokens": state.get("step_tokens", []),
            "lr": state.get("lr", []), "lr_schedule": lr_info, "eval_loss": state.get("eval", []),
            "allreduce_s": state.get("allreduce_s", []) if timer is not None else None,
            "loader": loading.to_dict(),
            "data": {"corpus": args.data or "synthetic", "tokenizer": args.tokenizer or None, "seed": args.seed},
            "ranks": gathered}
        atomic_write_json(run_dir / RANKS_DIR / "result.json", result)
        estimate = (read_json(run_dir / "estimate.json", "estimate.json")
                    if (run_dir / "estimate.json").exists() else {})
        # metrics.json from rank 0 itself, so a launch.sh (deepspeed launcher) run has one too
        atomic_write_json(run_dir / "metrics.json",
                          build_metrics(result, plan, spec, args.warmup, args.steps, estimate, run_dir))
    dist.barrier()
    if exporter is not None:
        exporter.close()


PER_RANK = 5
"""Values each rank contributes to the per-step collective (see the step loop)."""

ALLOCATED_STEPS = 2
"""Steps the CPU allocated-bytes profiler covers at least (planner.runtime.observe.allocated.AllocatedMeter):
the first allocates the optimizer's states, the second is a steady-state step. Steps past the
warm-up that it covers are timed with its overhead (metrics.json allocated_steps says how many)."""


def _gpu_util(device: str) -> float:
    """torch.cuda.utilization() (needs pynvml / amdsmi); -1 where unavailable (CPU runs)."""
    if device != "cuda":
        return -1.0
    try:
        return float(torch.cuda.utilization())
    except Exception:  # no NVML in this environment
        return -1.0


def _init_from_hf(path: Path, spec, plan):
    """init_weights for build_engine: load a Hugging Face checkpoint into this rank's shard
    (load_hf_weights reads the TP rank from the module's layers when given no groups)."""
    from planner.hf.weights import load_hf_weights

    def init(module: torch.nn.Module) -> None:
        load_hf_weights(module, path, spec, None)
    return init
