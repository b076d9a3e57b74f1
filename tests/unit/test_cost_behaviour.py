"""The cost model's behaviour: each knob moves the estimate the way the formulas say."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from planner.cost import estimate, layer_costs
from planner.specs import Plan, TrainSpec, parse_cluster, preset, scale


@pytest.fixture(scope="module")
def glm130b():
    return preset("glm-130b"), parse_cluster("96x8xA100-40GB"), TrainSpec(global_batch=4224, seq_len=2048)


def published_plan(**kw):
    base = dict(dp=24, tp=4, pp=8, zero=1, micro_batch=1, grad_accum=176, recompute="full")
    base.update(kw)
    return Plan(**base)


def test_published_glm130b_plan_fits_and_is_plausible(glm130b):
    est = estimate(*glm130b, published_plan())
    assert est.feasible, est.reasons
    assert est.peak_memory_gb < 40
    assert 0.2 < est.mfu < est.hfu < 0.8
    assert est.bubble_fraction == pytest.approx(7 / 176)


def test_no_recompute_does_not_fit_130b_on_40gb(glm130b):
    est = estimate(*glm130b, published_plan(recompute="none"))
    assert not est.feasible
    assert any("needs" in r and "> 42.4 GB" in r and "activations" in r for r in est.reasons)  # 40,448 MiB


def test_recompute_trades_memory_for_time(glm130b):
    m, c, t = glm130b
    t = dataclasses.replace(t, attention="eager")  # selective saves memory only where the softmax is stored
    plan = published_plan(tp=8, dp=12, grad_accum=352)
    none, sel, full = (estimate(m, c, t, dataclasses.replace(plan, recompute=r)) for r in ("none", "selective", "full"))
    assert full.peak_memory_bytes < sel.peak_memory_bytes < none.peak_memory_bytes
    assert none.step_time_s < sel.step_time_s < full.step_time_s
    assert full.time.recompute > sel.time.recompute > none.time.recompute == 0
    assert full.hfu > full.mfu and none.hfu == pytest.approx(none.mfu)


def test_partial_checkpointing_is_between(glm130b):
    m, c, t = glm130b
    layers = published_plan().layers_per_stage(m.layers)
    half = tuple(n // 2 for n in layers)
    part = estimate(m, c, t, published_plan(stage_layers=layers, recompute_layers=half))
    none = estimate(m, c, t, published_plan(recompute="none"))
    full = estimate(m, c, t, published_plan())
    assert full.peak_memory_bytes < part.peak_memory_bytes < none.peak_memory_bytes
    assert none.step_time_s < part.step_time_s < full.step_time_s


def test_zero_stages_shrink_model_states_and_stage3_gathers():
    m, c = preset("chatglm3-6b"), parse_cluster("8xA100")
    t = TrainSpec(global_batch=64, seq_len=2048)
    ests = [estimate(m, c, t, Plan(dp=8, zero=z, micro_batch=1, grad_accum=8, recompute="full")) for z in range(4)]
    states = [e.stage_memory[0].params + e.stage_memory[0].grads + e.stage_memory[0].optimizer for e in ests]
    assert states[0] > states[1] > states[2] > states[3]
    assert ests[3].time.zero_gather > 0 and ests[2].time.zero_gather == 0


def test_interleaving_cuts_the_bubble(glm130b):
    m, c, t = glm130b
    plain = estimate(m, c, t, published_plan())
    inter = estimate(m, c, t, published_plan(schedule="interleaved", interleave=2, grad_accum=176))
    assert inter.bubble_fraction == pytest.approx(plain.bubble_fraction / 2)
    assert inter.time.bubble < plain.time.bubble
    assert inter.peak_memory_bytes > plain.peak_memory_bytes  # (1 + (p-1)/(p m)) more in flight


def test_sequence_parallel_cuts_activations(glm130b):
    m, c, t = glm130b
    a = estimate(m, c, t, published_plan(recompute="selective", tp=8, dp=12, grad_accum=352))
    b = estimate(m, c, t, published_plan(recompute="selective", tp=8, dp=12, grad_accum=352, sequence_parallel=True))
    assert b.stage_memory[0].activations < a.stage_memory[0].activations


def test_structural_problems_are_reasons_not_crashes(glm130b):
    m, c, t = glm130b
    est = estimate(m, c, t, Plan(dp=3, tp=16, pp=1, micro_batch=1, grad_accum=1))
    assert not est.feasible
    text = " ".join(est.reasons)
    assert "768 devices" in text and "tensor parallelism stays inside a node" in text and "global batch" in text


def test_unsupported_precision_is_a_reason():
    m, c = preset("chatglm-6b"), parse_cluster("8xV100")
    est = estimate(m, c, TrainSpec(global_batch=8, seq_len=512), Plan(dp=8, zero=3, precision="bf16"))
    assert not est.feasible and any("does not support bf16" in r for r in est.reasons)


def test_layer_costs_of_the_published_plan(glm130b):
    m, c, t = glm130b
    plan = published_plan()
    lc = layer_costs(m, c, t, plan)
    assert lc.block_time_full_recompute > lc.block_time > 0
    assert lc.block_act_bytes > lc.block_act_bytes_full_recompute > 0
    assert lc.in_flight[0] == 8 and lc.in_flight[-1] == 1


def test_profile_factors_change_the_estimate(glm130b):
    m, c, t = glm130b
    dev = dataclasses.replace(c.device, factors={**c.device.factors, "compute_scale": 2.0})
    slow = estimate(m, dataclasses.replace(c, device=dev), t, published_plan())
    assert slow.step_time_s > 1.3 * estimate(m, c, t, published_plan()).step_time_s


def test_cost_model_imports_no_heavy_libraries():
    code = ("import sys, planner.cost, planner.specs; "
            "bad = [m for m in ('torch', 'deepspeed', 'optuna', 'pandas') if m in sys.modules]; "
            "sys.exit(1 if bad else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_stage_times_cover_the_steady_state(glm130b):
    est = estimate(*glm130b, published_plan())
    assert len(est.stage_times) == 8
    slowest = max(f + b for f, b in est.stage_times)
    assert all(0 < f < b for f, b in est.stage_times)  # backward (+ recompute) outweighs forward
    assert 176 * slowest == pytest.approx(est.time.forward + est.time.backward + est.time.recompute + est.time.tp_comm)


def test_per_precision_gemm_curves_are_used():
    from planner.specs.hardware import load_profile, profile_from_dict
    import json
    data = json.loads(open(load_profile.__globals__["PROFILES_DIR"] / "cpu.json").read())
    data["gemm_efficiency_by_precision"] = {"fp32": [[1e6, 0.02], [1e10, 0.05]]}
    slow32 = profile_from_dict(data)
    base = parse_cluster("2xcpu")
    m, t = preset("chatglm3-6b"), TrainSpec(global_batch=2, seq_len=128)
    from planner.specs import scale
    m = scale(m, "tiny")
    plan32, plan16 = Plan(dp=2, precision="fp32"), Plan(dp=2, precision="bf16")
    c2 = dataclasses.replace(base, device=slow32)
    assert estimate(m, c2, t, plan32).step_time_s > 3 * estimate(m, base, t, plan32).step_time_s
    assert estimate(m, c2, t, plan16).step_time_s == estimate(m, base, t, plan16).step_time_s


def test_more_cpu_processes_than_measured_share_the_cores():
    m = scale(preset("chatglm3-6b"), "tiny")
    t = TrainSpec(global_batch=8, seq_len=128)
    two, four = parse_cluster("2xcpu"), parse_cluster("4xcpu")
    a = estimate(m, two, t, Plan(dp=2, micro_batch=4))
    b = estimate(m, four, t, Plan(dp=2, tp=2, micro_batch=4))
    assert b.time.forward > 0.9 * a.time.forward  # half the work per rank, on half the cores
    gpu = parse_cluster("8xA100")
    assert estimate(m, gpu, t, Plan(dp=8, micro_batch=1)).time.forward == pytest.approx(
        estimate(m, parse_cluster("4xA100"), TrainSpec(global_batch=4, seq_len=128), Plan(dp=4, micro_batch=1)).time.forward)
