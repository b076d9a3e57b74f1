"""The training loop of one rank: steps, measurement, stability monitor, checkpoints, rollback.

Its parts: settings.py (learning-rate schedule; the data spec and DataLoader settings are planner/data),
checkpoints.py (save with an atomic `latest`, resume, rollback), evaluate.py (held-out loss),
hooks.py (what is patched into the engine for tests and --measure-activations), stepsync.py
(the one collective per step) and result.py (each rank's measurements, result.json and
metrics.json)."""
from __future__ import annotations

import contextlib
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
from planner.runtime.observe.allocated import AllocatedMeter
from planner.runtime.observe.measure import ActivationRecorder, model_states, peak_bytes, reset_peak, rss_bytes
from planner.runtime.observe.monitor import StabilityMonitor
from planner.runtime.files import CKPT_DIR, progress
from planner.runtime.train.result import rank_measurements, write_result
from planner.runtime.train.settings import configure_lr
from planner.runtime.train.stepsync import gather_step, grad_norm
from planner.data.corpus import data_spec
from planner.data.loader import loader_settings
from planner.rundir import atomic_write_json, load_run, read_json


def _next_batch(cursor: int, skip: set[int]) -> int:
    while cursor in skip:
        cursor += 1
    return cursor


def train(opts, run_dir: Path, rank: int, status) -> "Training":
    """Train this rank as `opts` (TrainerOptions) say: set up, step until opts.steps, measure.
    Returns the finished run (the batched runner releases its engine before the next plan)."""
    run = Training(opts, run_dir, rank, status)
    run.loop()
    run.finish()
    return run


