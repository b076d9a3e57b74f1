"""One place per knob (planner/specs/knobs.py): every Plan field has its row, and what is
generated from the table (estimate's options, the ladder's technique map, the trials.csv codec)
follows it."""
from __future__ import annotations

import dataclasses

import click

from planner import dsconfig
from planner.cli.plan_options import FLAGS
from planner.cli.estimate import estimate
from planner.ladder.techniques import DERIVED, FIELDS
from planner.search.trials import plan_cells, plan_from_row
from planner.specs import Plan, TrainSpec, parse_cluster, preset
from planner.specs.knobs import KNOBS, TECHNIQUES


def test_every_plan_field_has_exactly_one_row() -> None:
    assert list(KNOBS) == [f.name for f in dataclasses.fields(Plan)]
    assert all(k.technique in TECHNIQUES + (None,) for k in KNOBS.values())


def test_estimate_has_an_option_per_flagged_knob_with_the_fields_default() -> None:
    opts = {p.name: p for p in estimate.params if isinstance(p, click.Option)}
    for name, flag in FLAGS.items():
        assert flag in opts[name].opts, name
        default = getattr(Plan(), name)
        if isinstance(default, bool):
            assert opts[name].is_flag, name
        else:
            assert opts[name].default == (None if isinstance(default, tuple) else default), name


def test_the_ladder_reads_the_technique_of_each_field() -> None:
    assert {f for fs in FIELDS.values() for f in fs} | set(DERIVED) == set(KNOBS)
    assert FIELDS["overlap"] == ("overlap_comm", "bucket_elements") and DERIVED == ("grad_accum", "runtime")


def test_each_deepspeed_key_is_where_dsconfig_writes_the_field() -> None:
    plan = Plan(dp=8, zero=3, micro_batch=2, grad_accum=4, offload_optimizer="cpu", offload_params="cpu", hpz=2,
                quantized_weights=True, quantized_gradients=True, prefetch_elements=5, live_elements=6,
                persistence_elements=7, mics_shard=0, overlap_comm=False, bucket_elements=123)
    cfg = dsconfig.ds_config(plan, preset("glm-10b"), TrainSpec(global_batch=64, seq_len=1024), parse_cluster("8xA100"))
    for name, knob in KNOBS.items():
        if knob.ds_key is None or name == "mics_shard":   # written only when set
            continue
        node = cfg
        for part in knob.ds_key.split("."):
            node = node[part]
        assert node == getattr(plan, name), name


def test_trials_rows_round_trip_every_field() -> None:
    plan = Plan(dp=2, tp=2, pp=2, zero=1, micro_batch=2, grad_accum=8, stage_layers=(3, 1), recompute="full",
                recompute_layers=(2, 0), sequence_parallel=True, overlap_comm=False, bucket_elements=7,
                runtime="megatron-core", schedule="interleaved", interleave=2, cp=1)
    cells = {k: ("" if v is None else str(v)) for k, v in plan_cells(plan).items()}
    assert plan_from_row(cells) == plan
    assert plan_from_row({**cells, "bucket_elements": float("nan")}).bucket_elements == Plan().bucket_elements
