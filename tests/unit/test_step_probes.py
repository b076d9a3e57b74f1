"""The CPU step probes (planner/specs/step.py): the profile section, the profiler's fits, and how
the cost model composes them (planner/cost/block.py, probes.py), pinned to hand-computed values."""
from __future__ import annotations

import dataclasses
import os

import pytest

from planner.cost import layer_costs
from planner.cost.block import block_compute_time, block_times
from planner.cost.factors import cluster_factors
from planner.errors import ProfileError
from planner.profiler import comm
from planner.specs import Plan, TrainSpec, parse_cluster, preset, scale
from planner.specs.hardware import find_device
from planner.specs.hardware import PRECISIONS
from planner.profiler.steps import fit_line
from planner.specs.step import BlockProbe, InStepLink, StepProbes, step_from_dict

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
    bt = block_times(MODEL, two, TRAIN, plan, cluster_factors(two))
    assert bt.forward + bt.backward == pytest.approx(2.0 * x + 3e-3, rel=1e-12)
    fwd = block_times(MODEL, plain, TRAIN, plan, cluster_factors(plain)).forward
    assert bt.forward == pytest.approx(2.0 * fwd + 1e-3, rel=1e-12)  # the overhead: 1/3 forward, 2/3 backward
    # 4 processes on a profile measured with 2: every CPU-bound term stretches 2x, the overhead too
    four = parse_cluster("4xcpu", dev)
    plan4 = Plan(dp=4, micro_batch=1, grad_accum=2)
    x4 = block_compute_time(MODEL, parse_cluster("4xcpu", find_device("cpu")[0]), TRAIN, plan4)
    bt4 = block_times(MODEL, four, TRAIN, plan4, cluster_factors(four))
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
    bt = block_times(MODEL, cluster, TRAIN, plan, cluster_factors(cluster))
    assert bt.tp_fwd == pytest.approx(2262.144e-6, rel=1e-9)
    assert bt.tp_bwd == pytest.approx(2262.144e-6, rel=1e-9)
    # 4 processes (TP2 x DP2) on a profile measured with 2: the in-step all-reduce is not stretched
    # (a waiting rank leaves its core to the others), unlike compute
    four = parse_cluster("4xcpu", dev)
    bt4 = block_times(MODEL, four, TRAIN, Plan(tp=2, dp=2, micro_batch=2, grad_accum=2), cluster_factors(four))
    assert bt4.tp_fwd == pytest.approx(2262.144e-6, rel=1e-9)


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


def test_engine_probe_splits_per_micro_batch_and_per_step():
    """Steps of 1 and 4 micro-batches: 0.05 s and 0.11 s -> 0.02 s per micro-batch, 0.03 s per step."""
    from planner.profiler.engine import split
    rows = [{"precision": "bf16", "micro_batch": 4, "seq": 128, "grad_accum": 1, "step_s": 0.05},
            {"precision": "bf16", "micro_batch": 4, "seq": 128, "grad_accum": 4, "step_s": 0.11}]
    got = split(rows)["bf16"]
    assert got["microbatch_s"] == pytest.approx(0.02, rel=1e-12) and got["step_s"] == pytest.approx(0.03, rel=1e-12)


def test_framework_costs_are_added_per_micro_batch_and_per_step():
    """DP2, accumulation 2, one stage: overhead = step_s + 2 x microbatch_s = 0.03 + 2 x 0.02 = 0.07 s
    more than without the probe; on 4 processes of a 2-process profile both stretch 2x."""
    from planner.cost import estimate
    from planner.specs.step import Framework
    plan = Plan(dp=2, micro_batch=2, grad_accum=2)
    dev = with_step(StepProbes(framework={"bf16": Framework(microbatch_s=0.02, step_s=0.03)}))
    plain = estimate(MODEL, parse_cluster("2xcpu", find_device("cpu")[0]), TRAIN, plan)
    got = estimate(MODEL, parse_cluster("2xcpu", dev), TRAIN, plan)
    assert got.time.overhead - plain.time.overhead == pytest.approx(0.07, rel=1e-12)
    assert got.step_time_s - plain.step_time_s == pytest.approx(0.07, rel=1e-9)
    plan4 = Plan(dp=4, micro_batch=1, grad_accum=2)
    four = estimate(MODEL, parse_cluster("4xcpu", dev), TRAIN, plan4)
    four0 = estimate(MODEL, parse_cluster("4xcpu", find_device("cpu")[0]), TRAIN, plan4)
    assert four.time.overhead - four0.time.overhead == pytest.approx(2 * 0.07, rel=1e-12)
    # fp32 plans take the fp32 probe only
    p32 = Plan(dp=2, micro_batch=2, grad_accum=2, precision="fp32")
    t32 = dataclasses.replace(TRAIN, precision="fp32")
    assert estimate(MODEL, parse_cluster("2xcpu", dev), t32, p32).time.overhead == \
        estimate(MODEL, parse_cluster("2xcpu", find_device("cpu")[0]), t32, p32).time.overhead


