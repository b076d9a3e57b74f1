"""The lab's measurement (issue 20): model states by the estimate's classes, the allocated peak
as a GPU counts it, and the cost model's prediction of both, field by field."""
from __future__ import annotations

import pytest
import torch

from planner.cost import estimate
from planner.cost.states import counted_phases, rank_states
from planner.runtime.observe.allocated import AllocatedMeter, allocated_peak
from planner.runtime.observe.measure import CLASSES, storage_class
from planner.runtime.observe.metrics import state_errors
from planner.specs import Plan, TrainSpec, parse_cluster, preset, scale

TINY = scale(preset("chatglm3-6b"), "tiny")
TRAIN = TrainSpec(global_batch=8, seq_len=128)


@pytest.mark.parametrize("role, name, cls", [
    ("optimizer", "optimizer.ipg_buckets[torch.bfloat16].buffer", "buckets"),      # ZeRO-3's kept reduce bucket
    ("optimizer", "optimizer.grad_partitions_flat_buffer", "grads"),
    ("optimizer", "optimizer.fp32_partitioned_groups_flat[i]", "optimizer"),
    ("optimizer", "optimizer.fp32_partitioned_groups_flat[i].grad", "grads"),
    ("optimizer", "optimizer.single_partition_of_fp32_groups[i].grad", "grads"),
    ("optimizer", "optimizer.optimizer.state[p][exp_avg]", "optimizer"),
    ("optimizer", "optimizer.averaged_gradients[i][i]", "grads"),
    ("optimizer", "optimizer.bit16_groups_flat[i]", "params"),
    ("optimizer", "optimizer.temp_grad_buffer_for_gpu_offload", "optimizer"),
    ("optimizer", "gathered weights (ZeRO-3, live)", "buckets"),
    ("optimizer", "persistent weights (ZeRO-3, kept gathered)", "params"),
    ("optimizer", "optimizer.non_expert_gradients[i]", "grads"),                    # BF16_Optimizer (pipeline)
    ("optimizer", "optimizer._global_grad_norm", "optimizer"),
    ("optimizer", "optimizer.something_new", "other"),                             # named by its label
    ("params", "module.ds_tensor", "params"),
    ("grads", "module.grad", "grads"),
    ("grads", "optimizer.temp_grad_buffer_for_cpu_offload", "grads"),              # host role kept
])
def test_each_deepspeed_buffer_lands_in_the_estimates_class(role, name, cls) -> None:
    assert storage_class(role, name) == cls
    assert cls in CLASSES


def test_zero3_states_per_class_are_the_engines_buffers_hand_computed() -> None:
    """Tiny ChatGLM3, DP2 ZeRO-3 bf16: the reduce bucket (reduce_bucket_size 5e7 x 2 B) is a
    bucket, not optimizer state -- the 6.06x of the old "model states alone"."""
    plan = Plan(dp=2, zero=3, micro_batch=4, grad_accum=1)
    got = rank_states(TINY, parse_cluster("2xcpu"), TRAIN, plan, 1)
    psi = 1124480  # elements of the tiny model; the rank's bf16 weight partition: psi / 2 x 2 B
    assert got["device"]["buckets"] == 2 * plan.bucket_elements == 100_000_000
    assert got["device"]["grads"] == psi / 2 * 2                 # bf16 gradient partition
    assert got["device"]["optimizer"] == 12 * psi / 2 == 6746880  # fp32 master + 2 moments of psi / 2
    assert got["host"] == {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "buckets": 0.0}


def test_pipeline_is_counted_after_the_step_without_gradients() -> None:
    assert counted_phases(Plan(pp=2, micro_batch=2, grad_accum=4)) == ("always",)
    assert counted_phases(Plan(dp=2, micro_batch=2, grad_accum=2)) == ("always", "grads")
    got = rank_states(TINY, parse_cluster("2xcpu"), TRAIN, Plan(pp=2, micro_batch=2, grad_accum=4), 0)
    # BF16_Optimizer: the gradient accumulation buffer (bf16, whole) stays; p.grad is freed
    assert got["device"]["grads"] == got["device"]["params"] > 0


