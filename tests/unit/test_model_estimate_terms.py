"""planner/cost/ terms (block.py, tp.py, probes.py, model.py, stage.py, estimate.py: what was
model.py and estimate.py) pinned where the mutation run over them (issue 19) found no test: the
TP overlap's backward window, the experts' states on a CPU device that counts offloaded
buffers, the runtime's own factors in the estimate and the block probe's reference, the
data-parallel sync's latency and network efficiencies, an offloaded gradient copy sharing the
step collectives' window, and the pipeline sends' efficiencies."""
import dataclasses

import pytest

from planner.cost import comm, engines, estimate
from planner.cost.estimate import dp_comm, p2p_times
from planner.cost.factors import Factors, cluster_factors
from planner.cost.block import block_compute_time, block_times
from planner.cost.model import moe_state_bytes
from planner.cost.tp import overlapped_tp
from planner.cost.runtime import get_runtime, trial_factors
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
    bt = block_times(TINY, probed, train, plan, cluster_factors(probed))
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
    from planner.cost.probes import framework_overheads
    from planner.cost.stage import stage_times
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
        # fp32 gradients: 4 bytes per expert parameter on the wire
        p32, tr32 = dataclasses.replace(p, precision="fp32"), dataclasses.replace(tr, precision="fp32")
        e32 = moe.expert_sync_and_step(MOE, C2, p32, layers, f, (0.0,), 4.0, sharded)[0]
        d32 = dp_comm(C2, p32, engines.engine_for(p32), psi, f, (0.0,), (0.0,))
        assert estimate(MOE, C2, tr32, p32).time.dp_sync == pytest.approx(d32 + e32, rel=1e-9)


def test_a_plan_too_big_for_the_device_names_memory_and_the_largest_part():
    c, tr = parse_cluster("8xA100-40GB"), TrainSpec(global_batch=8, seq_len=2048)
    est = estimate(preset("glm-10b"), c, tr, Plan(dp=8, micro_batch=1, grad_accum=1))
    (p,) = [x for x in est.problems if x.field == "memory"]
    assert p.code.startswith("memory:") and p.code.split(":")[1] in ("params", "grads", "optimizer", "activations")
    assert p.message.startswith("stage 0 needs ")


def _offloaded(where: str, code: str | None = None, **host):
    """glm-10b ZeRO-3 on 8xA100-80GB with the optimizer and parameters offloaded to `where`, the
    node's host fields replaced by `host`: the Estimate, or with `code` its problems of that code."""
    c, tr = parse_cluster("8xA100-80GB"), TrainSpec(global_batch=8, seq_len=2048)
    if host:
        c = dataclasses.replace(c, host=dataclasses.replace(c.device.host, **host))
    p = Plan(dp=8, zero=3, offload_optimizer=where, offload_params=where, micro_batch=1, grad_accum=1)
    est = estimate(preset("glm-10b"), c, tr, p)
    return est if code is None else [x for x in est.problems if x.code == code]


def test_offloaded_states_beyond_host_memory_name_cpu_mem_gb_at_the_exact_bound():
    """glm-10b ZeRO-3 with optimizer and parameters on the CPU: the node's 8 ranks' host bytes
    against 90% of --cpu-mem-gb; a node with 0.5 ppb less than they need is refused."""
    from planner.cost.estimate import HOST_USABLE
    need = _offloaded("cpu").host_memory_bytes * 8
    assert need > 0
    tight = need / (1e9 * HOST_USABLE) * (1 - 5e-10)
    (prob,) = _offloaded("cpu", "host-memory", cpu_memory_gb=tight)
    assert (prob.field, prob.code, prob.fix, prob.detail) == (
        "--cpu-mem-gb", "host-memory", "offload less, use NVMe, or more nodes", "--cpu-mem-gb")
    assert not _offloaded("cpu", "host-memory", cpu_memory_gb=need / (1e9 * HOST_USABLE) * (1 + 5e-10))