def test_profile_writes_the_step_section_from_its_probes():
    """The profiler's raw figures -> step.block (the line through two block points), step.framework
    (the engine probe minus the cost model's terms for the same 1-process plan)."""
    from planner.cost import estimate
    from planner.profiler import gemm, write
    from planner.profiler.layers import LayerPoint
    from planner.profiler.run import ProfileOptions
    from planner.profiler.stats import Sample
    from planner.specs import profile_from_dict

    def smp(v: float) -> Sample:
        return Sample(median=v, min=v, max=v, n=3, unit="s")

    results = [gemm.GemmResult(shape=sh, precision=p, time=smp(sh.flops / r)) for p, r in (("bf16", 2e11), ("fp32", 1e11))
               for t in (1, 2) for sh in gemm.model_shapes(MODEL, 512, t)]
    squares = [gemm.GemmResult(shape=gemm.GemmShape(name="square", m=n, k=n, n=n), precision=p, time=smp(2 * n ** 3 / r))
               for n in (256, 1024) for p, r in (("bf16", 3e11), ("fp32", 1e11), ("fp16", 3e9))]
    points = [LayerPoint(micro_batch=b, seq=128, tp=1, forward=smp(f), backward=smp(2 * f), forward_ckpt=smp(f),
                         backward_ckpt=smp(3 * f), saved_bytes=1, saved_bytes_ckpt=1, allocator_bytes=None,
                         source="test", precision="bf16") for b, f in ((1, 1e-3), (4, 3e-3))]
    engine_rows = [{"precision": "bf16", "micro_batch": 4, "seq": 128, "grad_accum": m, "step_s": s}
                   for m, s in ((1, 0.05), (4, 0.11))]
    raw = {"gemm": results, "gemm_square": squares, "layers": points, "backend": "gloo", "wall_s": 1.0,
           "copy": {"bytes": 1 << 26, "time_s": smp(1e-2).to_dict(), "gbps": 13.4, "method": "copy"},
           "comm": {}, "notes": [], "engine": engine_rows}
    opts = ProfileOptions(model=MODEL, precision="bf16", procs=1)
    data = write.build(raw, {"device": "test cpu"}, opts, name="t", kind="cpu", memory_gb=24.0, per_node=1)
    prof = profile_from_dict(data)
    line = prof.step.block["bf16"]
    plain = dataclasses.replace(prof, step=StepProbes())
    for b, f in ((1, 1e-3), (4, 3e-3)):  # two points: the line passes through both
        x = block_compute_time(MODEL, parse_cluster("1xcpu", plain), TrainSpec(global_batch=b, seq_len=128),
                               Plan(micro_batch=b))
        assert line.time(x) == pytest.approx(3 * f, rel=1e-9)
    fw = data["step"]["framework"]["bf16"]
    assert fw["measured_microbatch_s"] == pytest.approx(0.02) and fw["measured_step_s"] == pytest.approx(0.03)
    with_block = dataclasses.replace(prof, step=StepProbes(block=prof.step.block))
    t = estimate(MODEL, parse_cluster("1xcpu", with_block), TrainSpec(global_batch=4, seq_len=128), Plan(micro_batch=4)).time
    assert fw["microbatch_s"] == pytest.approx(max(0.02 - (t.forward + t.backward), 0.0), rel=1e-9)
    assert fw["step_s"] == pytest.approx(0.03 - t.optimizer, rel=1e-9)


# --- the 2-process engine probe (step.parallel): DP2's concurrency and step, PP2's schedule --------
def _par(**kw):
    from planner.specs.step import Parallel
    base = dict(microbatch_s=0.0, dp_step_s=0.0, pipe_microbatch_s=0.0, pipe_bubble=1.0)
    return Parallel(**{**base, **kw})


def test_parallel_section_parses_and_bad_input_names_the_field():
    s = step_from_dict({"parallel": {"fp32": {"microbatch_s": 0.01, "dp_step_s": 0.02, "pipe_microbatch_s": 0.0,
                                              "pipe_bubble": 0.4}}}, PRECISIONS)
    assert s.parallel["fp32"].dp_step_s == 0.02 and s.parallel["fp32"].pipe_bubble == 0.4 and not s.empty
    assert step_from_dict(s.to_dict(), PRECISIONS) == s  # round trip
    with pytest.raises(ProfileError) as exc:
        step_from_dict({"parallel": {"bf16": {"microbatch_s": 0.01, "dp_step_s": -1, "pipe_microbatch_s": 0,
                                              "pipe_bubble": 1}}}, PRECISIONS)
    assert "step.parallel.bf16.dp_step_s" in exc.value.line() and "planner profile" in exc.value.line()
    with pytest.raises(ProfileError) as exc:
        step_from_dict({"parallel": {"bf16": {"microbatch_s": 0.01}}}, PRECISIONS)
    assert "step.parallel.bf16.dp_step_s" in exc.value.line()


