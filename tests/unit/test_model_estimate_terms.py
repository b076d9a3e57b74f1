"""planner/cost/model.py and estimate.py terms pinned where the mutation run over them (issue 19)
found no test: the TP overlap's backward window, the experts' states on a CPU device that
counts offloaded buffers, the runtime's own factors in the estimate and the block probe's
reference, the data-parallel sync's latency and network efficiencies, an offloaded gradient
copy sharing the step collectives' window, and the pipeline sends' efficiencies."""
import dataclasses

import pytest

from planner.cost import comm, engines, estimate
from planner.cost.estimate import dp_comm, p2p_times
from planner.cost.factors import Factors, cluster_factors
from planner.cost.model import _block_times, block_compute_time, moe_state_bytes, overlapped_tp
from planner.cost.runtime import trial_factors
from planner.specs import Plan, TrainSpec, parse_cluster, preset, scale
from planner.specs.hardware import find_device
from planner.specs.step import BlockProbe, StepProbes

EXACT = 1e-12
TINY = scale(preset("chatglm3-6b"), "tiny")
MOE = scale(preset("glm-4.5-air"), "tiny")


def test_tp_overlap_hides_behind_the_backward_gemms_given_or_twice_the_forward():
    assert overlapped_tp(5.0, 9.0, 2.0) == (3.0, 5.0)             # backward window 2 x 2.0
    assert overlapped_tp(5.0, 9.0, 2.0, 3.0) == (3.0, 6.0)        # backward GEMMs given: 3.0
    assert overlapped_tp(1.0, 1.0, 2.0) == (0.0, 0.0)


def test_expert_states_on_a_cpu_device_count_the_offloaded_buffers():
    """ZeRO-2 with CPU offload, EP 2 x DP 4 (expert-data-parallel 2): psi = 2 experts x 18,432
    per block. On a GPU the device keeps the bf16 weights only; on a CPU device (resident) the
    host buffers are its own memory: + fp32 gradient partition (4 B x psi / 2) beside the 16-bit
    reduced gradients (2 B x psi / 2), + fp32 master and Adam moments (12 B x psi / 2) and the
    16-bit copy-back partition (2 B x psi / 2)."""
    psi = 2 * 18_432
    p = Plan(dp=4, ep=2, zero=2, offload_optimizer="cpu", micro_batch=1, grad_accum=2)
    assert moe_state_bytes(p, MOE, False) == (2 * psi, 0.0, 0.0)
    assert moe_state_bytes(p, MOE, True) == (2 * psi, (2 + 4) * psi / 2, (12 + 2) * psi / 2)


def test_the_estimate_and_the_block_reference_use_the_plans_runtime_factors():
    """A100 has no megatron-core per-device trims: trial factors for megatron-core reach a
    megatron-core plan's estimate and block compute time, and nothing of deepspeed's."""
    c, tr = parse_cluster("8xA100-80GB"), TrainSpec(global_batch=32, seq_len=2048)
    p = Plan(dp=8, zero=1, micro_batch=1, grad_accum=4, runtime="megatron-core")
    base_est, base_block = estimate(TINY, c, tr, p).step_time_s, block_compute_time(TINY, c, tr, p)
    scales = {"compute_scale": 2.0, "attention_scale": 2.0, "elementwise_scale": 2.0}
    with trial_factors("megatron-core", {**scales, "step_overhead_s": 0.5}):
        assert block_compute_time(TINY, c, tr, p) == pytest.approx(2.0 * base_block, rel=1e-9)
        assert estimate(TINY, c, tr, p).step_time_s > base_est + 0.5
    with trial_factors("deepspeed", {**scales, "step_overhead_s": 0.5}):
        assert estimate(TINY, c, tr, p).step_time_s == base_est
        assert block_compute_time(TINY, c, tr, p) == base_block