def test_offloaded_states_beyond_the_nodes_nvme_name_nvme_gb_at_the_exact_bound():
    GB = 1e9                                                       # decimal, as the message prints
    need = _offloaded("nvme").nvme_bytes * 8
    assert need > 0
    tight = need / 1e9 * (1 - 5e-10)
    (prob,) = _offloaded("nvme", "nvme-capacity", nvme_gb=tight)
    assert (prob.field, prob.code, prob.fix, prob.detail) == ("--nvme-gb", "nvme-capacity", "offload less, or more nodes",
                                                              "--nvme-gb")
    assert prob.message == f"offloaded states need {need / GB:,.0f} GB of NVMe per node > {tight:,.0f} GB"
    assert not _offloaded("nvme", "nvme-capacity", nvme_gb=need / 1e9 * (1 + 5e-10))


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
    bt = block_times(MOE, c, tr, p, cluster_factors(c))
    assert bt.a2a_fwd > 0 and bt.a2a_bwd > 0
    n, m = MOE.layers, 2
    assert est.time.a2a_comm == pytest.approx(m * n * (bt.a2a_fwd + bt.a2a_bwd), rel=EXACT)
    assert est.time.tp_comm == pytest.approx(m * n * (bt.tp_fwd + bt.tp_bwd - bt.a2a_fwd - bt.a2a_bwd), abs=1e-15)


def test_tflops_per_gpu_are_model_flops_over_step_and_world():
    c, tr = parse_cluster("8xA100-80GB"), TrainSpec(global_batch=32, seq_len=2048)
    est = estimate(TINY, c, tr, Plan(dp=8, zero=1, micro_batch=1, grad_accum=4))
    assert est.tflops_per_gpu == pytest.approx(est.model_flops_per_step / (est.step_time_s * 8) / 1e12, rel=EXACT)


# --- model.py: the MoE, CP and TP-overlap terms of the block and its layer costs -----------------

def _bc(model, cluster, train, plan, f):
    from planner.cost import compute
    from planner.cost.block import block_kernel
    from planner.cost.runtime import get_runtime
    rt = get_runtime(plan.runtime)
    return compute.block_compute_times(model, cluster.device, train.seq_len, plan.micro_batch, plan.tp, plan.precision,
                                       compute_scale=f.compute_scale, attention_scale=f.attention_scale,
                                       kernel=block_kernel(model, cluster, train),
                                       attention=compute.AttentionKernel(rt.attention_kernels, rt.causal_attention))


def test_megatron_core_tp_overlap_exposes_only_what_the_gemms_cannot_cover():
    from planner.cost import runtime as rtm
    from planner.cost.tp import tp_block_comm, tp_link
    c, tr = parse_cluster("8xH100"), TrainSpec(global_batch=8, seq_len=256)
    p = Plan(tp=4, dp=2, micro_batch=1, grad_accum=4, sequence_parallel=True, runtime="megatron-core")
    m = TINY                                                        # h 128: the TP traffic outlasts the GEMMs
    f = cluster_factors(c, "megatron-core")
    raw_f, raw_b = tp_block_comm(m, 256, 1, 4, 2.0, True, tp_link(c, p), f.comm_efficiency)
    bc = _bc(m, c, tr, p, f)
    assert bc.gemm_bwd != 2.0 * bc.gemm_fwd and raw_b > max(bc.gemm_bwd, 2.0 * bc.gemm_fwd)
    bt = block_times(m, c, tr, p, f)
    assert (bt.tp_fwd, bt.tp_bwd) == (pytest.approx(max(raw_f - bc.gemm_fwd, 0.0), rel=EXACT),
                                      pytest.approx(raw_b - bc.gemm_bwd, rel=EXACT))


def test_cp_block_backward_is_cp_times_the_local_core_and_its_recompute():
    c = parse_cluster("8xA100-80GB")
    m, f = preset("glm-4-9b"), cluster_factors(c)
    lp, ltr = Plan(dp=8, micro_batch=1, grad_accum=1), TrainSpec(global_batch=8, seq_len=32768)
    plain = block_times(m, c, ltr, lp, f)
    cp2 = block_times(m, c, ltr, lp, f, (2, "ulysses"))
    bc = _bc(m, c, ltr, lp, f)
    rec = bc.core_bwd - 2.0 * bc.core_fwd
    assert rec > 0
    assert cp2.backward - plain.backward == pytest.approx(2.0 * bc.core_fwd + rec, rel=1e-9)