def test_data_parallel_probe_adds_per_micro_batch_and_per_step():
    """DP2 ZeRO-0, accumulation 2, framework 0.02 s / micro-batch and 0.03 s / step; the 2-process
    probe adds 0.01 s per micro-batch (two ranks at once) and 0.05 s per step (DeepSpeed's
    data-parallel step): overhead 0.03 + 0.05 + 2 x (0.02 + 0.01) = 0.14 s; the step time grows
    by exactly the 0.07 s added. ZeRO-3 takes the micro-batch part only, one process neither,
    the other precision's probe does not apply; 4 processes of a 2-process profile stretch 2x."""
    from planner.cost import estimate
    from planner.specs.step import Framework
    fw = {"bf16": Framework(microbatch_s=0.02, step_s=0.03)}
    only_fw = parse_cluster("2xcpu", with_step(StepProbes(framework=fw)))
    dev = with_step(StepProbes(framework=fw, parallel={"bf16": _par(microbatch_s=0.01, dp_step_s=0.05)}))
    two = parse_cluster("2xcpu", dev)
    plan = Plan(dp=2, micro_batch=2, grad_accum=2)
    got, before = estimate(MODEL, two, TRAIN, plan), estimate(MODEL, only_fw, TRAIN, plan)
    assert got.time.overhead == pytest.approx(0.14, rel=1e-12)
    assert got.step_time_s - before.step_time_s == pytest.approx(0.07, rel=1e-9)
    z3 = Plan(dp=2, zero=3, micro_batch=4, grad_accum=1)
    assert estimate(MODEL, two, TRAIN, z3).time.overhead == pytest.approx(0.03 + 0.03, rel=1e-12)
    # ZeRO-3 measured: 0.004 s more per micro-batch, 0.006 per step: 0.03 + 0.006 + 1 x (0.03 + 0.004)
    z3dev = with_step(StepProbes(framework=fw, parallel={"bf16": _par(microbatch_s=0.01, dp_step_s=0.05,
                                                                      zero3_microbatch_s=0.004, zero3_step_s=0.006)}))
    assert estimate(MODEL, parse_cluster("2xcpu", z3dev), TRAIN, z3).time.overhead == \
        pytest.approx(0.03 + 0.006 + 0.03 + 0.004, rel=1e-12)
    one = parse_cluster("1xcpu", dev)
    assert estimate(MODEL, one, TRAIN, Plan(micro_batch=4, grad_accum=2)).time.overhead == \
        pytest.approx(0.03 + 2 * 0.02, rel=1e-12)
    tp2 = Plan(tp=2, micro_batch=4, grad_accum=2)  # two ranks at once, no data-parallel step
    assert estimate(MODEL, two, TRAIN, tp2).time.overhead == pytest.approx(0.03 + 2 * 0.03, rel=1e-12)
    p32, t32 = Plan(dp=2, micro_batch=2, grad_accum=2, precision="fp32"), dataclasses.replace(TRAIN, precision="fp32")
    assert estimate(MODEL, two, t32, p32).time.overhead == estimate(MODEL, only_fw, t32, p32).time.overhead
    four = parse_cluster("4xcpu", dev)
    assert estimate(MODEL, four, TRAIN, Plan(dp=4, micro_batch=1, grad_accum=2)).time.overhead == \
        pytest.approx(2 * 0.14, rel=1e-12)


