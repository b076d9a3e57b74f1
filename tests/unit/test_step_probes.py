"""The CPU step probes (planner/specs/step.py): the profile section, the profiler's fits, and how
the cost model composes them (planner/cost/model.py), pinned to hand-computed values."""
from __future__ import annotations

import dataclasses

import pytest

from planner.cost import layer_costs
from planner.cost.model import _block_times, block_compute_time
from planner.cost.factors import cluster_factors
from planner.errors import ProfileError
from planner.profiler import comm
from planner.specs import Plan, TrainSpec, parse_cluster, preset, scale
from planner.specs.hardware import find_device
from planner.specs.hardware import PRECISIONS
from planner.specs.step import BlockProbe, InStepLink, StepProbes, fit_line, step_from_dict

MODEL = scale(preset("chatglm3-6b"), "tiny")  # h 128, 4 layers
TRAIN = TrainSpec(global_batch=8, seq_len=128)


def with_step(step: StepProbes):
    return dataclasses.replace(find_device("cpu")[0], step=step)


def test_fit_line_recovers_scale_and_overhead():
    pred = [1e-3, 4e-3, 16e-3]
    meas = [2.0 * p + 5e-4 for p in pred]  # scale 2, 0.5 ms per block
    a, c = fit_line(pred, meas)
    assert a == pytest.approx(2.0, rel=1e-9) and c == pytest.approx(5e-4, rel=1e-9)
    # a line that would need a negative overhead is refitted through the origin (overhead 0)
    a, c = fit_line([1.0, 2.0], [1.0, 3.0])
    assert c == 0.0
    # through the origin, weights 1/m: a = sum(p m / m^2) / sum(p^2 / m^2) = (1 + 2/3) / (1 + 4/9) = 15/13
    assert a == pytest.approx(15 / 13, rel=1e-12)


def test_step_section_parses_and_bad_input_names_the_field():
    s = step_from_dict({"block": {"bf16": {"scale": 2.0, "overhead_s": 1e-3, "points": 6}},
                        "tp_allreduce": {"2": {"busbw_gbps": 0.5, "latency_us": 500.0}}}, PRECISIONS)
    assert s.block_for("bf16").time(1e-3) == pytest.approx(3e-3)
    assert s.block_for("fp32") is None
    assert s.tp_link(2).latency_us == 500.0 and s.tp_link(4).busbw_gbps == 0.5  # the largest measured below
    assert step_from_dict(None, PRECISIONS).empty
    with pytest.raises(ProfileError) as exc:
        step_from_dict({"block": {"bf16": {"scale": 0, "overhead_s": 0}}}, PRECISIONS)
    assert "step.block.bf16.scale" in exc.value.line() and "planner profile" in exc.value.line()
    with pytest.raises(ProfileError) as exc:
        step_from_dict({"tp_allreduce": {"one": {"busbw_gbps": 1, "latency_us": 1}}}, PRECISIONS)
    assert "step.tp_allreduce.one" in exc.value.line()


def test_block_time_is_the_probe_line_through_the_compute_terms():
    plan = Plan(dp=2, micro_batch=2, grad_accum=2)
    plain = parse_cluster("2xcpu", find_device("cpu")[0])
    x = block_compute_time(MODEL, plain, TRAIN, plan)  # GEMMs + core + element-wise, fwd + bwd
    assert x == pytest.approx(layer_costs(MODEL, plain, TRAIN, plan).block_time, rel=1e-12)  # no probe: as before
    dev = with_step(StepProbes(block={"bf16": BlockProbe(scale=2.0, overhead_s=3e-3)}))
    two = parse_cluster("2xcpu", dev)
    bt = _block_times(MODEL, two, TRAIN, plan, cluster_factors(two))
    assert bt.forward + bt.backward == pytest.approx(2.0 * x + 3e-3, rel=1e-12)
    fwd = _block_times(MODEL, plain, TRAIN, plan, cluster_factors(plain)).forward
    assert bt.forward == pytest.approx(2.0 * fwd + 1e-3, rel=1e-12)  # the overhead: 1/3 forward, 2/3 backward
    # 4 processes on a profile measured with 2: every CPU-bound term stretches 2x, the overhead too
    four = parse_cluster("4xcpu", dev)
    plan4 = Plan(dp=4, micro_batch=1, grad_accum=2)
    x4 = block_compute_time(MODEL, parse_cluster("4xcpu", find_device("cpu")[0]), TRAIN, plan4)
    bt4 = _block_times(MODEL, four, TRAIN, plan4, cluster_factors(four))
    assert bt4.forward + bt4.backward == pytest.approx(2.0 * x4 + 2 * 3e-3, rel=1e-12)
    # the probe of the other precision does not apply
    fp32 = Plan(dp=2, micro_batch=2, grad_accum=2, precision="fp32")
    train32 = dataclasses.replace(TRAIN, precision="fp32")
    assert layer_costs(MODEL, two, train32, fp32).block_time == \
        pytest.approx(layer_costs(MODEL, plain, train32, fp32).block_time, rel=1e-12)


def test_tp_all_reduce_in_the_step_is_the_measured_link():
    """TP 2, b 2, s 128, h 128, bf16: an all-reduce of 65536 bytes; 2 forward per block.
    Link 0.5 GB/s busbw, 500 us per latency step, 2 steps for n = 2:
    65536 x 2(1/2) / 0.5e9 = 131.072 us, + 2 x 500 us = 1131.072 us; forward 2262.144 us."""
    dev = with_step(StepProbes(tp_allreduce={2: InStepLink(busbw_gbps=0.5, latency_us=500.0)}))
    cluster = parse_cluster("2xcpu", dev)
    plan = Plan(tp=2, micro_batch=2, grad_accum=4)
    bt = _block_times(MODEL, cluster, TRAIN, plan, cluster_factors(cluster))
    assert bt.tp_fwd == pytest.approx(2262.144e-6, rel=1e-9)
    assert bt.tp_bwd == pytest.approx(2262.144e-6, rel=1e-9)
    # 4 processes (TP2 x DP2) on a profile measured with 2: the in-step all-reduce stretches 2x
    four = parse_cluster("4xcpu", dev)
    bt4 = _block_times(MODEL, four, TRAIN, Plan(tp=2, dp=2, micro_batch=2, grad_accum=2), cluster_factors(four))
    assert bt4.tp_fwd == pytest.approx(2 * 2262.144e-6, rel=1e-9)


def test_in_step_fit_is_per_all_reduce_over_sizes():
    """Rows as the comm worker writes them: (with TP - without) / 4 per all-reduce; the fit
    gives alpha (both latency steps of n = 2) and the bus bandwidth."""
    rows = []
    for b in (32768, 131072, 524288):
        per = 1e-3 + b / 1e9  # alpha 1 ms, algbw 1 GB/s -> busbw 1 GB/s at n = 2
        rows.append({"precision": "bf16", "micro_batch": 1, "seq": 128, "n": 2, "bytes": b, "block_s": 0.01,
                     "block_with_tp_s": 0.01 + 4 * per, "per_all_reduce_s": per, "all_reduces_per_block": 4})
    fit = comm.fit_in_step(rows)
    assert fit["busbw_gbps"] == pytest.approx(1.0, rel=1e-6)
    assert fit["latency_us"] == pytest.approx(500.0, rel=1e-6)  # 1 ms over allreduce_steps(2) = 2
    summary = comm.summarize_group({"collectives": [], "in_step": rows})
    assert summary["in_step"]["fit"] == fit
    assert comm.fit_in_step(rows[:1]) is None
