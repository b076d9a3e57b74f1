"""Batched starts (planner.runtime.train.batch, `benchmarks/plans_start.py --batch N`) give the
outcome separate `planner run`s give.

Two feasible plans of tiny GLM-4.5-Air on 2 CPU processes from the --moe-cp search (one with
EP 2, one without expert parallelism), and a copy of the EP plan whose ds_config.json DeepSpeed
rejects (reduce_bucket_size -1: the preflight compares only the layout fields). Alone: the EP
plan starts and the bad copy fails. Batched as [other, EP, bad, other]: the other plan starts,
the EP plan after it in the same processes starts with the step-0 loss of its run alone (the same
seed and data: bit-identical unless state leaks between plans), the bad copy fails with the same
cause, and the other plan after it (a fresh launch) has its own loss alone again. Nothing a plan
created outlives it: the bad copy starts (in the processes that ran two plans) with the process
groups and threads the EP plan started with (one plan behind it): only the default group, the
same thread count on each rank. Without the release they grew by 5 groups and about 15 threads
per plan (DeepSpeedState, batch.release).

    flock /tmp/planner-cpu.lock .venv/bin/pytest -q tests/integration/test_batch_start.py
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from planner.errors import PlannerError
from planner.rundir import atomic_write_json
from planner.runtime.train.batch import run_plans
from planner.runtime.train.launch import run_plan
from shared_runs import plans_start

pytestmark = pytest.mark.integration
os.environ.setdefault("DS_ACCELERATOR", "cpu")


ps = plans_start()


@pytest.fixture(scope="module")
def cases():
    s = ps.run_search("glm-4.5-air", "2xcpu", "flash", context_parallel="on")
    feas = ps.feasible(s)
    ep = next(c for c in feas if c.plan.ep == 2 and c.plan.zero in (1, 2))
    other = next(c for c in feas if c.plan.ep == 1 and c.plan != ep.plan)
    return ep, other


def _bad(run_dir: Path) -> Path:
    cfg = json.loads((run_dir / "ds_config.json").read_text())
    cfg["zero_optimization"]["reduce_bucket_size"] = -1
    atomic_write_json(run_dir / "ds_config.json", cfg)
    return run_dir


def test_batched_starts_match_separate_runs(cases, tmp_path: Path) -> None:
    ep, other = cases
    alone_ep = run_plan(ps.write_run(ep, tmp_path / "alone-ep"), steps=1, warmup=0, timeout=900)
    alone_other = run_plan(ps.write_run(other, tmp_path / "alone-other"), steps=1, warmup=0, timeout=900)
    bad_alone = _bad(ps.write_run(ep, tmp_path / "alone-bad"))
    with pytest.raises(PlannerError, match="DeepSpeed rejected the plan") as alone_err:
        run_plan(bad_alone, steps=1, warmup=0, timeout=900)
    assert alone_ep["status"] == "ok" and alone_other["status"] == "ok"

    dirs = [ps.write_run(other, tmp_path / "b-other"), ps.write_run(ep, tmp_path / "b-ep"),
            _bad(ps.write_run(ep, tmp_path / "b-bad")), ps.write_run(other, tmp_path / "b-other-again")]
    got = run_plans(dirs, steps=1, warmup=0, timeout=900)
    losses = [g if isinstance(g, PlannerError) else g["loss"] for g in got]
    live = [[json.loads((d / ".ranks" / f"rank{r}.json").read_text())["live"] for r in (0, 1)] for d in dirs]
    print(f"\n{ep.label()}: alone {alone_ep['loss']}\n{other.label()}: alone {alone_other['loss']}"
          f"\nbatched [other, EP, bad, other]: {losses}\nlive at each start (rank 0, rank 1): {live}")
    assert not isinstance(got[0], PlannerError) and got[0]["status"] == "ok"
    assert not isinstance(got[1], PlannerError) and got[1]["status"] == "ok"
    assert isinstance(got[2], PlannerError) and "DeepSpeed rejected the plan" in got[2].line()
    assert "reduce_bucket_size" in str(alone_err.value.line()) and "reduce_bucket_size" in got[2].line()
    assert json.loads((dirs[2] / "metrics.json").read_text())["status"] == "failed"
    assert not isinstance(got[3], PlannerError) and got[3]["status"] == "ok"
    assert got[0]["loss"] == alone_other["loss"] and got[3]["loss"] == alone_other["loss"]
    assert got[1]["loss"] == alone_ep["loss"]
    # the third plan of the launch starts with what the second started with: no groups, no threads left behind
    for r in (0, 1):
        assert live[1][r]["process_groups"] == live[2][r]["process_groups"] == 1, live
        assert live[2][r]["threads"] == live[1][r]["threads"], live
    assert live[0][0]["process_groups"] == live[3][0]["process_groups"] == 0  # first plan of each launch
    # each directory holds its own run: the plan it ran and one finished step
    for d, case in ((dirs[0], other), (dirs[1], ep), (dirs[3], other)):
        m = json.loads((d / "metrics.json").read_text())
        assert m["status"] == "ok" and len(m["loss"]) == 1
        assert json.loads((d / "plan.json").read_text())["plan"] == json.loads(
            (tmp_path / ("alone-ep" if case is ep else "alone-other") / "plan.json").read_text())["plan"]


def test_batched_state_is_restored_between_plans() -> None:
    """DeepSpeedState restores DeepSpeed's groups registry to what it was before a plan."""
    from deepspeed.utils import groups as ds_groups
    from planner.runtime.train.batch import DeepSpeedState
    state = DeepSpeedState()
    before = dict(ds_groups._EXPERT_PARALLEL_GROUP)
    ds_groups._EXPERT_PARALLEL_GROUP["ep_size_2"] = object()
    ds_groups.mpu = object()
    state.restore()
    assert ds_groups._EXPERT_PARALLEL_GROUP == before and ds_groups.mpu is None