def test_pipe_probe_replaces_the_micro_batch_cost_and_sends_and_scales_the_bubble():
    """PP2, accumulation 4, framework 0.02 s / micro-batch and 0.03 s / step. Without the probe:
    each stage's micro-batch = its compute c_i + 0.02, the bubble the other stage's micro-batch
    plus one send each way, sends 4 x per micro-batch. With the pipe probe (0.005 s per
    micro-batch, bubble share 0.5): the micro-batch cost is 0.005 (not 0.02 + ...), no sends,
    the bubble half the other stage's c_o + 0.005; overhead 0.03 + 4 x 0.005 = 0.05 s."""
    from planner.cost import estimate
    from planner.cost.estimate import p2p_times
    from planner.specs.step import Framework
    fw = {"bf16": Framework(microbatch_s=0.02, step_s=0.03)}
    only_fw = parse_cluster("2xcpu", with_step(StepProbes(framework=fw)))
    dev = with_step(StepProbes(framework=fw, parallel={"bf16": _par(microbatch_s=0.5, dp_step_s=0.5,
                                                                    pipe_microbatch_s=0.005, pipe_bubble=0.5)}))
    two = parse_cluster("2xcpu", dev)
    plan = Plan(pp=2, micro_batch=2, grad_accum=4)
    before, got = estimate(MODEL, only_fw, TRAIN, plan), estimate(MODEL, two, TRAIN, plan)
    sends = p2p_times(MODEL, only_fw, TRAIN, plan, cluster_factors(only_fw))
    assert len(sends) == 1 and sends[0] > 0
    assert p2p_times(MODEL, two, TRAIN, plan, cluster_factors(two)) == (0.0,)
    c_other = before.time.bubble - sends[0] - 0.02
    assert got.time.bubble == pytest.approx(0.5 * (c_other + 0.005), rel=1e-9)
    assert got.time.pp_comm == 0.0 and before.time.pp_comm == pytest.approx(4 * sends[0], rel=1e-12)
    assert got.time.overhead == pytest.approx(0.03 + 4 * 0.005, rel=1e-12)  # no concurrency, no DP step
    assert got.time.forward == pytest.approx(before.time.forward, rel=1e-12)  # compute unchanged


def test_profile_writes_the_parallel_section_from_the_two_process_probe():
    """One process 0.20 / 0.80 s -> 0.20 s per micro-batch, 0 per step; DP2 steps of 1 and 4
    micro-batches 0.35 / 1.10 s -> 0.25 s per micro-batch, 0.10 s per step; PP2 0.18 / 0.54 s ->
    0.12 per micro-batch, 0.06 per step: each minus the cost model's terms for the same plan
    with the block and framework probes (planner.profiler.steps.parallel_section)."""
    from planner.cost import estimate
    from planner.profiler import steps
    from planner.profiler.run import ProfileOptions
    from planner.specs import profile_from_dict
    rows = [{"layout": lay, "precision": "bf16", "micro_batch": 4, "seq": 128, "grad_accum": m, "step_s": s}
            for lay, m, s in (("1", 1, 0.20), ("1", 4, 0.80), ("dp", 1, 0.35), ("dp", 4, 1.10), ("pp", 1, 0.18),
                              ("pp", 4, 0.54), ("z3", 1, 0.50), ("z3", 4, 1.40))]
    import json
    from pathlib import Path
    data = json.loads((Path(__file__).resolve().parents[2] / "profiles" / "cpu.json").read_text())
    data = dict({k: v for k, v in data.items() if k != "step"}, name="t", builtin=False, gpus_per_node=2)
    block = {"bf16": {"scale": 2.0, "overhead_s": 1e-3}}
    opts = ProfileOptions(model=MODEL, precision="bf16", procs=2)
    framework = steps.framework_section(rows, opts, data, block)
    assert framework["bf16"]["measured_microbatch_s"] == pytest.approx(0.20)  # (0.80 - 0.20) / 3
    par = steps.parallel_section(rows, opts, data, block, framework)["bf16"]
    # two ranks at once: 0.25 s per micro-batch against one process's 0.20 -> concurrency 1.25,
    # with which every CPU-bound term of a 2-process plan is costed
    assert par["concurrency"] == pytest.approx(1.25, rel=1e-12)
    keys = ("microbatch_s", "dp_step_s", "pipe_microbatch_s", "pipe_bubble", "concurrency")
    prof = profile_from_dict({**data, "step": {"block": block, "framework": {
        "bf16": {k: framework["bf16"][k] for k in ("microbatch_s", "step_s")}},
        "parallel": {"bf16": {"microbatch_s": 0.0, "dp_step_s": 0.0, "pipe_microbatch_s": 0.0, "pipe_bubble": 1.0,
                              "concurrency": 1.25}}}})
    two = parse_cluster("2xcpu", prof)
    t = estimate(MODEL, two, TrainSpec(global_batch=8, seq_len=128), Plan(dp=2, micro_batch=4)).time
    fw = framework["bf16"]
    # the one-process micro-batch (compute + framework = 0.20 s) x 1.25 is DP2's 0.25: nothing left
    assert par["microbatch_s"] == pytest.approx(max(0.25 - (t.forward + t.backward) - 1.25 * fw["microbatch_s"], 0.0),
                                                abs=1e-12)
    assert par["microbatch_s"] == pytest.approx(0.0, abs=1e-9)
    assert par["dp_step_s"] == pytest.approx(0.10 - 1.25 * fw["step_s"] - t.optimizer - t.dp_sync)
    tp = estimate(MODEL, two, TrainSpec(global_batch=4, seq_len=128), Plan(pp=2, micro_batch=4)).time
    assert par["pipe_microbatch_s"] == pytest.approx(0.12 - (tp.forward + tp.backward))
    assert par["pipe_bubble"] == pytest.approx((0.06 - 1.25 * fw["step_s"] - tp.optimizer) / 0.12)
    assert min(par["dp_step_s"], par["pipe_microbatch_s"], par["pipe_bubble"]) > 0
    # DP2 ZeRO-3 0.50 / 1.40 s -> 0.30 per micro-batch, 0.20 per step, minus the model's with the terms above
    with_par = profile_from_dict({**data, "step": {"block": block, "framework": {
        "bf16": {k: framework["bf16"][k] for k in ("microbatch_s", "step_s")}},
        "parallel": {"bf16": {k: par[k] for k in keys}}}})
    t1, t4 = (estimate(MODEL, parse_cluster("2xcpu", with_par), TrainSpec(global_batch=8 * m, seq_len=128),
                       Plan(dp=2, zero=3, micro_batch=4, grad_accum=m)).step_time_s for m in (1, 4))
    assert par["zero3_microbatch_s"] == pytest.approx(0.30 - (t4 - t1) / 3)
    assert par["zero3_step_s"] == pytest.approx(0.20 - (t1 - (t4 - t1) / 3))
    assert par["zero3_microbatch_s"] > 0 and par["zero3_step_s"] > 0
    # the profile's step section carries it (build() adds step.parallel when the probe ran)
    assert step_from_dict({"parallel": {"bf16": {k: par[k] for k in ("microbatch_s", "dp_step_s",
                                                                     "pipe_microbatch_s", "pipe_bubble")}}},
                          PRECISIONS).parallel["bf16"].pipe_bubble == pytest.approx(par["pipe_bubble"])


