"""Megatron-Core's data-parallel sync as its runtime runs it (profiles/runtimes/megatron-core.json):
a bf16 (or fp8) plan reduce-scatters its gradients in fp32 (Megatron-LM forces
accumulate_allreduce_grads_in_fp32 for bf16 -> DistributedDataParallelConfig.grad_reduce_in_fp32),
and --overlap-param-gather hides the distributed optimizer's parameter all-gather behind the
next step's forward, not after the step. DeepSpeed's ZeRO-1 keeps its 16-bit reduce and its
exposed post-step gather."""
import pytest

from planner.cost import comm, engines
from planner.cost.estimate import dp_comm
from planner.cost.factors import Factors
from planner.cost.runtime import get_runtime
from planner.specs import Plan, parse_cluster

C = parse_cluster("2xH100")
F = Factors(dp_overlap=1.0)
PSI = 100_000_000


def _collectives(plan: Plan, grad_bytes: float) -> tuple[float, float]:
    """(reduce-scatter, all-gather) seconds of PSI parameters, bucket by bucket, the gradients at
    grad_bytes per element and the parameters at 2."""
    (route,) = comm.group_routes(C, plan, "dp")
    nb = -(-PSI // plan.bucket_elements)
    go = (F.comm_efficiency, F.latency_scale, F.network_efficiency)
    rs = nb * comm.ROUTE_COLLECTIVES["reduce_scatter"](PSI * grad_bytes / nb, 2, route, *go)
    ag = nb * comm.ROUTE_COLLECTIVES["all_gather"](PSI * 2.0 / nb, 2, route, *go)
    return rs, ag


def test_the_runtime_files_say_which_runtime_reduces_in_fp32_and_gathers_in_forward():
    mc, ds, fsdp = get_runtime("megatron-core"), get_runtime("deepspeed"), get_runtime("fsdp")
    assert (mc.grad_reduce_fp32, mc.param_gather_overlap) == (True, True)
    assert (ds.grad_reduce_fp32, ds.param_gather_overlap) == (False, False)
    assert (fsdp.grad_reduce_fp32, fsdp.param_gather_overlap) == (False, False)


def test_megatron_bf16_reduces_fp32_gradients_and_hides_the_gather_behind_the_forward():
    """Backward window = half the fp32 reduce-scatter, forward window (micro-batch time minus
    its backward) = half the all-gather: each hides half of its own collective."""
    plan = Plan(dp=2, zero=1, micro_batch=1, grad_accum=4, precision="bf16", runtime="megatron-core")
    eng = engines.engine_for(plan)
    rs4, ag = _collectives(plan, 4.0)
    rs2, _ = _collectives(plan, 2.0)
    assert rs4 > 1.8 * rs2                                         # mostly bandwidth: about twice the bytes
    backward, forward = rs4 / 2, ag / 2
    got = dp_comm(C, plan, eng, (PSI,), F, (backward + forward,), (backward,))
    assert got == pytest.approx(rs4 / 2 + ag / 2, rel=1e-9)
    # fp8 keeps bf16 master gradients: the same
    p8 = Plan(dp=2, zero=1, micro_batch=1, grad_accum=4, precision="fp8", runtime="megatron-core")
    assert dp_comm(C, p8, engines.engine_for(p8), (PSI,), F, (backward + forward,), (backward,)) == \
        pytest.approx(got, rel=1e-9)


def test_megatron_fp16_keeps_16_bit_gradients():
    """Megatron-LM forces fp32 reduction for bf16 only: an fp16 plan reduces 2-byte gradients."""
    plan = Plan(dp=2, zero=1, micro_batch=1, grad_accum=4, precision="fp16", runtime="megatron-core")
    rs2, ag = _collectives(plan, 2.0)
    got = dp_comm(C, plan, engines.engine_for(plan), (PSI,), F, (rs2 / 2 + ag / 2,), (rs2 / 2,))
    assert got == pytest.approx(rs2 / 2 + ag / 2, rel=1e-9)


def test_deepspeed_zero1_keeps_its_16_bit_reduce_and_exposed_post_step_gather():
    """The same windows on DeepSpeed: the 16-bit reduce-scatter hides behind the backward, the
    post-step all-gather (step -> all_gather_dp_groups) is exposed in full."""
    plan = Plan(dp=2, zero=1, micro_batch=1, grad_accum=4, precision="bf16")
    rs2, ag = _collectives(plan, 2.0)
    got = dp_comm(C, plan, engines.engine_for(plan), (PSI,), F, (rs2 / 2 + ag / 2,), (rs2 / 2,))
    assert got == pytest.approx(rs2 / 2 + ag, rel=1e-9)


def test_without_overlap_comm_the_megatron_gather_is_exposed():
    plan = Plan(dp=2, zero=1, micro_batch=1, grad_accum=4, precision="bf16", runtime="megatron-core",
                overlap_comm=False)
    rs4, ag = _collectives(plan, 4.0)
    got = dp_comm(C, plan, engines.engine_for(plan), (PSI,), F, (rs4 / 2 + ag / 2,), (rs4 / 2,))
    assert got == pytest.approx(rs4 + ag, rel=1e-9)