def test_moe_block_swaps_the_dense_ffn_gemms_for_the_experts():
    """Megatron-Core on H100 (compute_scale 1.338 fitted there; elementwise 1.7 on trial): the mean
    block is the dense block plus w = 3/4 of (experts - dense FFN) in GEMMs forward and backward
    (the experts' backward 2x their forward) and in memory-bound traffic, and w of the
    dispatch/combine all-to-alls."""
    from planner.cost import compute, moe
    c, tr = parse_cluster("8xH100"), TrainSpec(global_batch=16, seq_len=256)
    p = Plan(dp=8, ep=4, zero=1, micro_batch=1, grad_accum=2, runtime="megatron-core")
    w, hbm = 3 / 4, c.device.hbm_bytes_per_s
    dense_model = dataclasses.replace(MOE, moe=None)
    with trial_factors("megatron-core", {"elementwise_scale": 1.7}):
        f = cluster_factors(c, "megatron-core")
        assert f.compute_scale != 1.0 and f.elementwise_scale == 1.7
        moe_bt = block_times(MOE, c, tr, p, f)
        dense_bt = block_times(dense_model, c, tr, dataclasses.replace(p, ep=1), f)
    ffn = compute.weight_gemm_times(MOE, c.device, 256, 1, 1, "bf16")[2:]
    moe_t = moe.ffn_time(MOE, c.device, 256, 1, 1, 4, "bf16", f.compute_scale)
    moe_e, dense_e = moe.ffn_elementwise_bytes(MOE, 256, 1, 1, 2.0)
    elem = w * (moe_e - dense_e) / hbm * 1.7
    want_f = w * (moe_t - sum(x[0] for x in ffn) * f.compute_scale) + elem
    want_b = w * (2.0 * moe_t - sum(x[1] for x in ffn) * f.compute_scale) + 2.0 * elem
    assert moe_bt.forward - dense_bt.forward == pytest.approx(want_f, rel=1e-9)
    assert moe_bt.backward - dense_bt.backward == pytest.approx(want_b, rel=1e-9)
    af, ab = moe.alltoall_comm(MOE, c, p, 256, 2.0, f.comm_efficiency)
    assert af > 0 and (moe_bt.a2a_fwd, moe_bt.a2a_bwd) == (pytest.approx(w * af, rel=EXACT),
                                                           pytest.approx(w * ab, rel=EXACT))
    # TP 1: the block's communication outside its compute is the all-to-alls alone
    assert (moe_bt.tp_fwd, moe_bt.tp_bwd) == (moe_bt.a2a_fwd, moe_bt.a2a_bwd)


def test_moe_layer_costs_activations_parameters_and_resident_expert_states():
    from planner.cost import layer_costs, memory, moe, params
    from planner.cost.block import block_kernel
    c, tr = parse_cluster("8xH100"), TrainSpec(global_batch=16, seq_len=256)
    p = Plan(dp=8, ep=4, zero=1, micro_batch=1, grad_accum=2, recompute="full", runtime="megatron-core")
    w = 3 / 4
    moe_a, dense_a = moe.ffn_activation_bytes(MOE, 256, 1, 1, 2.0)
    none = memory.block_activation_bytes(MOE, 256, 1, 1, recompute="none", sequence_parallel=False, act_bytes=2.0,
                                         kernel=block_kernel(MOE, c, tr))
    one = layer_costs(MOE, c, tr, p)
    with trial_factors("megatron-core", {"activation_scale": 1.5}):
        more = layer_costs(MOE, c, tr, p)
    kept = none + w * (moe_a - dense_a)                            # a MoE block keeps its router and dispatch
    assert more.block_act_bytes - one.block_act_bytes == pytest.approx(0.5 * kept, rel=1e-9)
    assert more.block_work_bytes - one.block_work_bytes == pytest.approx(0.5 * kept, rel=1e-9)
    thr = params.persistence_threshold(MOE)
    blk, mblk = params.block_tensors(MOE, 1), params.moe_block_tensors(MOE, 1)
    assert one.block_small == pytest.approx((1 - w) * blk.small(thr) + w * mblk.small(thr), rel=EXACT)
    assert one.block_psi == pytest.approx((1 - w) * blk.total + w * mblk.total, rel=EXACT)
    # a CPU device's offloaded expert states are its own memory
    cpu = parse_cluster("2xcpu")
    off = Plan(dp=2, ep=2, zero=2, offload_optimizer="cpu", micro_batch=1, grad_accum=8)
    got = layer_costs(MOE, cpu, tr, off).block_expert_bytes
    assert got == tuple(pytest.approx(w * x, rel=EXACT) for x in moe_state_bytes(off, MOE, True))
    assert moe_state_bytes(off, MOE, True) != moe_state_bytes(off, MOE, False)