# --- the optimizer probe (step.optimizer): seconds per parameter, replacing the memory-bound update ----
def test_optimizer_probe_fit_is_the_slope_between_two_sizes():
    """2 Mi parameters in 0.03 s, 16 Mi in 0.17 s: slope 0.14 / (14 x 2^20) s per parameter,
    fixed 0.03 - 2^21 x slope = 0.03 - 0.02 = 0.01 s; a flat or falling pair gives nothing."""
    from planner.profiler.optimizer import fit

    def row(p, n, t):
        return {"precision": p, "params": n, "time_s": {"median": t}}
    got = fit([row("bf16", 2 << 20, 0.03), row("bf16", 16 << 20, 0.17), row("fp32", 2 << 20, 0.05),
               row("fp32", 16 << 20, 0.05)])
    assert got["bf16"]["param_s"] == pytest.approx(0.14 / (14 * 2 ** 20), rel=1e-12)
    assert got["bf16"]["fixed_s"] == pytest.approx(0.01, rel=1e-9) and got["bf16"]["points"] == 2
    assert "fp32" not in got


def test_optimizer_time_is_the_measured_seconds_per_parameter():
    """The memory-bound update costs n x 30 B / copy bandwidth (mixed precision); with the probe
    it costs n x param_s: their ratio is param_s x bandwidth / 30, whatever n. ZeRO-1 over DP2
    updates half the parameters; 4 processes of a 2-process profile stretch it 2x; the fp32
    probe does not apply to bf16 plans; parse errors name the field."""
    from planner.cost import estimate
    from planner.cost.params import stage_params
    from planner.specs.step import OptimizerProbe
    base = find_device("cpu")[0]
    dev = with_step(StepProbes(optimizer={"bf16": OptimizerProbe(param_s=2e-8)}))
    plan = Plan(dp=2, micro_batch=2, grad_accum=2)
    plain = estimate(MODEL, parse_cluster("2xcpu", base), TRAIN, plan).time.optimizer
    got = estimate(MODEL, parse_cluster("2xcpu", dev), TRAIN, plan).time.optimizer
    assert got / plain == pytest.approx(2e-8 * base.hbm_bandwidth_gbps * 1e9 / 30.0, rel=1e-9)
    n = stage_params(MODEL, plan)[0]
    assert got == pytest.approx(n * 2e-8, rel=1e-12)
    z1 = estimate(MODEL, parse_cluster("2xcpu", dev), TRAIN, Plan(dp=2, zero=1, micro_batch=2, grad_accum=2))
    assert z1.time.optimizer == pytest.approx(n / 2 * 2e-8, rel=1e-12)
    four = estimate(MODEL, parse_cluster("4xcpu", dev), TRAIN, Plan(dp=4, micro_batch=1, grad_accum=2))
    assert four.time.optimizer == pytest.approx(2 * n * 2e-8, rel=1e-12)
    p32, t32 = Plan(dp=2, micro_batch=2, grad_accum=2, precision="fp32"), dataclasses.replace(TRAIN, precision="fp32")
    assert estimate(MODEL, parse_cluster("2xcpu", dev), t32, p32).time.optimizer == \
        estimate(MODEL, parse_cluster("2xcpu", base), t32, p32).time.optimizer
    s = step_from_dict({"optimizer": {"fp32": {"param_s": 1e-8, "points": 2}}}, PRECISIONS)
    assert s.optimizer["fp32"].param_s == 1e-8 and not s.empty and step_from_dict(s.to_dict(), PRECISIONS) == s
    with pytest.raises(ProfileError) as exc:
        step_from_dict({"optimizer": {"bf16": {"param_s": 0}}}, PRECISIONS)
    assert "step.optimizer.bf16.param_s" in exc.value.line() and "planner profile" in exc.value.line()


