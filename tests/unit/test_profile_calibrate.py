"""Calibration: synthetic runs generated with known factors are recovered; run-directory I/O."""
from __future__ import annotations

import dataclasses
import json
import math
import time

import pytest

from planner.calibrate import calibrate, load_measured, mape, mape_of, rel_error
from planner.calibrate.fit import with_factors
from planner.search.trials import plan_from_row
from planner.tune.refine import refine, top_plans
from planner.calibrate.runs import MeasuredRun
from planner.calibrate.solver import least_squares
from planner.cost import estimate
from planner.errors import SpecError
from planner.rundir import atomic_write_json, plan_document
from planner.specs import Plan, TrainSpec, find_device, parse_cluster, preset, scale

MODEL = scale(preset("chatglm3-6b"), "tiny")
TRAIN = TrainSpec(global_batch=8, seq_len=128, precision="bf16")
PLANS = [Plan(dp=2, zero=0, micro_batch=4, grad_accum=1), Plan(dp=2, zero=1, micro_batch=2, grad_accum=2),
         Plan(dp=2, zero=2, micro_batch=1, grad_accum=4), Plan(dp=2, zero=3, micro_batch=4, grad_accum=1),
         Plan(pp=2, zero=1, micro_batch=2, grad_accum=4), Plan(tp=2, micro_batch=4, grad_accum=2),
         Plan(dp=2, zero=1, micro_batch=4, grad_accum=1, recompute="full"),
         Plan(pp=2, zero=0, micro_batch=1, grad_accum=8)]
TRUTH = {"compute_scale": 1.8, "elementwise_scale": 1.4, "step_overhead_s": 0.02, "microbatch_overhead_s": 0.004,
         "activation_scale": 1.3, "memory_overhead_gb": 0.4}


def synthetic_runs(truth: dict[str, float], plans=PLANS) -> tuple[object, list[MeasuredRun]]:
    """Runs whose 'measured' figures are the cost model's under `truth` factors."""
    base = find_device("cpu")[0]
    true_dev = with_factors(base, truth)
    cluster = parse_cluster("2xcpu", base)
    runs = []
    for i, p in enumerate(plans):
        c_true = dataclasses.replace(cluster, device=true_dev)
        train = dataclasses.replace(TRAIN, global_batch=p.global_batch)
        e = estimate(MODEL, c_true, train, p)
        assert e.feasible, e.reasons
        runs.append(MeasuredRun(path=f"run{i}", model=MODEL, cluster=cluster, train=train, plan=p,
                                step_time_s=e.step_time_s, peak_memory_gb=e.peak_memory_gb))
    return base, runs


def test_solver_recovers_known_parameters():
    import numpy as np
    xs = np.linspace(0, 2, 20)
    ys = 3.0 * np.exp(-1.5 * xs) + 0.5
    sol = least_squares(lambda p: p[0] * np.exp(-p[1] * xs) + p[2] - ys, np.array([1.0, 1.0, 0.0]))
    assert sol.converged
    assert sol.x == pytest.approx([3.0, 1.5, 0.5], rel=1e-5)


def test_calibration_recovers_synthetic_factors():
    base, runs = synthetic_runs(TRUTH)
    t0 = time.perf_counter()
    cal = calibrate(base, runs, use_layers=False)
    assert time.perf_counter() - t0 < 60
    s = cal.summary
    assert s["step_time_mape_pct"]["before"] > 20  # the defaults are far from the truth
    assert s["step_time_mape_pct"]["after"] < 2.0
    assert s["memory_mape_pct"]["after"] < 2.0
    assert s["step_time_mape_pct"]["held_out"] < 10.0
    assert s["memory_mape_pct"]["held_out"] < 10.0
    for row in cal.rows:
        assert math.isclose(row["step_time_s"]["after"], row["step_time_s"]["measured"], rel_tol=0.10)


def test_mape():
    """planner.calibrate.accuracy: the one relative error and MAPE (fractions)."""
    assert rel_error(110.0, 100.0) == pytest.approx(0.10) and rel_error(90.0, 100.0) == pytest.approx(-0.10)
    assert mape([0.10, -0.30, None]) == pytest.approx(0.20)  # None skipped, not counted as 0
    assert mape_of([110.0, 90.0], [100.0, 100.0]) == pytest.approx(0.10)
    assert mape_of([float("nan")], [1.0]) is None and mape([]) is None


def _write_run(d, plan, step=0.5, mem=1.2, status="ok"):
    cluster = parse_cluster("2xcpu")
    train = dataclasses.replace(TRAIN, global_batch=plan.global_batch)
    atomic_write_json(d / "plan.json", plan_document(plan, MODEL, cluster, train))
    atomic_write_json(d / "metrics.json", {"version": 1, "status": status, "error": None, "plan": plan.to_dict(),
                                           "model": MODEL.to_dict(), "step_time_s": step, "peak_memory_gb": mem})