def test_shared_layers_hold_one_parameter_set_per_group():
    from planner.cost import layer_costs, params
    shared = dataclasses.replace(TINY, share_layers=2)
    c, tr = parse_cluster("8xA100-80GB"), TrainSpec(global_batch=8, seq_len=128)
    lc = layer_costs(shared, c, tr, Plan(dp=8, micro_batch=1, grad_accum=1))
    blk = params.block_tensors(shared, 1)
    thr = params.persistence_threshold(shared)
    assert (lc.block_psi, lc.block_small) == (blk.total / 2, blk.small(thr) / 2)


def test_zero3_engine_costs_apply_to_zero3_with_data_parallelism_only():
    """The 2-process probe's ZeRO-3 costs (0.5 s per micro-batch, 0.7 s per step) come with
    ZeRO-3 over dp > 1 only; ZeRO 0-2 with dp > 1 take its dp step (0.11 s) instead; every
    multi-process plan without a pipeline its concurrency cost (0.013 s per micro-batch)."""
    from planner.cost.probes import framework_overheads
    from planner.specs.step import Framework, Parallel
    par = Parallel(microbatch_s=0.013, dp_step_s=0.11, pipe_microbatch_s=0.17, pipe_bubble=0.5,
                   zero3_microbatch_s=0.5, zero3_step_s=0.7)
    dev = dataclasses.replace(find_device("cpu")[0], step=StepProbes(
        framework={"bf16": Framework(microbatch_s=0.02, step_s=0.03)}, parallel={"bf16": par}))
    c, f = parse_cluster("2xcpu", dev), Factors()
    assert framework_overheads(c, Plan(dp=2, zero=1, micro_batch=1, grad_accum=1), f) == (
        pytest.approx(0.02 + 0.013, rel=EXACT), pytest.approx(0.03 + 0.11, rel=EXACT))
    assert framework_overheads(c, Plan(dp=2, zero=3, micro_batch=1, grad_accum=1), f) == (
        pytest.approx(0.02 + 0.013 + 0.5, rel=EXACT), pytest.approx(0.03 + 0.7, rel=EXACT))
    assert framework_overheads(c, Plan(tp=2, dp=1, zero=3, micro_batch=1, grad_accum=1), f) == (
        pytest.approx(0.02 + 0.013, rel=EXACT), pytest.approx(0.03, rel=EXACT))


def test_the_in_step_tp_link_is_the_probes_in_its_units():
    from planner.cost.tp import tp_link
    from planner.specs.step import InStepLink
    dev = dataclasses.replace(find_device("cpu")[0], step=StepProbes(tp_allreduce={2: InStepLink(busbw_gbps=0.5,
                                                                                                  latency_us=500.0)}))
    bw, lat = tp_link(parse_cluster("2xcpu", dev), Plan(tp=2, micro_batch=1, grad_accum=8))
    assert (bw, lat) == (pytest.approx(0.5e9, rel=EXACT), pytest.approx(500e-6, rel=EXACT))


def test_fp8_weight_copies_under_full_sharding_are_the_gathered_units_only():
    """fp8 on H100 under megatron-core: ZeRO-3 (Megatron-FSDP) keeps FP8 copies of the gathered
    block and the prefetched one (2 of 40), ZeRO-1 of every block; amax histories for all."""
    from planner.cost import layer_costs, memory
    from planner.cost.stage import stage_memory
    m, c, tr = preset("glm-4-9b"), parse_cluster("8xH100"), TrainSpec(global_batch=8, seq_len=4096)
    z3 = Plan(dp=8, zero=3, precision="fp8", micro_batch=1, grad_accum=1, runtime="megatron-core")
    bf = dataclasses.replace(z3, precision="bf16")
    lc3, lcb = layer_costs(m, c, tr, z3), layer_costs(m, c, tr, bf)
    layers, ckpt = (m.layers,), (0,)
    got = stage_memory(z3, lc3, layers, ckpt, 0.0, False)[0].params
    plain = stage_memory(bf, lcb, layers, ckpt, 0.0, False)[0].params
    assert got - plain == pytest.approx(memory.fp8_bytes(m.layers, lc3.block_psi, True), rel=1e-9)
    assert memory.fp8_bytes(m.layers, lc3.block_psi, True) < memory.fp8_bytes(m.layers, lc3.block_psi, False)