def test_concurrency_stretches_every_cpu_bound_term_of_a_multi_process_plan():
    """Concurrency 1.5 (bf16): a 2-process plan's compute (forward, backward), optimizer update
    and framework costs all take 1.5x what they take without it; communication does not
    stretch; a 1-process plan and the fp32 plan are unchanged; on 4 processes of a 2-process
    profile it compounds with the 2x time-sharing."""
    from planner.cost import estimate
    from planner.specs.step import Framework, OptimizerProbe
    fw = {"bf16": Framework(microbatch_s=0.02, step_s=0.03)}
    opt = {"bf16": OptimizerProbe(param_s=1e-8)}
    base = with_step(StepProbes(framework=fw, optimizer=opt, parallel={"bf16": _par()}))
    conc = with_step(StepProbes(framework=fw, optimizer=opt, parallel={"bf16": _par(concurrency=1.5)}))
    plan = Plan(dp=2, micro_batch=2, grad_accum=2)
    a = estimate(MODEL, parse_cluster("2xcpu", base), TRAIN, plan).time
    b = estimate(MODEL, parse_cluster("2xcpu", conc), TRAIN, plan).time
    for k in ("forward", "backward", "optimizer", "overhead"):
        assert getattr(b, k) == pytest.approx(1.5 * getattr(a, k), rel=1e-12), k
    assert b.overhead == pytest.approx(1.5 * (0.03 + 2 * 0.02), rel=1e-12)
    assert b.dp_sync == pytest.approx(a.dp_sync, rel=1e-12)  # a waiting rank leaves its core
    one = Plan(micro_batch=4, grad_accum=2)
    assert estimate(MODEL, parse_cluster("1xcpu", conc), TRAIN, one).step_time_s == \
        estimate(MODEL, parse_cluster("1xcpu", base), TRAIN, one).step_time_s
    p32, t32 = Plan(dp=2, micro_batch=2, grad_accum=2, precision="fp32"), dataclasses.replace(TRAIN, precision="fp32")
    assert estimate(MODEL, parse_cluster("2xcpu", conc), t32, p32).step_time_s == \
        estimate(MODEL, parse_cluster("2xcpu", base), t32, p32).step_time_s
    plan4 = Plan(dp=4, micro_batch=1, grad_accum=2)
    a4 = estimate(MODEL, parse_cluster("4xcpu", base), TRAIN, plan4).time
    b4 = estimate(MODEL, parse_cluster("4xcpu", conc), TRAIN, plan4).time
    assert b4.overhead == pytest.approx(2 * 1.5 * (0.03 + 2 * 0.02), rel=1e-12)
    assert b4.forward == pytest.approx(1.5 * a4.forward, rel=1e-12)
    s = step_from_dict({"parallel": {"bf16": {"microbatch_s": 0, "dp_step_s": 0, "pipe_microbatch_s": 0,
                                              "pipe_bubble": 1, "concurrency": 1.5}}}, PRECISIONS)
    assert s.parallel["bf16"].concurrency == 1.5 and step_from_dict(s.to_dict(), PRECISIONS) == s
    assert step_from_dict({"parallel": {"bf16": {"microbatch_s": 0, "dp_step_s": 0, "pipe_microbatch_s": 0,
                                                 "pipe_bubble": 1}}}, PRECISIONS).parallel["bf16"].concurrency == 1.0