def test_the_block_reference_leaves_the_probe_out():
    """block_compute_time is what the profiler's block probe is fitted against: on a profile
    with a probe it is still the compute terms alone, not the probe's line through them."""
    plan, train = Plan(dp=2, micro_batch=2, grad_accum=2), TrainSpec(global_batch=8, seq_len=128)
    plain = parse_cluster("2xcpu", find_device("cpu")[0])
    probed = parse_cluster("2xcpu", dataclasses.replace(
        find_device("cpu")[0], step=StepProbes(block={"bf16": BlockProbe(scale=2.0, overhead_s=3e-3)})))
    x = block_compute_time(TINY, plain, train, plan)
    assert block_compute_time(TINY, probed, train, plan) == pytest.approx(x, rel=EXACT)
    bt = _block_times(TINY, probed, train, plan, cluster_factors(probed))
    assert bt.forward + bt.backward == pytest.approx(2.0 * x + 3e-3, rel=EXACT)


# --- estimate.py: data-parallel sync and pipeline sends ------------------------------------------

C2 = parse_cluster("2x8xH100")


def test_dp_sync_over_two_nodes_takes_latency_scale_and_network_efficiency():
    plan = Plan(dp=16, zero=0, micro_batch=1, grad_accum=1)
    f = Factors(comm_efficiency=0.8, latency_scale=2.0, network_efficiency=0.5, dp_overlap=0.0)
    eng = engines.engine_for(plan)
    psi = 10_000_000
    (route,) = comm.group_routes(C2, plan, "dp")
    assert route.network                                           # IB is the bottleneck
    want = sum(comm.ROUTE_COLLECTIVES[c.kind](psi * c.bytes, 16, route, 0.8, 2.0, 0.5) for c in eng.collectives)
    assert want != sum(comm.ROUTE_COLLECTIVES[c.kind](psi * c.bytes, 16, route, 0.8, 1.0, 1.0) for c in eng.collectives)
    assert dp_comm(C2, plan, eng, (psi,), f, (0.0,), (0.0,)) == pytest.approx(want, rel=EXACT)