def test_a_block_probe_scales_the_embedding_and_output_layer_too():
    from planner.cost import layer_costs
    plan, train = Plan(dp=2, micro_batch=2, grad_accum=2), TrainSpec(global_batch=8, seq_len=128)
    plain = layer_costs(TINY, parse_cluster("2xcpu", find_device("cpu")[0]), train, plan)
    probed = layer_costs(TINY, parse_cluster("2xcpu", dataclasses.replace(
        find_device("cpu")[0], step=StepProbes(block={"bf16": BlockProbe(scale=2.0, overhead_s=3e-3)}))), train, plan)
    assert probed.first_stage_time == pytest.approx(2.0 * plain.first_stage_time, rel=EXACT)
    assert probed.last_stage_time == pytest.approx(2.0 * plain.last_stage_time, rel=EXACT)


def test_megatron_core_stage_extras_keep_no_mask_and_fused_cross_entropy():
    """Megatron-Core passes a causal flag (no s x s mask kept, none in the stage cache) and fuses
    the cross-entropy (bf16 logits + lse, no fp32 softmax): the stages' extra bytes by hand
    from memory.py's pieces, pipeline of 2."""
    from planner.cost import memory
    from planner.cost.block import block_kernel
    from planner.cost.model import stage_extras
    m, c, tr = preset("glm-4-9b"), parse_cluster("8xH100"), TrainSpec(global_batch=32, seq_len=2048)
    p = Plan(pp=2, dp=4, micro_batch=1, grad_accum=8, runtime="megatron-core")
    rt = get_runtime("megatron-core")
    assert not rt.materialises_mask and rt.fused_cross_entropy
    s, b, t, e, k = 2048, 1, 1, 2.0, block_kernel(m, c, tr)
    shared = dict(act_bytes=e, kernel=k, plain=True)
    kept = memory.shared_bytes(m, s, b, t, recomputed=False, mask=False, **shared)
    assert kept != memory.shared_bytes(m, s, b, t, recomputed=False, **shared)          # the mask would count
    cache = memory.cache_bytes(m, s, b, t, e, False) - kept
    assert cache != memory.cache_bytes(m, s, b, t, e) - kept
    per0, fixed0 = memory.pipeline_bytes(m, s, b, t, sequence_parallel=False, act_bytes=e, stage=0, p=2, m=8)
    per1, fixed1 = memory.pipeline_bytes(m, s, b, t, sequence_parallel=False, act_bytes=e, stage=1, p=2, m=8)
    head = memory.head_bytes(m, s, b, t, sequence_parallel=False, act_bytes=e, fused_ce=True)
    assert head != memory.head_bytes(m, s, b, t, sequence_parallel=False, act_bytes=e)
    first, last, work = stage_extras(m, s, b, t, p, e, k, 3.0)
    assert first == pytest.approx(memory.embedding_bytes(m, s, b, t) + kept + per0 + (cache + fixed0) / 3.0, rel=EXACT)
    assert last == pytest.approx(head + memory.logits_bytes(m, s, b, t, e) + kept + cache + per1 + fixed1, rel=EXACT)
    assert work == pytest.approx(memory.shared_bytes(m, s, b, t, recomputed=True, mask=False, **shared), rel=EXACT)
    assert work != memory.shared_bytes(m, s, b, t, recomputed=True, **shared)


def test_a_block_probe_scales_the_selective_recompute_too():
    plan, train = Plan(dp=2, micro_batch=2, grad_accum=2, recompute="selective"), TrainSpec(global_batch=8, seq_len=128)
    plain_c = parse_cluster("2xcpu", find_device("cpu")[0])
    probed_c = parse_cluster("2xcpu", dataclasses.replace(
        find_device("cpu")[0], step=StepProbes(block={"bf16": BlockProbe(scale=2.0, overhead_s=3e-3)})))
    plain = block_times(TINY, plain_c, train, plan, cluster_factors(plain_c))
    probed = block_times(TINY, probed_c, train, plan, cluster_factors(probed_c))
    assert plain.selective > 0 and probed.selective == pytest.approx(2.0 * plain.selective, rel=EXACT)


