"""A realistic run directory for the report's tests, its benchmark and its docs.

Not part of rendering (build.py never imports it). It enumerates the legal plans of a small
outer space, prices every one with the real cost model (planner.cost.estimate), and writes
the files `planner search` writes (planner/rundir.py, docs/CONTRACTS.md): plan.json,
estimate.json, ds_config.json, launch.sh, trials.csv and an Optuna study.db whose parameter
names and user attributes follow planner/search/optuna_search.py. Optionally metrics.json and
verify.json in the executor's format; their "measured" numbers are the prediction perturbed
by a seeded random generator, so they exercise the page, and are labelled synthetic
(metrics["memory_method"]), never presented as measurements of anything.
"""
from __future__ import annotations

import csv
import io
import math
import os
import random
import shlex
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from planner.cost import estimate
from planner.search.baseline import conventional_baseline
from planner.search.space import divisors
from planner.search.trials import COLUMNS
from planner.rundir import atomic_write_json, atomic_write_text, plan_document
from planner.specs import ClusterSpec, Estimate, ModelSpec, Plan, TrainSpec
from planner.specs import parse_cluster, preset
from planner.specs.estimate import GB
from planner.specs.plan import RECOMPUTE
from planner.specs.validate import plan_problems

def legal_plans(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, max_micro_batch: int = 16) -> Iterator[Plan]:
    """Every outer point of the space (uniform stage split), structurally legal or not."""
    world = cluster.world_size
    for tp in (t for t in (1, 2, 4, 8) if world % t == 0):
        for pp in (p for p in divisors(world // tp) if p <= min(model.layers, 16)):
            dp = world // (tp * pp)
            if train.global_batch % dp:
                continue
            for mb in (b for b in divisors(train.global_batch // dp) if b <= max_micro_batch):
                ga = train.global_batch // (dp * mb)
                for zero in ((0, 1, 2, 3) if pp == 1 else (0, 1)):
                    for rc in RECOMPUTE:
                        for sp in ((False, True) if tp > 1 else (False,)):
                            for v in ((1, 2) if pp > 1 else (1,)):
                                yield Plan(dp=dp, tp=tp, pp=pp, zero=zero, micro_batch=mb, grad_accum=ga,
                                           recompute=rc, sequence_parallel=sp, precision=train.precision,
                                           schedule="interleaved" if v > 1 else "1f1b", interleave=v)


def trial_row(number: int, source: str, plan: Plan, est: Estimate, structural: bool = False) -> dict[str, Any]:
    """One trials.csv row in the contract's columns (docs/CONTRACTS.md); a structurally
    illegal plan has its reason and no estimate."""
    out: dict[str, Any] = {"trial": number, "source": source}
    for name, value in plan.to_dict().items():
        out[name] = ";".join(str(x) for x in value) if isinstance(value, list) else value
    out["feasible"] = est.feasible
    out["reason"] = "; ".join(est.reasons)
    out["peak_memory_gb"] = est.peak_memory_gb
    out["capacity_gb"] = est.capacity_bytes / GB
    if not structural:
        out.update(step_time_s=est.step_time_s, tokens_per_s=est.tokens_per_s, tflops_per_gpu=est.tflops_per_gpu,
                   mfu=est.mfu, hfu=est.hfu, bubble_fraction=est.bubble_fraction)
        out.update({f"time_{k}": v for k, v in est.time.to_dict().items()})
        out.update({f"mem_{k}": v for k, v in est.stage_memory[est.peak_stage].to_gb().items()})
    return out


def _ds_config(plan: Plan) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_batch_size": plan.global_batch, "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
        "zero_optimization": {"stage": plan.zero, "overlap_comm": plan.overlap_comm,
                              "reduce_bucket_size": plan.bucket_elements},
        "bf16": {"enabled": plan.precision == "bf16"}, "fp16": {"enabled": plan.precision == "fp16"},
    }
    if plan.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": plan.tp}
    return cfg


def _optuna_params(plan: Plan, global_batch: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Parameter names and choices as planner/search/optuna_search.py suggests them."""
    from optuna.distributions import CategoricalDistribution as Cat
    params = {"tp": plan.tp, f"pp|tp={plan.tp}": plan.pp,
              ("zero" if plan.pp == 1 else "zero|pp>1"): plan.zero,
              f"micro_batch|dp={plan.dp}": plan.micro_batch, "recompute": plan.recompute}
    dists = {"tp": Cat([1, 2, 4, 8]), f"pp|tp={plan.tp}": Cat(list(range(1, 17))),
             ("zero" if plan.pp == 1 else "zero|pp>1"): Cat([0, 1, 2, 3] if plan.pp == 1 else [0, 1]),
             f"micro_batch|dp={plan.dp}": Cat([b for b in divisors(global_batch // plan.dp) if b <= 16]),
             "recompute": Cat(list(RECOMPUTE))}
    if plan.tp > 1:
        params["sequence_parallel"] = plan.sequence_parallel
        dists["sequence_parallel"] = Cat([False, True])
    return params, dists


def _write_study(path: Path, rows: list[tuple[Plan, Estimate]], study_name: str) -> None:
    """SQLite commits once per trial; on a disk that syncs each commit that is ~40 ms a trial,
    so the study is built in memory-backed /dev/shm when there is one, then moved into place."""
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else None) as tmp:
        db = Path(tmp) / "study.db"
        _fill_study(db, rows, study_name)
        staged = path.with_name(f".{path.name}.tmp")
        shutil.copyfile(db, staged)
        os.replace(staged, path)


def _fill_study(path: Path, rows: list[tuple[Plan, Estimate]], study_name: str) -> None:
    import optuna
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=f"sqlite:///{path}", study_name=study_name, direction="maximize",
                                load_if_exists=False)
    trials = []
    for plan, est in rows:
        params, dists = _optuna_params(plan, plan.global_batch)
        attrs = {"feasible": est.feasible, "peak_memory_gb": est.peak_memory_gb, "reason": "; ".join(est.reasons),
                 "excess_gb": 0.0 if est.feasible else max(1e-3, est.peak_memory_gb - est.capacity_bytes / GB),
                 "plan": plan.to_dict()}
        trials.append(optuna.trial.create_trial(params=params, distributions=dists, user_attrs=attrs,
                                                value=est.tokens_per_s if est.feasible else 0.0))
    study.add_trials(trials)


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
    return {"version": 1, "status": "ok", "error": None, "failed_rank": None, "plan": plan.to_dict(),
            "model": model.to_dict(), "world_size": plan.world_size, "device": "cuda", "steps": steps,
            "warmup": warmup, "step_times_s": times, "step_time_s": mean, "tokens_per_s": tps,
            "padding_fraction": 0.0, "batching": "static", "peak_memory_gb_per_rank": per_rank,
            "peak_memory_gb": peak, "memory_method": "synthetic (planner.report.sample)",
            "model_state_gb_per_rank": [est.stage_memory[0].params / GB] * len(per_rank), "loss": loss,
            "predicted": {"step_time_s": est.step_time_s, "tokens_per_s": est.tokens_per_s,
                          "peak_memory_gb": est.peak_memory_gb},
            "relative_error": {"step_time_s": (est.step_time_s - mean) / mean,
                               "tokens_per_s": (est.tokens_per_s - tps) / tps,
                               "peak_memory_gb": (est.peak_memory_gb - peak) / peak},
            "events": [{"step": 12, "kind": "checkpoint", "message": "saved checkpoint global_step12"}]}


def write_sample_run(run_dir: str | Path, *, model: str | ModelSpec = "glm-10b", gpus: str = "2x8xA100-40GB",
                     global_batch: int = 64, seq_len: int = 1024, study_trials: int = 120,
                     repeat_trials: int = 1, metrics: bool = False, verify: bool = False, seed: int = 0,
                     command: str | None = None) -> Path:
    """Write a complete run directory; returns its path. `repeat_trials` > 1 re-lists the
    space (as a resumed Optuna study re-evaluates trials) to reach thousands of rows."""
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    spec = preset(model) if isinstance(model, str) else model
    cluster = parse_cluster(gpus)
    train = TrainSpec(global_batch=global_batch, seq_len=seq_len, precision="bf16")
    evaluated = [(plan, estimate(spec, cluster, train, plan)) for plan in legal_plans(spec, cluster, train)]
    illegal = {plan for plan, _ in evaluated if plan_problems(spec, cluster, train, plan)}
    feasible = [pe for pe in evaluated if pe[1].feasible]
    if not feasible:
        raise ValueError(f"no plan of {spec.name} fits {gpus}: choose a bigger sample cluster")
    chosen, chosen_est = max(feasible, key=lambda pe: pe[1].tokens_per_s)
    base_plan, base_est = conventional_baseline(spec, cluster, train)
    order = evaluated[:]
    rng.shuffle(order)
    heuristic = next(pe for pe in order if pe[1].feasible)
    rows = [trial_row(0, "heuristic", *heuristic)]
    for rep in range(repeat_trials):
        for plan, est in order:
            rows.append(trial_row(len(rows), "exhaustive" if rep == 0 else "optuna", plan, est, plan in illegal))
    rows.append(trial_row(len(rows), "baseline", base_plan, base_est))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, restval="", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(run / "trials.csv", buf.getvalue())

    cmd = command if command is not None else (
        f"planner search --model {shlex.quote(spec.name)} --gpus {gpus} --global-batch {global_batch} "
        f"--seq-len {seq_len} --out {shlex.quote(str(run))}")
    atomic_write_json(run / "plan.json", plan_document(chosen, spec, cluster, train, model_arg=spec.name,
                                                       command=cmd))
    baseline: dict[str, Any] = {"plan": base_plan.to_dict(), "estimate": base_est.to_json()}
    if not base_est.feasible:
        baseline = {"plan": base_plan.to_dict(), "fits": False, "needs_gb": base_est.peak_memory_gb}
    atomic_write_json(run / "estimate.json", {"plan": chosen.to_dict(), "estimate": chosen_est.to_json(),
                                              "baseline": baseline})
    atomic_write_json(run / "ds_config.json", _ds_config(chosen))
    atomic_write_text(run / "launch.sh", "#!/bin/sh\n# synthetic sample (planner.report.sample)\n"
                      f"deepspeed --num_nodes {cluster.nodes} --num_gpus {cluster.gpus_per_node} "
                      f"-m planner.executor.train --deepspeed_config {shlex.quote(str(run / 'ds_config.json'))}\n",
                      mode=0o755)
    study_rows = [heuristic] + order[: max(0, study_trials - 1)]
    db = run / "study.db"
    if study_trials:
        _write_study(db, study_rows, f"{spec.name}-{cluster.world_size}-sample")
    elif db.exists():
        db.unlink()
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