def test_load_measured_round_trip(tmp_path):
    _write_run(tmp_path, PLANS[1])
    run = load_measured(tmp_path)
    assert run.plan == PLANS[1] and run.model == MODEL
    assert run.train.seq_len == 128 and run.step_time_s == 0.5 and run.peak_memory_gb == 1.2


def test_load_measured_rejects_failed_run(tmp_path):
    _write_run(tmp_path, PLANS[0], status="failed")
    with pytest.raises(SpecError, match="did not succeed"):
        load_measured(tmp_path)


def test_plan_from_trials_row_round_trip():
    from types import SimpleNamespace

    from planner.search.trials import row  # the search's own writer
    plan = Plan(pp=2, zero=1, micro_batch=1, grad_accum=8, stage_layers=(3, 1), recompute="full",
                recompute_layers=(2, 0))
    trial = SimpleNamespace(plan=plan, source="heuristic", feasible=True, reason="", reason_code="", estimate=None,
                            needs_bytes=1.0, capacity_bytes=2.0)
    r = {k: ("" if v is None else str(v)) for k, v in row(0, trial).items()}
    assert plan_from_row(r) == plan


def test_refine_with_a_fake_executor(tmp_path):
    """The closed loop: runs the top K, refits, re-ranks; the 'executor' here measures with known factors."""
    base, runs = synthetic_runs(TRUTH)
    cluster = parse_cluster("2xcpu")
    atomic_write_json(tmp_path / "plan.json", plan_document(PLANS[0], MODEL, cluster, TRAIN))
    lines = ["trial,source,feasible,step_time_s," + ",".join(f.name for f in dataclasses.fields(Plan))]
    for i, p in enumerate(PLANS[:4] + [PLANS[6]]):
        e = estimate(MODEL, cluster, TRAIN, p)
        d = p.to_dict()
        vals = [";".join(map(str, v)) if isinstance(v, list) else str(v) for v in d.values()]
        lines.append(f"{i},optuna,True,{e.step_time_s}," + ",".join(vals))
    (tmp_path / "trials.csv").write_text("\n".join(lines) + "\n")
    assert len(top_plans(tmp_path / "trials.csv", 3)) == 3
    true_dev = with_factors(base, TRUTH)

    def fake_runner(sub, steps, warmup):
        doc = json.loads((sub / "plan.json").read_text())
        p = Plan.from_dict(doc["plan"])
        cfg = json.loads((sub / "ds_config.json").read_text())  # this plan's own config, never a stale one
        assert (cfg["train_micro_batch_size_per_gpu"], cfg["zero_optimization"]["stage"]) == (p.micro_batch, p.zero)
        e = estimate(MODEL, dataclasses.replace(cluster, device=true_dev), TRAIN, p)
        return {"step_time_s": e.step_time_s, "peak_memory_gb": e.peak_memory_gb}

    stale = tmp_path / "refine" / "plan-0" / "ds_config.json"  # left by an earlier search's refine
    atomic_write_json(stale, {"train_micro_batch_size_per_gpu": 99, "zero_optimization": {"stage": 3}})
    out = refine(tmp_path, 4, steps=3, runner=fake_runner)
    saved = json.loads((tmp_path / "refine.json").read_text())
    assert saved["summary"]["runs"] == 4 and len(saved["plans"]) == 4
    assert out["summary"]["step_time_mape_pct"]["after"] < out["summary"]["step_time_mape_pct"]["before"]
    assert (tmp_path / "profile-calibrated.json").exists()
    assert saved["ranking"]["best_after"] is not None


def test_calibrate_cli_writes_factors_and_residuals(tmp_path, capsys):
    from planner.cli import main
    from planner.specs import load_profile
    base, runs = synthetic_runs(TRUTH, PLANS[:4])
    from pathlib import Path
    prof = json.loads(Path(base.path).read_text())
    prof["builtin"] = False
    prof_path = tmp_path / "measured.json"
    prof_path.write_text(json.dumps(prof))
    dirs = []
    for i, r in enumerate(runs):
        d = tmp_path / f"run{i}"
        _write_run(d, r.plan, step=r.step_time_s, mem=r.peak_memory_gb)
        dirs.append(str(d))
    code = main(["calibrate", "--profile", str(prof_path), *dirs])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "step time MAPE: before" in out and "held out" in out
    cal = load_profile(prof_path)
    assert set(cal.factors) >= {"compute_scale", "step_overhead_s", "memory_overhead_gb"}
    assert cal.measured["calibration"]["summary"]["runs"] == 4
    assert "factors.compute_scale" in cal.sources


def test_calibrate_cli_refuses_to_overwrite_a_builtin_profile(tmp_path, capsys):
    from planner.cli import main
    _write_run(tmp_path / "r", PLANS[0])
    code = main(["calibrate", "--profile", str(find_device("cpu")[0].path), str(tmp_path / "r")])
    assert code == 2 and "--out" in capsys.readouterr().err