def test_cpu_offload_memory_holds_the_largest_tensor_staging_buffer_on_the_device():
    """ZeRO-2 with the optimizer on the CPU, on a GPU: the only optimizer-role bytes left on the
    device are DeepSpeed's temp_grad_buffer_for_gpu_offload, 2 B x the largest parameter."""
    from planner.cost import layer_costs
    from planner.cost.stage import stage_memory
    c, tr = parse_cluster("8xA100-80GB"), TrainSpec(global_batch=8, seq_len=2048)
    p = Plan(dp=8, zero=2, offload_optimizer="cpu", micro_batch=1, grad_accum=1)
    lc = layer_costs(preset("glm-10b"), c, tr, p)
    assert lc.largest > 0
    mem = stage_memory(p, lc, (preset("glm-10b").layers,), (0,), 0.0, False)[0]
    assert mem.optimizer == pytest.approx(2.0 * lc.largest, rel=EXACT)


def test_ring_backward_hides_behind_cp_times_the_local_backward_core():
    """glm-10b (full MHA: 4096-wide KV) over a 16-rank ring across two A6000 nodes (10 GB/s
    Ethernet): the KV and dKV sends hide partly behind each step's backward core, cp x the
    local block's (2 x forward + flash's recompute)."""
    from planner.cost import longctx
    m, c = preset("glm-10b"), parse_cluster("2x8xA6000")
    f = cluster_factors(c)
    lp, ltr = Plan(dp=16, micro_batch=1, grad_accum=1), TrainSpec(global_batch=16, seq_len=2048)
    bc = _bc(m, c, ltr, lp, f)
    core_f, rec = bc.core_fwd, bc.core_bwd - 2.0 * bc.core_fwd      # attention_scale applied in _bc
    want = longctx.block_comm(m, c, 1, 1, 16, "ring", 2048, 2.0, f.comm_efficiency, 16 * core_f,
                              16 * (2.0 * core_f + rec))
    bare = longctx.block_comm(m, c, 1, 1, 16, "ring", 2048, 2.0, f.comm_efficiency, 0.0, 0.0)
    bt = block_times(m, c, ltr, lp, f, (16, "ring"))
    assert 0 < want[1] < bare[1] and rec > 0
    assert (bt.a2a_fwd, bt.a2a_bwd) == (pytest.approx(want[0], rel=1e-9), pytest.approx(want[1], rel=1e-9))


# --- factors.py ----------------------------------------------------------------------------------

def test_oversubscription_stretches_every_cpu_bound_scale():
    """4 processes on a CPU profile measured with 2: compute, attention, memory-bound work and
    the optimizer step all take k = 2x as long; nothing else moves."""
    cpu = find_device("cpu")[0]
    two, four = cluster_factors(parse_cluster("2xcpu", cpu)), cluster_factors(parse_cluster("4xcpu", cpu))
    k = cpu.oversubscription(4) / cpu.oversubscription(2)
    assert k == 2.0
    for name in ("compute_scale", "attention_scale", "elementwise_scale", "optimizer_scale"):
        assert getattr(four, name) == pytest.approx(k * getattr(two, name), rel=EXACT), name
    assert four.dp_overlap == two.dp_overlap


def test_factors_are_named_fields_with_their_defaults():
    from planner.cost.factors import DEFAULTS, factor
    names = Factors.names()
    assert names[0] == "compute_scale" and "network_efficiency" in names and len(names) == len(set(names))
    assert Factors().to_dict() == {n: getattr(Factors(), n) for n in names} == dict(DEFAULTS)
    assert Factors(dp_overlap=0.25).to_dict()["dp_overlap"] == 0.25
    dev = dataclasses.replace(parse_cluster("8xA100-80GB").device, factors={"dp_overlap": 0.3})
    assert factor(dev, "dp_overlap") == 0.3 and factor(dev, "compute_scale") == DEFAULTS["compute_scale"]
