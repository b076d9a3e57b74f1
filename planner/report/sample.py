"""A realistic run directory for the report's tests, its benchmark and its docs.

Not part of rendering (build.py never imports it). It runs the real search
(planner.search.driver.search: the same Space, Evaluator, exact solvers and Optuna study as
`planner search`) and writes the run directory with the same writer as `planner search`
(planner.search.outputs.write_outputs: plan.json, estimate.json, ds_config.json from
planner.dsconfig, launch.sh, hostfile, trials.csv) plus the Optuna study.db. So the page is
exercised on exactly what the product writes; tests/unit/test_report_search.py fails if the
two ever differ. Optionally metrics.json and verify.json in the executor's format; their
"measured" numbers are the prediction perturbed by a seeded random generator, so they exercise
the page, and are labelled synthetic (metrics["memory_method"]), never presented as
measurements of anything.
"""
from __future__ import annotations

import math
import os
import random
import shlex
import shutil
import tempfile
from pathlib import Path
from typing import Any

from planner.calibrate.accuracy import rel_error
from planner.rundir import atomic_write_json
from planner.specs import Estimate, ModelSpec, Plan, TrainSpec, parse_cluster, preset
from planner.specs.estimate import GB


def _search(spec: ModelSpec, cluster: Any, train: TrainSpec, study: Path | None, n_trials: int, seed: int) -> Any:
    """planner.search.driver.search, its study in `study` (None: the exhaustive sweep, no study).
    SQLite commits once per trial; on a disk that syncs each commit that is ~40 ms a trial, so
    the study is built in memory-backed /dev/shm when there is one, then moved into place."""
    from planner.search.driver import search
    if study is None:
        return search(spec, cluster, train, exhaustive=True)
    import optuna
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else None) as tmp:
        db = Path(tmp) / "study.db"
        storage = optuna.storages.RDBStorage(f"sqlite:///{db}")
        try:
            result = search(spec, cluster, train, n_trials=n_trials, seed=seed, storage=storage)
        finally:
            storage.engine.dispose()
        staged = study.with_name(f".{study.name}.tmp")
        shutil.copyfile(db, staged)
        os.replace(staged, study)
    return result


def _measured(plan: Plan, model: ModelSpec, est: Estimate, train: TrainSpec, rng: random.Random,
              steps: int = 30, warmup: int = 3) -> dict[str, Any]:
    """A metrics.json in the executor's format; numbers are the prediction perturbed (synthetic)."""
    step = est.step_time_s * rng.uniform(1.03, 1.15)
    times = [step * (1.6 if i < warmup else rng.uniform(0.97, 1.03)) for i in range(steps)]
    mean = sum(times[warmup:]) / (steps - warmup)
    per_rank = [est.peak_memory_gb * rng.uniform(0.9, 1.05) for _ in range(min(plan.world_size, 64))]
    loss = [10.5 * math.exp(-i / 12) + 2.2 + rng.uniform(-0.05, 0.05) for i in range(steps)]
    tps = train.tokens_per_step / mean
    peak = max(per_rank)
    return {"version": 2, "status": "ok", "error": None, "failed_rank": None, "plan": plan.to_dict(),
            "model": model.to_dict(), "world_size": plan.world_size, "device": "cuda", "steps": steps,
            "warmup": warmup, "step_times_s": times, "step_time_s": mean, "tokens_per_s": tps,
            "padding_fraction": 0.0, "batching": "static", "peak_memory_gb_per_rank": per_rank,
            "peak_memory_gb": peak, "memory_method": "synthetic (planner.report.sample)",
            "allocated_peak_gb_per_rank": per_rank, "allocated_peak_gb": peak,  # a GPU's peak is its allocated
            "model_state_gb_per_rank": [est.stage_memory[0].params / GB] * len(per_rank), "loss": loss,
            "predicted": {"step_time_s": est.step_time_s, "tokens_per_s": est.tokens_per_s,
                          "peak_memory_gb": est.peak_memory_gb, "allocated_peak_gb": est.allocated_peak_bytes / GB},
            "relative_error": {"step_time_s": rel_error(est.step_time_s, mean),
                               "tokens_per_s": rel_error(est.tokens_per_s, tps),
                               "peak_memory_gb": rel_error(est.peak_memory_gb, peak)},
            "events": [{"step": 12, "kind": "checkpoint", "message": "saved checkpoint global_step12"}]}


def write_sample_run(run_dir: str | Path, *, model: str | ModelSpec = "glm-10b", gpus: str = "2x8xA100-40GB",
                     global_batch: int = 64, seq_len: int = 1024, study_trials: int = 120, metrics: bool = False,
                     verify: bool = False, seed: int = 0, command: str | None = None) -> Path:
    """Write a complete run directory; returns its path. `study_trials` is `planner search
    --trials` (the study stops early once every shape was tried, and its polish may add a few;
    planner/search/optuna_search.py); 0 runs `planner search --exhaustive` (no study.db)."""
    from planner.search.outputs import write_outputs
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    spec = preset(model) if isinstance(model, str) else model
    cluster = parse_cluster(gpus)
    train = TrainSpec(global_batch=global_batch, seq_len=seq_len, precision="bf16")
    db = run / "study.db"
    if db.exists():
        db.unlink()
    result = _search(spec, cluster, train, db if study_trials else None, study_trials, seed)
    cmd = command if command is not None else (
        f"planner search --model {shlex.quote(spec.name)} --gpus {gpus} --global-batch {global_batch} "
        f"--seq-len {seq_len}" + (f" --trials {study_trials}" if study_trials else " --exhaustive")
        + f" --seed {seed} --out-dir {shlex.quote(str(run.parent))} --name {shlex.quote(run.name)}")
    write_outputs(run, result, spec, cluster, train, scale=None, model_arg=spec.name, command=cmd, top=5)
    chosen, chosen_est = result.best.plan, result.best.estimate
    base_plan, base_est = result.baseline_plan, result.baseline
    if metrics or verify:
        planned = _measured(chosen, spec, chosen_est, train, rng)
        if metrics:
            atomic_write_json(run / "metrics.json", planned)
        if verify:
            base_m = _measured(base_plan, spec, base_est, train, rng)
            tr, mr = planned["tokens_per_s"] / base_m["tokens_per_s"], planned["peak_memory_gb"] / base_m["peak_memory_gb"]
            ptr = chosen_est.tokens_per_s / base_est.tokens_per_s
            pmr = chosen_est.peak_memory_gb / base_est.peak_memory_gb
            atomic_write_json(run / "verify.json", {
                "baseline": base_m, "planned": planned,
                "measured": {"throughput_ratio": tr, "memory_ratio": mr},
                "predicted": {"throughput_ratio": ptr, "memory_ratio": pmr},
                "targets": {"throughput_ratio": 3.0, "memory_reduction": 0.333},
                "met": {"throughput_ratio": tr >= 3.0, "memory_reduction": 1 - mr >= 0.333},
                "summary": f"synthetic sample: throughput x{tr:.2f}, memory x{mr:.2f}"})
    return run