def test_rank_coords_follow_the_plans_order() -> None:
    plan = Plan(tp=2, pp=2, dp=2, zero=1, micro_batch=2, grad_accum=2)
    assert [(c.pp, c.dp, c.tp) for c in map(plan.coords, (0, 1, 2, 5, 7))] == \
        [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 1), (1, 1, 1)]


def test_state_errors_subtract_field_by_field() -> None:
    measured = [{"params": 1.0, "grads": 0.5, "optimizer": 3.0, "buckets": 0.1, "other": 0.01}]
    predicted = [{"params": 1.0, "grads": 0.4, "optimizer": 3.0, "buckets": 0.2}]
    assert state_errors(measured, predicted) == [
        {"params": 0.0, "grads": pytest.approx(-0.1), "optimizer": 0.0, "buckets": 0.1, "other": -0.01}]


def test_allocated_peak_counts_from_the_reset_mark() -> None:
    M = AllocatedMeter.MARK
    ev = [("[memory]", 1, 100, "DeviceType.CPU"), ("[memory]", 2, 50, "DeviceType.CPU"),
          ("[memory]", 3, -120, "DeviceType.CPU"), (M, 4, 0, "DeviceType.CPU"),      # 30 live at the mark
          ("[memory]", 5, 20, "DeviceType.CPU"), ("[memory]", 6, -20, "DeviceType.CPU"),
          ("aten::mm", 7, 0, "DeviceType.CPU"), ("[memory]", 8, 7, "DeviceType.CUDA")]
    assert allocated_peak(ev) == 50          # 30 + 20, not the 150 before the mark
    assert allocated_peak(ev[:3]) == 150     # no mark: from the start
    assert allocated_peak([(M, 1, 0, "DeviceType.CPU")] + [(n, t + 1, b, d) for n, t, b, d in ev[:2]]) == 150


def test_allocated_meter_sees_live_tensor_bytes() -> None:
    """A real profiler window: 4 MB live at the reset, 1 MB more, then 4 MB freed -- peak 5 MB."""
    meter = AllocatedMeter()
    a = torch.empty(1_000_000)               # 4 MB, before the reset (like the model states)
    meter.reset()
    b = torch.empty(250_000)                 # 1 MB
    del a
    c = torch.empty(100_000)
    peak = meter.stop()
    assert not meter.running
    assert peak == 5_000_000
    del b, c


def test_estimate_predicts_the_allocated_peak_beside_the_resident_one() -> None:
    """CPU, DP2 ZeRO-3: the 100 MB reduce bucket is allocated whole but only the pages the rank's
    gradients touch are resident; the allocated peak leaves out the process (overhead)."""
    plan = Plan(dp=2, zero=3, micro_batch=4, grad_accum=1)
    est = estimate(TINY, parse_cluster("2xcpu"), TRAIN, plan)
    rss, alloc = est.stage_memory[0], est.allocated_memory[0]
    assert alloc.overhead == 0.0 and rss.overhead == est.headroom_bytes
    # resident: min(bucket, psi) elements touched, psi = 1124480 (2 B each)
    assert alloc.buckets - rss.buckets == 100_000_000 - 2 * 1124480
    assert est.allocated_peak_bytes == pytest.approx(alloc.total)
    assert est.to_json()["allocated_peak_gb"] == pytest.approx(alloc.total / 1e9)


def test_a_pipelines_zero1_holds_two_reduce_buffers() -> None:
    """DeepSpeed turns overlap_comm off under a pipeline, yet reduce_gradients(pipeline_parallel)
    appends a second reduce_bucket_size buffer: 2 x 5e7 x 2 B allocated (a DP2xPP2 ZeRO-1 run
    measured 206-207 MB per rank, docs/lab.md); without a pipeline, overlap_comm alone doubles it."""
    for plan in (Plan(dp=2, pp=2, zero=1, micro_batch=2, grad_accum=2), Plan(dp=2, zero=1, micro_batch=2, grad_accum=2)):
        est = estimate(TINY, parse_cluster(f"{plan.world_size}xcpu"), TRAIN, plan)
        assert est.allocated_memory[0].buckets == 2 * plan.bucket_elements * 2 == 200_000_000
    off = Plan(dp=2, zero=1, micro_batch=2, grad_accum=2, overlap_comm=False)
    assert estimate(TINY, parse_cluster("2xcpu"), TRAIN, off).allocated_memory[0].buckets == 100_000_000
