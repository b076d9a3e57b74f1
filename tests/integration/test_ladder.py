"""`planner ladder --measure` on 2 CPU processes: every rung that runs here is run with the
executor on the same document stream, measured beside predicted; a rung DeepSpeed would run
exactly as the one before (overlap under ZeRO-0) says why it was not run. About 25 s.

    flock /tmp/planner-cpu.lock .venv/bin/pytest -q tests/integration/test_ladder.py
"""
from __future__ import annotations

import json
import os

import pytest

from planner.cli import main
from planner.rundir import atomic_write_json, plan_document
from planner.specs import Plan, TrainSpec, parse_cluster, preset, scale

pytestmark = pytest.mark.integration
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def test_measured_ladder_of_a_tiny_plan(tmp_path, capsys):
    model, cluster = scale(preset("chatglm3-6b"), "tiny"), parse_cluster("2xcpu")
    train = TrainSpec(global_batch=8, seq_len=64)
    plan = Plan(dp=2, zero=1, micro_batch=4, grad_accum=1)
    d = tmp_path / "tiny"
    atomic_write_json(d / "plan.json", plan_document(plan, model, cluster, train, scale="tiny", model_arg="chatglm3-6b"))
    assert main(["ladder", str(d), "--measure", "--steps", "3", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    lad = json.loads((d / "ladder.json").read_text())
    rungs = {r["technique"]: r for r in lad["rungs"]}
    assert list(rungs) == ["baseline", "precision", "overlap", "batching", "zero"]
    assert "ignores overlap_comm" in rungs["overlap"]["measured"]["not_run"]
    for t in ("baseline", "precision", "batching", "zero"):
        m = rungs[t]["measured"]
        assert m["tokens_per_s"] > 0 and m["peak_memory_gb"] > 0, (t, m)
        assert (d / m["dir"] / "metrics.json").exists()
    # packed batches: nearly every token real; padded: the corpus's short documents leave most of a row empty
    assert rungs["batching"]["measured"]["real_share"] > 0.9 > 0.6 > rungs["precision"]["measured"]["real_share"]
    assert rungs["batching"]["measured"]["over"] == rungs["precision"]["index"]
    assert lad["measured_ratio"]["throughput"] == pytest.approx(
        rungs["zero"]["measured"]["tokens_per_s"] / rungs["baseline"]["measured"]["tokens_per_s"])
    assert "baseline -> plan (measured)" in out
    assert any(ln.startswith(" #  technique") and "|  measured" in ln for ln in out.splitlines())
    assert (d / "ladder-throughput.png").exists() and (d / "ladder-memory.png").exists()