# --- the block probe by term class: GEMMs, attention core and element-wise each with its own multiplier ----
def test_block_classes_fit_recovers_per_class_multipliers():
    """Points whose measured time is 0.8 G + 1.5 C + 11 E + 1 ms exactly: the fit gives them back
    (the sizes differ enough to separate the classes); a column that would need a negative
    multiplier is dropped (0), fewer than 6 points give nothing."""
    from planner.profiler.steps import fit_classes
    parts = [(g, c, e) for g, c, e in ((1e-3, 2e-4, 1e-4), (4e-3, 4e-4, 2e-4), (16e-3, 8e-4, 4e-4),
                                       (2e-3, 1e-3, 1e-4), (8e-3, 4e-3, 8e-4), (3e-3, 1e-4, 9e-4), (5e-3, 2e-3, 3e-4))]
    meas = [0.8 * g + 1.5 * c + 11.0 * e + 1e-3 for g, c, e in parts]
    (gs, cs, es, over), worst = fit_classes(parts, meas)
    assert (gs, cs, es, over) == pytest.approx((0.8, 1.5, 11.0, 1e-3), rel=1e-6) and worst < 1e-9
    meas2 = [2.0 * g + 1e-3 for g, c, e in parts]  # no core, no element-wise time
    (gs, cs, es, over), _ = fit_classes(parts, meas2)
    assert gs == pytest.approx(2.0, rel=1e-9) and over == pytest.approx(1e-3, rel=1e-9)
    assert cs == pytest.approx(0.0, abs=1e-9) and es == pytest.approx(0.0, abs=1e-9)
    assert fit_classes(parts[:5], meas[:5]) is None


def test_block_classes_weigh_each_term_by_its_own_multiplier():
    """gemm 0.8, core 1.5, element-wise 11, overhead 3 ms: the block's forward + backward is
    0.8 G + 1.5 C + 11 E + 3 ms where G, C, E are block_compute_parts (which sum to
    block_compute_time); a probe without classes keeps scale x the sum."""
    from planner.cost.block import block_compute_parts
    plan = Plan(dp=2, micro_batch=2, grad_accum=2)
    plain = parse_cluster("2xcpu", find_device("cpu")[0])
    g, c, e = block_compute_parts(MODEL, plain, TRAIN, plan)
    assert g + c + e == pytest.approx(block_compute_time(MODEL, plain, TRAIN, plan), rel=1e-12)
    assert min(g, c, e) > 0
    dev = with_step(StepProbes(block={"bf16": BlockProbe(scale=2.0, overhead_s=3e-3, gemm_scale=0.8, core_scale=1.5,
                                                         elementwise_scale=11.0)}))
    two = parse_cluster("2xcpu", dev)
    bt = block_times(MODEL, two, TRAIN, plan, cluster_factors(two))
    assert bt.forward + bt.backward == pytest.approx(0.8 * g + 1.5 * c + 11.0 * e + 3e-3, rel=1e-12)
    s = step_from_dict({"block": {"bf16": {"scale": 2.0, "overhead_s": 3e-3, "gemm_scale": 0.8, "core_scale": 1.5,
                                           "elementwise_scale": 11.0}}}, PRECISIONS)
    assert s.block["bf16"].classes == (0.8, 1.5, 11.0) and step_from_dict(s.to_dict(), PRECISIONS) == s
    with pytest.raises(ProfileError) as exc:
        step_from_dict({"block": {"bf16": {"scale": 2.0, "overhead_s": 0, "gemm_scale": 0.8}}}, PRECISIONS)
    assert "step.block.bf16" in exc.value.line()


def test_profiler_runs_under_the_executors_allocator():
    """The CPU probes run with the executor's mmap threshold (planner.profiler.device): twenty
    100 kB mallocs, below glibc's default 128 KiB threshold (so from the heap: mallinfo2's
    hblks, the mmap'd chunks, unchanged), become their own mmap'd chunks once executor_allocator() has run (at least half of them:
    the heap's free chunks may still serve a few); the engine and
    executor processes get the same figure in their environment."""
    import inspect
    import subprocess
    import sys

    from planner.profiler import device, engine
    from planner.runtime.train import launch
    assert device.EXECUTOR_MMAP_THRESHOLD == 65536
    assert "str(EXECUTOR_MMAP_THRESHOLD)" in inspect.getsource(launch.rank_environment)
    assert "str(EXECUTOR_MMAP_THRESHOLD)" in inspect.getsource(engine._launch)
    code = """
import ctypes, os, sys
class MI(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6"); libc.mallinfo2.restype = MI; libc.malloc.restype = ctypes.c_void_p
def mmapped_after_mallocs():
    before = libc.mallinfo2().hblks
    ps = [libc.malloc(100_000) for _ in range(20)]
    n = libc.mallinfo2().hblks - before
    for p in ps:
        libc.free(ctypes.c_void_p(p))
    return n
if sys.argv[1] == "executor":
    from planner.profiler.device import executor_allocator
    print(executor_allocator(), os.environ["MALLOC_MMAP_THRESHOLD_"])
print(mmapped_after_mallocs())
"""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    runs = {how: subprocess.run([sys.executable, "-c", code, how], capture_output=True, text=True, env=env)
            for how in ("default", "executor")}
    if any("mallinfo2" in r.stderr for r in runs.values()):
        pytest.skip("no glibc >= 2.33 here")
    assert runs["default"].stdout.split() == ["0"], runs["default"].stderr
    ok, threshold, mmapped = runs["executor"].stdout.split()
    assert (ok, threshold) == ("True", "65536") and int(mmapped) >= 10, runs["executor"].stderr


