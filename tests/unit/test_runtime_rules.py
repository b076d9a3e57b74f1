"""What DeepSpeed cannot run is never launched: the executor refuses it with one line."""
from __future__ import annotations

import dataclasses

from planner.cli import main
from planner.rundir import atomic_write_json, plan_document
from planner.specs import Plan, TrainSpec, parse_cluster, preset, scale
from planner.specs.validate import runtime_problems


def test_runtime_problems_name_the_feature():
    assert runtime_problems(Plan(dp=1, tp=1, pp=2, grad_accum=2, schedule="interleaved", interleave=2))
    assert runtime_problems(Plan(dp=1, tp=2, sequence_parallel=True)) == []  # the executor runs SP
    assert runtime_problems(Plan(dp=2, tp=2, pp=2, zero=1)) == []


def test_run_refuses_an_interleaved_plan(tmp_path, capsys):
    model = scale(preset("chatglm3-6b"), "tiny")
    cluster = parse_cluster("2xcpu")
    train = TrainSpec(global_batch=4, seq_len=64)
    plan = Plan(dp=1, pp=2, micro_batch=1, grad_accum=4, schedule="interleaved", interleave=2)
    atomic_write_json(tmp_path / "plan.json", plan_document(plan, model, cluster, train))
    assert main(["run", str(tmp_path), "--steps", "2", "--warmup", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "interleaved" in err
    assert not (tmp_path / "metrics.json").exists()


def test_run_scale_must_match_the_plan(tmp_path, capsys):
    model = scale(preset("chatglm3-6b"), "tiny")
    cluster = parse_cluster("2xcpu")
    train = TrainSpec(global_batch=4, seq_len=64)
    plan = Plan(dp=2, micro_batch=1, grad_accum=2)
    atomic_write_json(tmp_path / "plan.json", plan_document(plan, model, cluster, train, scale="tiny"))
    for cmd in ("run", "verify"):
        assert main([cmd, str(tmp_path), "--scale", "small"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "planned at scale tiny" in err and "--scale small" in err


def test_tp_that_splits_neither_heads_nor_kv_groups_names_the_fix():
    from planner.specs.validate import plan_problems
    model = preset("chatglm3-6b")                         # 32 heads, 2 KV groups
    cluster = parse_cluster("8xA100")
    problems = plan_problems(model, cluster, TrainSpec(global_batch=8, seq_len=128), Plan(dp=2, tp=4, micro_batch=4))
    assert [p.line for p in problems] == ["tp 4 does not divide the 2 KV groups: use a TP degree dividing 2"]
    assert [(p.field, p.code) for p in problems] == [("plan.tp", "tp-kv-groups")]
    # the vocabulary never blocks TP: it is padded (ModelSpec.padded_vocab)
    odd = dataclasses.replace(model, vocab=65023, kv_groups=None)
    assert plan_problems(odd, cluster, TrainSpec(global_batch=8, seq_len=128), Plan(dp=1, tp=8, micro_batch=8)) == []