def test_an_offloaded_gradient_copy_shares_the_step_reduce_scatters_window():
    """ZeRO-1 with CPU offload: the reduce-scatter at the accumulation boundary and the copy of
    the reduced partition to the host run in the same backward window, so together they hide
    at most dp_overlap x that window once."""
    plan = Plan(dp=2, zero=1, offload_optimizer="cpu", micro_batch=1, grad_accum=4)
    c = parse_cluster("2xH100")
    f = Factors(dp_overlap=1.0)
    eng = engines.engine_for(plan)
    psi = 100_000_000
    (route,) = comm.group_routes(c, plan, "dp")
    nb = -(-psi // plan.bucket_elements)                            # bucket by bucket
    assert nb > 1
    rs, ag = (nb * comm.ROUTE_COLLECTIVES[x.kind](psi * x.bytes / nb, 2, route, f.comm_efficiency, f.latency_scale,
                                                  f.network_efficiency) for x in eng.collectives)
    copy = psi * 2.0 / 2 / (c.host.pcie_gbps * 1e9)
    window = min(rs, copy) / 2                                     # shorter than either alone
    got = dp_comm(c, plan, eng, (psi,), f, (0.0,), (window,))
    assert [x.kind for x in eng.collectives] == ["reduce_scatter", "all_gather"]
    assert got == pytest.approx(rs + copy - window + ag, rel=1e-9)


def test_pipeline_sends_across_nodes_take_comm_and_network_efficiency():
    model, train = preset("glm-4-9b"), TrainSpec(global_batch=64, seq_len=2048)
    plan = Plan(pp=2, dp=1, tp=8, micro_batch=1, grad_accum=8)
    f = Factors(comm_efficiency=0.8, network_efficiency=0.5)
    nbytes = 2048 * 1 * 4096 * 2.0
    ib = C2.inter_node
    bw = ib.busbw_gbps * 1e9 / 8 * 0.5                              # a rank's share of the node's NIC
    one = nbytes / (bw * comm.class_efficiency(ib) * 0.8) + comm.class_base(ib) + ib.latency_us * 1e-6
    assert p2p_times(model, C2, train, plan, f) == (pytest.approx(2.0 * one, rel=EXACT),)


def test_megatron_core_hides_steady_pipeline_sends_behind_one_chunk():
    """Megatron-Core overlaps each steady-state send with the next micro-batch's compute (one
    chunk, the stage's time / v): m v max(send - time / v, 0) stays exposed; DeepSpeed's sends
    are all exposed (m v max(send))."""
    from planner.cost import layer_costs
    from planner.cost.model import framework_overheads, stage_times
    tr = TrainSpec(global_batch=32, seq_len=256)
    p = Plan(pp=2, tp=2, dp=4, micro_batch=1, grad_accum=8, schedule="interleaved", interleave=2,
             runtime="megatron-core")
    est = estimate(TINY, C2, tr, p)
    assert est.feasible, est.problems
    f = cluster_factors(C2, "megatron-core")
    times = stage_times(layer_costs(TINY, C2, tr, p), p.layers_per_stage(TINY.layers),
                        p.checkpointed_per_stage(TINY.layers), framework_overheads(C2, p, f)[0])
    send = max(p2p_times(TINY, C2, tr, p, f))
    want = 8 * 2 * (send - min(times) / 2)
    assert 0 < want < 8 * 2 * send
    assert est.time.pp_comm == pytest.approx(want, rel=1e-9)


def test_a_moe_estimate_adds_the_experts_gradient_sync_and_optimizer_step():
    """With nothing hidden (dp_overlap 0) the estimate's sync is the dense gradients' plus the
    experts' own over their expert-data-parallel ranks, and its optimizer step the dense
    partition's plus the experts'."""
    from planner.cost import layer_costs, moe
    from planner.cost.estimate import optimizer_time
    tr = TrainSpec(global_batch=32, seq_len=256)
    p = Plan(dp=16, ep=4, zero=1, micro_batch=1, grad_accum=2, runtime="megatron-core")
    with trial_factors("megatron-core", {"dp_overlap": 0.0}):
        f = cluster_factors(C2, "megatron-core")
        est = estimate(MOE, C2, tr, p)
        layers = p.layers_per_stage(MOE.layers)
        psi = (layer_costs(MOE, C2, tr, p).stage_psi(0, 1, layers[0])[0],)
        eng = engines.engine_for(p)
        sharded = engines.engine_for(moe.expert_plan(p)).optimizer_sharded
        e_sync, e_opt = moe.expert_sync_and_step(MOE, C2, p, layers, f, (0.0,), 2.0, sharded)
        assert e_sync > 0 and e_opt > 0
        assert est.time.dp_sync == pytest.approx(dp_comm(C2, p, eng, psi, f, (0.0,), (0.0,)) + e_sync, rel=1e-9)
        assert est.time.optimizer == pytest.approx(optimizer_time(C2, p, eng, psi, f) + e_opt, rel=1e-9)


def test_a_plan_too_big_for_the_device_names_memory_and_the_largest_part():
    c, tr = parse_cluster("8xA100-40GB"), TrainSpec(global_batch=8, seq_len=2048)
    est = estimate(preset("glm-10b"), c, tr, Plan(dp=8, micro_batch=1, grad_accum=1))
    (p,) = [x for x in est.problems if x.field == "memory"]
    assert p.code.startswith("memory:") and p.code.split(":")[1] in ("params", "grads", "optimizer", "activations")
    assert p.message.startswith("stage 0 needs ")


def test_offloaded_states_beyond_host_memory_name_cpu_mem_gb_at_the_exact_bound():
    """glm-10b ZeRO-3 with optimizer and parameters on the CPU: the node's 8 ranks' host bytes
    against 90% of --cpu-mem-gb; a node with 0.5 ppb less than they need is refused."""
    from planner.cost.estimate import HOST_USABLE
    c, tr = parse_cluster("8xA100-80GB"), TrainSpec(global_batch=8, seq_len=2048)
    p = Plan(dp=8, zero=3, offload_optimizer="cpu", offload_params="cpu", micro_batch=1, grad_accum=1)
    need = estimate(preset("glm-10b"), c, tr, p).host_memory_bytes * 8
    assert need > 0

    def with_host_gb(gb):
        return dataclasses.replace(c, host=dataclasses.replace(c.device.host, cpu_memory_gb=gb))
    tight = need / (1e9 * HOST_USABLE) * (1 - 5e-10)
    (prob,) = [x for x in estimate(preset("glm-10b"), with_host_gb(tight), tr, p).problems if x.code == "host-memory"]
    assert (prob.field, prob.code, prob.fix, prob.detail) == (
        "--cpu-mem-gb", "host-memory", "offload less, use NVMe, or more nodes", "--cpu-mem-gb")
    roomy = need / (1e9 * HOST_USABLE) * (1 + 5e-10)
    assert not [x for x in estimate(preset("glm-10b"), with_host_gb(roomy), tr, p).problems if x.code == "host-memory"]


def test_offloaded_states_beyond_the_nodes_nvme_name_nvme_gb_at_the_exact_bound():
    GB = 1e9                                                       # decimal, as the message prints
    c, tr = parse_cluster("8xA100-80GB"), TrainSpec(global_batch=8, seq_len=2048)
    p = Plan(dp=8, zero=3, offload_optimizer="nvme", offload_params="nvme", micro_batch=1, grad_accum=1)
    need = estimate(preset("glm-10b"), c, tr, p).nvme_bytes * 8
    assert need > 0

    def with_nvme_gb(gb):
        return dataclasses.replace(c, host=dataclasses.replace(c.device.host, nvme_gb=gb))
    tight = need / 1e9 * (1 - 5e-10)
    (prob,) = [x for x in estimate(preset("glm-10b"), with_nvme_gb(tight), tr, p).problems if x.code == "nvme-capacity"]
    assert (prob.field, prob.code, prob.fix, prob.detail) == ("--nvme-gb", "nvme-capacity", "offload less, or more nodes",
                                                              "--nvme-gb")
    assert prob.message == f"offloaded states need {need / GB:,.0f} GB of NVMe per node > {tight:,.0f} GB"
    assert not [x for x in estimate(preset("glm-10b"), with_nvme_gb(need / 1e9 * (1 + 5e-10)), tr, p).problems
                if x.code == "nvme-capacity"]


def test_layer_costs_take_the_runtime_and_the_context_parallel_core():
    from planner.cost import layer_costs, longctx
    c, tr = parse_cluster("8xA100-80GB"), TrainSpec(global_batch=32, seq_len=2048)
    p = Plan(dp=8, zero=1, micro_batch=1, grad_accum=4, runtime="megatron-core")
    base = layer_costs(TINY, c, tr, p).block_time
    with trial_factors("megatron-core", {"compute_scale": 2.0, "attention_scale": 2.0, "elementwise_scale": 2.0}):
        assert layer_costs(TINY, c, tr, p).block_time == pytest.approx(2.0 * base, rel=1e-9)
    m, long = preset("glm-4-9b"), TrainSpec(global_batch=4, seq_len=65536)
    cp = Plan(dp=4, cp=2, zero=3, micro_batch=1, grad_accum=1, recompute="full")
    lp, ltr = longctx.local(cp, long)
    # the cp plan's block: its cp-times attention core and the Ulysses all-to-alls over the local block
    assert layer_costs(m, c, long, cp).block_time > layer_costs(m, c, ltr, lp).block_time


def test_moe_estimate_splits_all_to_alls_from_tp_traffic():
    c, tr = parse_cluster("8xH100"), TrainSpec(global_batch=16, seq_len=256)
    p = Plan(dp=8, ep=4, zero=1, micro_batch=1, grad_accum=2)
    est = estimate(MOE, c, tr, p)
    bt = _block_times(MOE, c, tr, p, cluster_factors(c))
    assert bt.a2a_fwd > 0 and bt.a2a_bwd > 0
    n, m = MOE.layers, 2
    assert est.time.a2a_comm == pytest.approx(m * n * (bt.a2a_fwd + bt.a2a_bwd), rel=EXACT)
    assert est.time.tp_comm == pytest.approx(m * n * (bt.tp_fwd + bt.tp_bwd - bt.a2a_fwd - bt.a2a_bwd), abs=1e-15)


def test_tflops_per_gpu_are_model_flops_over_step_and_world():
    c, tr = parse_cluster("8xA100-80GB"), TrainSpec(global_batch=32, seq_len=2048)
    est = estimate(TINY, c, tr, Plan(dp=8, zero=1, micro_batch=1, grad_accum=4))
    assert est.tflops_per_gpu == pytest.approx(est.model_flops_per_step / (est.step_time_s * 8) / 1e12, rel=EXACT)