def test_zero2_probe_adds_one_reduction_per_micro_batch_beyond_the_first():
    """DP2 ZeRO-2 measured 0.006 s + 2e-9 s per parameter per micro-batch beyond the first
    (tiny chatglm3-6b: psi parameters on each rank): accumulation 4 adds 3 x (0.006 + 2e-9 psi)
    to dp_sync; accumulation 1, ZeRO-1 and one process add nothing; 4 processes of a
    2-process profile stretch it 2x."""
    from planner.cost import estimate
    from planner.cost.params import stage_params
    base = _par(microbatch_s=0.0, dp_step_s=0.0)
    plain = with_step(StepProbes(parallel={"bf16": base}))
    dev = with_step(StepProbes(parallel={"bf16": dataclasses.replace(base, zero2_fixed_s=0.006,
                                                                     zero2_param_s=2e-9)}))
    psi = max(stage_params(MODEL, Plan(dp=2, zero=2)))
    assert psi > 1_000_000  # tiny chatglm3-6b: ~1.2 M
    for world, plan, added in (
            (2, Plan(dp=2, zero=2, micro_batch=1, grad_accum=4), 3 * (0.006 + 2e-9 * psi)),
            (2, Plan(dp=2, zero=2, micro_batch=4, grad_accum=1), 0.0),
            (2, Plan(dp=2, zero=1, micro_batch=1, grad_accum=4), 0.0),
            (4, Plan(dp=4, zero=2, micro_batch=1, grad_accum=2), 2 * (0.006 + 2e-9 * psi))):
        cl, cl0 = parse_cluster(f"{world}xcpu", dev), parse_cluster(f"{world}xcpu", plain)
        train = dataclasses.replace(TRAIN, global_batch=plan.dp * plan.micro_batch * plan.grad_accum)
        got = estimate(MODEL, cl, train, plan).time.dp_sync - estimate(MODEL, cl0, train, plan).time.dp_sync
        assert got == pytest.approx(added, rel=1e-12, abs=1e-15), (world, plan)


def test_zero2_fit_is_a_line_over_the_model_sizes():
    from planner.profiler.steps import line_through
    assert line_through([1.0, 3.0], [2.0, 4.0]) == pytest.approx((1.0, 1.0))
    # a negative intercept (slope 2, intercept -1) refits through the origin on relative error:
    # x / y = 1, 2/3: slope = (5/3) / (13/9) = 15/13
    assert line_through([1.0, 2.0], [1.0, 3.0]) == pytest.approx((0.0, 15 / 13))
    assert line_through([2.0], [3.0]) == pytest.approx((0.0, 1.5))  # one model: through the origin
    assert line_through([1.0, 2.0], [0.0, 0.0]) == (0.0, 0.0)  # nothing beyond the model


def test_data_parallel_collectives_do_not_hide_on_a_cpu():
    """DeepSpeed's CPU accelerator has no streams: its collectives run in line. dp_comm of a CPU
    cluster hides nothing whatever dp_overlap says; the same plan on a GPU still hides."""
    from planner.cost.estimate import dp_comm
    from planner.cost import engines
    plan = Plan(dp=2, zero=2, micro_batch=2, grad_accum=2)
    cpu = parse_cluster("2xcpu", find_device("cpu")[0])
    f = cluster_factors(cpu, plan=plan)
    psi, mb, bwd = (1_000_000,), (1.0,), (0.6,)  # a window larger than the collectives
    hidden = dp_comm(cpu, plan, engines.engine_for(plan), psi, f.replace(dp_overlap=0.9), mb, bwd)
    exposed = dp_comm(cpu, plan, engines.engine_for(plan), psi, f.replace(dp_overlap=0.0), mb, bwd)
    assert hidden == exposed > 0
    gpu = parse_cluster("2xA100", find_device("A100-80GB")[0])
    g = cluster_factors(gpu, plan=plan)
    assert dp_comm(gpu, plan, engines.engine_for(plan), psi, g.replace(dp_overlap=0.9), mb, bwd) < \
        dp_comm(gpu, plan, engines.engine_for(plan), psi, g.replace(dp_overlap=0.0), mb, bwd)