class Training:
    """One rank's run. Set-up in the order the ranks must meet (the metrics port before the
    process group, the process group before the model, the model before the data), then the
    step loop (rollback on non-finite loss), then the measurements rank 0 writes."""

    def __init__(self, opts, run_dir: Path, rank: int, status) -> None:
        self.rss_before = rss_bytes()
        import deepspeed
        import deepspeed.comm as dist

        from planner.errors import ExecutionError
        if opts.steps < 1 or opts.warmup < 0 or opts.warmup >= opts.steps:
            raise ExecutionError("--steps/--warmup", f"need steps >= 1 and 0 <= warmup < steps, got "
                                 f"{opts.steps}/{opts.warmup}", "e.g. --steps 10 --warmup 2")
        self.opts, self.run_dir, self.rank, self.status, self.dist = opts, run_dir, rank, status, dist
        self.plan, self.spec, self.cluster, self.trainspec, self.doc = load_run(run_dir)
        self.cfg = read_json(run_dir / "ds_config.json", "ds_config.json")
        self.device = "cuda" if self.cluster.device.kind != "cpu" and torch.cuda.is_available() else "cpu"
        # CPU: live tensor bytes counted from before the model is built (planner.runtime.observe.measure)
        self.meter = AllocatedMeter() if self.device == "cpu" else None
        self.allocated, self.allocated_steps = None, None
        self._services()
        deepspeed.init_distributed(dist_backend="nccl" if self.device == "cuda" else "gloo")
        self.world = dist.get_world_size()
        if self.world != self.plan.world_size:
            raise RuntimeError(f"launched {self.world} processes, the plan needs {self.plan.world_size}")
        torch.manual_seed(opts.seed)
        status.write(phase="init")
        os.chdir(run_dir)  # the monitor's relative output paths land in the run directory
        self.lr_info = configure_lr(self.cfg, opts, opts.steps)
        self._build()
        self._data()
        self._resume()

    # --- set-up -------------------------------------------------------------------------------
    def _services(self) -> None:
        """The Prometheus endpoint (rank 0; a busy port fails before the model is built), its
        rules and dashboard, and the all-reduce timer they read."""
        from planner.errors import ExecutionError
        from planner.rundir import atomic_write_text
        from planner.runtime.observe.watch import ALERTS_FILE, DASHBOARD_FILE, AllReduceTimer, alert_rules, dashboard
        opts, run_dir = self.opts, self.run_dir
        self.exporter = None
        if self.rank == 0 and opts.metrics_port:
            from planner.runtime.observe.prom import Exporter
            try:
                self.exporter = Exporter(opts.metrics_port, opts.metrics_host)
            except OSError as exc:
                raise ExecutionError("--metrics-port", f"cannot listen on {opts.metrics_host}:{opts.metrics_port}: "
                                     f"{exc.strerror or exc}", "pick a free port or stop what listens there") from None
            atomic_write_text(run_dir / ALERTS_FILE, alert_rules())
            atomic_write_json(run_dir / DASHBOARD_FILE, dashboard(f"planner: {self.spec.name} {self.plan.describe()}"))
        self.timer = AllReduceTimer(cuda=self.device == "cuda").install() if opts.metrics_port else None

    def _build(self) -> None:
        """The engine on this rank's groups, checked against the plan's layout, and the test and
        measurement hooks it carries."""
        opts, plan, spec = self.opts, self.plan, self.spec
        build_kw = {}
        if opts.init_hf:
            build_kw["init_weights"] = _init_from_hf(Path(opts.init_hf), spec, plan)
        self.engine, self.groups = build_engine(plan, spec, self.cfg, attention=self.trainspec.attention,
                                                seed=opts.seed, **build_kw)
        check_topology(self.engine, self.groups, plan, self.rank)
        self.pp_i, self.dp_i, self.cp_i, self.tp_i = plan.coords(self.rank)
        if opts.dump_grads:
            dump_first_grads(self.engine, Path(opts.dump_grads), self.rank, (self.pp_i, self.dp_i, self.tp_i))
        self.slow_save = slow_saves(self.engine, opts.save_sleep) if opts.save_sleep else {}
        self.pipe = plan.pp > 1
        self.last_stage = self.pp_i == plan.pp - 1
        # --measure-activations: what each layer keeps for backward in the first micro-batch of the
        # second step (the first is warm-up), or of the only step
        self.recorder = ActivationRecorder(self.engine.module) if opts.measure_activations else None
        self.measure_step = min(1, opts.steps - 1)
        if self.recorder is not None and self.pipe:
            record_first_forward(self.engine, self.recorder)

    def _data(self) -> None:
        opts, plan = self.opts, self.plan
        data = data_spec(opts.data, opts.tokenizer, opts.seed, self.trainspec, self.spec)
        self.loading = loader_settings(self.doc, opts.data_workers, self.device)
        self.rows = Rows(data, opts.batching)
        self.layout = Layout(plan.micro_batch, plan.grad_accum, plan.dp)
        self.eval_loader = None
        if opts.eval_every:
            self.eval_rows = Rows(data, opts.batching, split="eval")
            self.eval_ids = list(range(opts.eval_batches))

    def _resume(self) -> None:
        """Resume from the latest checkpoint (--resume), or start; save step 0 when checkpointing."""
        from planner.errors import ExecutionError
        from planner.runtime.observe.watch import format_progress
        opts, run_dir = self.opts, self.run_dir
        self.ckpt = run_dir / CKPT_DIR
        self.monitor = StabilityMonitor()
        self.state = {"step": 0, "cursor": 0, "skip": [], "loss": [], "events": [], "times": [], "tokens": 0,
                      "padding": 0, "lr": [], "eval": [], "allreduce_s": []}
        tag = checkpoints.resume(self.engine, self.ckpt, self.state) if opts.resume else None
        if opts.resume and tag is None:  # launch.sh runs: `planner run` refuses this before starting ranks
            raise ExecutionError("--resume", f"no checkpoint to resume from in {self.ckpt}", "run without --resume")
        self.resumed_at = self.state["step"]
        if self.rank == 0 and tag is not None:
            rec = {"step": self.resumed_at, "kind": "resume", "tag": tag, "dir": str(self.ckpt / tag)}
            progress(run_dir, rec)
            print(format_progress(rec), flush=True)
        self.saved_step = self.state["step"] if tag is not None else None
        if opts.checkpoint_every and latest_tag(self.ckpt) is None:
            self.save(0)  # a good state to roll back to before the first checkpoint interval

    def save(self, step: int) -> None:
        """Every rank saves; `latest` names the tag once all have saved it."""
        checkpoints.save(self.engine, self.ckpt, self.run_dir, self.rank, self.state, step, self.slow_save)
        self.saved_step = step

    # --- the step loop ------------------------------------------------------------------------
    def loop(self) -> None:
        reset_peak(self.device)
        if self.meter is not None:
            self.meter.reset()
        self.status.write(phase="train")
        self.times: dict[int, float] = {int(k): v for k, v in self.state.get("times_by_step", {}).items()}
        self.poisoned: set[int] = set()
        self.stream = None
        self.states = None
        rollbacks = 0
        if self.timer is not None:
            self.timer.take()
        while self.state["step"] < self.opts.steps:
            step = self.state["step"]
            b, micro = self._next_micro_batches(step)
            lr, loss, dt, gnorm = self._train_step(step, b, micro)
            ar_s, ar_n = self.timer.take() if self.timer is not None else (0.0, 0)
            step_loss, bad, real, total, per_rank = gather_step(self, b, loss, gnorm, dt, ar_s, ar_n)
            if bad:
                rollbacks += 1
                if rollbacks > 3:
                    raise RuntimeError(f"non-finite loss/gradients persist after {rollbacks - 1} rollbacks at step "
                                       f"{step}")
                checkpoints.rollback(self.engine, self.run_dir, self.rank, self.state, step, b, loss, gnorm, self.ckpt,
                                     self.layout)
                self.stream = None
                continue
            rollbacks = 0
            self._record_step(step, b, lr, dt, gnorm, step_loss, real, total, per_rank)

    def _next_micro_batches(self, step: int) -> tuple[int, list]:
        """The next global batch's id and this rank's micro-batches of it."""
        if self.stream is None:  # (re)started after init or a rollback: one DataLoader for the rest of the run
            ids_left, c = [], self.state["cursor"]
            for _ in range(self.opts.steps - step):
                c = _next_batch(c, set(self.state["skip"]))
                ids_left.append(c)
                c += 1
            self.stream = iter(loader(self.rows, self.layout, ids_left, self.dp_i, self.device, self.loading))
            self.pending = list(ids_left)
        b = self.pending.pop(0)
        return b, [next(self.stream) for _ in range(self.plan.grad_accum)]

    def _train_step(self, step: int, b: int, micro: list) -> tuple[float, float, float, float | None]:
        """Forward, backward and the optimizer step of one global batch: (lr, mean loss, seconds,
        gradient norm). Counts the model states after the second step's last backward."""
        engine, device, recorder = self.engine, self.device, self.recorder
        poison = step == self.opts.inject_nan and not self.poisoned  # the test injects once
        if poison:
            self.poisoned.add(b)
        set_poison(engine, poison)
        record = recorder is not None and step == self.measure_step and recorder.result is None
        if record and self.pipe:
            recorder.armed = True
        lr = float(engine.get_lr()[0])  # the rate this step's optimizer update uses
        t0 = time.perf_counter()
        if self.pipe:
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
                if step >= 1 and k == len(micro) - 1 and self.states is None:
                    # gradients reduced and optimizer state allocated: count model states here
                    self.states = model_states(engine.module, engine.optimizer, device)
                engine.step()
                losses.append(float(l.detach()))
            loss = sum(losses) / len(losses)
        dt = time.perf_counter() - t0
        gnorm = grad_norm(engine)
        set_poison(engine, False)
        return lr, loss, dt, gnorm

    def _record_step(self, step: int, b: int, lr: float, dt: float, gnorm: float | None, step_loss: float,
                     step_tokens: int, total: int, per_rank: list[dict]) -> None:
        """A step that counts: the run's state, the allocated-bytes window, the held-out loss,
        the progress line (and DeepSpeed's monitor, Prometheus), a checkpoint when due."""
        opts, state = self.opts, self.state
        self.times[step] = dt
        state["tokens"] += step_tokens
        state["padding"] += total - step_tokens
        state["loss"] = state["loss"][:step] + [step_loss]
        state["lr"] = state.get("lr", [])[:step] + [lr]
        state["step_tokens"] = state.get("step_tokens", [])[:step] + [step_tokens]
        state["allreduce_s"] = state.get("allreduce_s", [])[:step] + [
            max(m["allreduce_seconds"] for m in per_rank) if self.timer is not None else None]
        for ev in self.monitor.observe(step + 1, step_loss, gnorm):  # step numbers as the progress lines count
            state["events"].append(ev)
        state["step"], state["cursor"] = step + 1, b + 1
        if self.meter is not None and self.meter.running and \
                state["step"] >= min(max(opts.warmup, ALLOCATED_STEPS), opts.steps):
            # the warm-up steps' peak (at least the first two: the optimizer allocates its states in
            # the first step, the second is the steady state); peak RSS from here on
            self.allocated, self.allocated_steps = self.meter.stop(), state["step"] - self.resumed_at
            reset_peak(self.device)
        state["times_by_step"] = {str(k): v for k, v in self.times.items()}
        eval_loss = self._evaluate(step)
        slowest = max(m["time_s"] for m in per_rank)
        rec = {"step": step + 1, "total": opts.steps, "kind": "step", "loss": step_loss, "lr": lr,
               "time_s": slowest, "tokens_per_s": step_tokens / slowest if slowest > 0 else None,
               "grad_norm": gnorm, "peak_memory_bytes": max(m["peak_memory_bytes"] for m in per_rank),
               "eval_loss": eval_loss}
        self._show(step, rec, dt, per_rank)
        self.status.write(step=step + 1)
        if opts.checkpoint_every and (step + 1) % opts.checkpoint_every == 0:
            self.save(step + 1)
            state["events"].append({"step": step + 1, "kind": "checkpoint", "message": f"saved step{step + 1}"})
        if opts.step_sleep:
            time.sleep(opts.step_sleep)

    def _evaluate(self, step: int) -> float | None:
        """The held-out loss every --eval-every steps (None between)."""
        if not (self.opts.eval_every and (step + 1) % self.opts.eval_every == 0):
            return None
        if self.eval_loader is None:
            self.eval_loader = loader(self.eval_rows, self.layout, self.eval_ids, self.dp_i, self.device,
                                      loader_settings({}, 0, self.device))
        eval_loss = evaluate(self.engine, self.eval_loader, self.plan, self.device, self.holds_loss, self.pipe)
        self.state["eval"] = [e for e in self.state.get("eval", []) if e["step"] <= step] + [
            {"step": step + 1, "loss": eval_loss}]
        return eval_loss

    def _show(self, step: int, rec: dict, dt: float, per_rank: list[dict]) -> None:
        """Rank 0: DeepSpeed's own monitor (tensorboard/csv in ds_config.json), the progress line
        and file, Prometheus."""
        from planner.runtime.observe.watch import format_progress
        if self.rank != 0:
            return
        engine = self.engine
        if getattr(engine, "monitor", None) is not None and engine.monitor.enabled:
            events = [("Train/planner/loss", rec["loss"], step + 1), ("Train/planner/step_time_s", dt, step + 1),
                      ("Train/planner/peak_memory_gb", peak_bytes(self.device) / 1e9, step + 1),
                      ("Train/planner/lr", rec["lr"], step + 1)]
            if rec["eval_loss"] is not None:
                events.append(("Train/planner/eval_loss", rec["eval_loss"], step + 1))
            engine.monitor.write_events(events)
        progress(self.run_dir, rec)
        print(format_progress(rec), flush=True)
        if self.exporter is not None:
            self.exporter.step(rec, per_rank)

    # --- the end ------------------------------------------------------------------------------
    def finish(self) -> None:
        """The final checkpoint and Hugging Face weights, the model states, every rank's
        measurements gathered, and rank 0's result.json and metrics.json."""
        opts, state = self.opts, self.state
        if opts.checkpoint_every and self.saved_step != opts.steps:
            self.save(opts.steps)  # the final state, whatever K is
            state["events"].append({"step": opts.steps, "kind": "checkpoint", "message": f"saved step{opts.steps}"})
        if opts.save_hf:
            self.status.write(phase="save-hf")
            from planner.hf.weights import save_hf_weights
            save_hf_weights(self.engine, opts.save_hf, self.spec, self.plan, self.groups, source=opts.init_hf or None)
        self.status.write(phase="measure")
        if self.states is None or self.pipe:  # pipeline: after the last step (train_batch has freed the gradients)
            self.states = model_states(self.engine.module, self.engine.optimizer, self.device)
        if self.meter is not None and self.meter.running:  # a run too short for the window
            self.allocated, self.allocated_steps = self.meter.stop(), state["step"] - self.resumed_at
        gathered = [None] * self.dist.get_world_size()
        self.dist.all_gather_object(gathered, rank_measurements(self))
        if self.rank == 0:
            write_result(self, gathered)
        self.dist.barrier()
        if self.exporter is not None:
            self.exporter.close()

ALLOCATED_STEPS = 2
"""Steps the CPU allocated-bytes profiler covers at least (planner.runtime.observe.allocated.AllocatedMeter):
the first allocates the optimizer's states, the second is a steady-state step. Steps past the
warm-up that it covers are timed with its overhead (metrics.json allocated_steps says how many)."""


def _init_from_hf(path: Path, spec, plan):
    """init_weights for build_engine: load a Hugging Face checkpoint into this rank's shard
    (load_hf_weights reads the TP rank from the module's layers when given no groups)."""
    from planner.hf.weights import load_hf_weights

    def init(module: torch.nn.Module) -> None:
        load_hf_weights(module, path, spec, None)
    return init
