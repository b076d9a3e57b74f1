"""The cost model's building blocks, one function at a time, against values computed by hand
(sizes small enough to check on paper; non-unit efficiencies, latencies and scales so that a
swapped operator or a dropped factor changes the number)."""
from __future__ import annotations

import dataclasses
import math

import pytest

from planner.cost import comm, compute, factors, memory, params, pipeline
from planner.cost.layers import LayerCosts
from planner.specs import ModelSpec, Plan, parse_cluster
from planner.specs.hardware import DeviceProfile, Link
from planner.specs.cluster import ClusterSpec

# hidden 8, 2 heads of 4, 1 KV group (q 8, kv 4), SwiGLU FFN 16 (gate and up), vocabulary 11
TINY = ModelSpec(name="t", hidden=8, layers=2, heads=2, kv_groups=1, ffn_hidden=16, activation="swiglu", vocab=11,
                 max_seq=4, norm="rmsnorm", position="rotary", linear_bias=False, hidden_dropout=0.1,
                 attention_dropout=0.1)
# efficiency 0.1 at 1e3 FLOPs rising to 0.5 at 1e9, linear in log(flops)
SLOPED = DeviceProfile(name="sloped", kind="gpu", memory_gb=8, peak_tflops={"bf16": 10, "fp16": 10, "fp32": 5},
                       hbm_bandwidth_gbps=100, gemm_efficiency=((1e3, 0.1), (1e9, 0.5)), gpus_per_node=4,
                       intra_node=Link(name="i", busbw_gbps=100, latency_us=5),
                       inter_node=Link(name="o", busbw_gbps=10, latency_us=20))


def eff(flops: float) -> float:
    """The sloped curve by hand (clamped at both ends, as DeviceProfile.gemm_eff)."""
    x = min(max(flops, 1e3), 1e9)
    return 0.1 + 0.4 * (math.log(x) - math.log(1e3)) / (math.log(1e9) - math.log(1e3))


# --- communication ---------------------------------------------------------------------------
def test_ring_collectives_with_latency_and_efficiency():
    # all-reduce over 4: the tree's 2 x log2(4) = 4 latency steps beat the ring's 2 x 3 = 6
    assert comm.allreduce_time(1e6, 4, 1e9, 1e-5, 0.5) == pytest.approx(1e6 * 2 * 3 / 4 / 0.5e9 + 4 * 1e-5,
                                                                        rel=1e-12, abs=0)
    # over 1024: 20 tree steps instead of 2046 ring steps; over 2 and 3 the ring is as cheap (2, 4)
    assert [comm.allreduce_steps(n) for n in (1, 2, 3, 4, 5, 1024)] == [0, 2, 4, 4, 6, 20]
    assert comm.allgather_time(1e6, 4, 1e9, 1e-5, 0.5) == pytest.approx(1e6 * 3 / 4 / 0.5e9 + 3 * 1e-5, rel=1e-12, abs=0)
    assert comm.reducescatter_time is comm.allgather_time
    # one rank sends nothing and waits for nobody
    assert comm.allreduce_time(1e6, 1, 1e9, 1e-5, 0.5) == 0 and comm.allgather_time(1e6, 1, 1e9, 1e-5, 0.5) == 0


def test_point_to_point_inside_and_across_nodes():
    c = ClusterSpec(nodes=2, gpus_per_node=4, device=SLOPED, intra_node=SLOPED.intra_node,
                    inter_node=SLOPED.inter_node)
    assert comm.p2p_time(1e6, c, True, 0.5) == pytest.approx(1e6 / (10e9 / 4 * 0.5) + 20e-6, rel=1e-12, abs=0)
    assert comm.p2p_time(1e6, c, False, 0.5) == pytest.approx(1e6 / (100e9 * 0.5) + 5e-6, rel=1e-12, abs=0)


def test_tp_groups_that_straddle_a_node_share_its_network():
    # nodes of 4, TP 3 x PP 2: stage 1's TP group (ranks 3-5) spans nodes 0 and 1
    assert comm.group_sharing(4, 1, 3, 2, "tp") == (0, 1)
    assert comm.group_sharing(4, 2, 2, 2, "tp") == (0, 0)
    c = parse_cluster("2x4xA100")
    links = comm.group_links(c, dataclasses.replace(_plan(), dp=1, tp=3, pp=2), "tp")
    assert [x for link in links for x in link] == pytest.approx([230e9, 1.32e-6, 180e9, 11.5e-6], rel=1e-12, abs=0)


def _plan():
    from planner.specs import Plan
    return Plan(micro_batch=1)


# --- compute ---------------------------------------------------------------------------------
def test_block_gemms_from_the_real_shapes():
    # s 4, b 2 -> 8 tokens; TP 2
    gemms, core = compute.block_gemms(TINY, 4, 2, 2)
    assert gemms == (2 * 8 * 8 * (8 + 4 + 4) / 2, 2 * 8 * 8 * 8 / 2, 2 * 8 * 8 * 16 * 2 / 2, 2 * 8 * 16 * 8 / 2)
    assert core == 2 * 2 * 2 * 4 * 4 * 8 / 2
    assert compute.block_forward_flops(TINY, 4, 2, 2) == sum(gemms) + core


def test_output_layer_and_flash_recompute_flops():
    assert compute.logits_forward_flops(TINY, 4, 2, 2) == 2 * 4 * 2 * 8 * 12 / 2     # V_pad = 12 for TP 2
    assert compute.logits_forward_flops(TINY, 4, 2, 1) == 2 * 4 * 2 * 8 * 11
    assert compute.flash_recompute_flops(TINY, 4, 2, 2) == 2 * 2 * 4 * 4 * 8 / 2
    per_sequence = 3 * (2 * compute.block_forward_flops(TINY, 4, 1, 1) + 2 * 4 * 8 * 11)
    assert compute.model_flops_per_sequence(TINY, 4) == per_sequence


def test_gemm_and_attention_core_times_use_the_efficiency_of_one_gemm():
    assert compute.gemm_time(SLOPED, 1e6, "bf16", 2.0) == pytest.approx(1e6 / (10e12 * eff(1e6)) * 2.0, rel=1e-12, abs=0)
    one = 2 * 64 * 64 * 4                                   # one head's s x d by d x s GEMM: 2 s^2 d
    assert compute.core_time(TINY, SLOPED, 1e6, 64, "fp32", 3.0) == pytest.approx(
        1e6 / (5e12 * eff(one)) * 3.0, rel=1e-12, abs=0)
    # a device without a tile model (SLOPED): the FLOPs-only curve, backward 2x forward, flash's
    # backward adds the recomputed Q K^T (half the core's FLOPs)
    bc = compute.block_compute_times(TINY, SLOPED, 64, 2, 2, "bf16", compute_scale=2.0, attention_scale=3.0)
    g, c = compute.block_gemms(TINY, 64, 2, 2)
    assert bc.gemm_fwd == pytest.approx(sum(x / (10e12 * eff(x)) * 2.0 for x in g), rel=1e-12, abs=0)
    assert bc.gemm_bwd == pytest.approx(2 * bc.gemm_fwd, rel=1e-12, abs=0)
    assert bc.core_fwd == pytest.approx(c / (10e12 * eff(one)) * 3.0, rel=1e-12, abs=0)
    assert bc.core_bwd == pytest.approx(2.5 * bc.core_fwd, rel=1e-12, abs=0)


def test_elementwise_traffic_by_kernel_dropout_and_sequence_parallelism():
    sb, h, e = 4 * 2, 8, 2
    rep = sb * h * (2 * 2 * e + 2 * 2 * e) + sb * h * 2 * (2 * e + 1)       # norms, adds; two hidden dropouts
    sharded = sb * e * ((8 + 4 + 4) * 2 + (2 * 16 + 16) * 2)                # rotary on q/k/v; SwiGLU
    scores = 2 * 2 * 4 * 4 * (2 * e + 2 * e + 1)                            # b heads s^2: softmax + dropout
    assert compute.block_elementwise_bytes(TINY, 4, 2, 2, e, False, "flash") == rep + sharded / 2
    assert compute.block_elementwise_bytes(TINY, 4, 2, 2, e, False, "eager") == rep + (sharded + scores) / 2
    assert compute.block_elementwise_bytes(TINY, 4, 2, 2, e, True, "math") == rep / 2 + (sharded + scores) / 2
    dry = dataclasses.replace(TINY, hidden_dropout=0.0, attention_dropout=0.0)
    assert compute.block_elementwise_bytes(dry, 4, 2, 1, 4, False, "eager") == (
        sb * h * 8 * 4 + sb * 4 * (16 * 2 + 48 * 2) + 2 * 2 * 4 * 4 * 2 * 4)
    with pytest.raises(AssertionError):
        compute.block_elementwise_bytes(TINY, 4, 2, 2, e, False, "sdpa")


# --- memory ----------------------------------------------------------------------------------
def test_logits_are_vocab_parallel_in_the_activation_dtype():
    # TINY's vocabulary 11 pads to 12 at TP 2: 6 columns per rank; s 4, b 2, bf16
    assert memory.logits_bytes(TINY, 4, 2, 2, 2.0) == 2 * 2 * 4 * 6


def test_activation_formulas_refuse_unknown_modes():
    with pytest.raises(AssertionError):
        memory.layer_activation_bytes(4, 1, 8, 2, recompute="some")
    with pytest.raises(AssertionError):
        memory.block_activation_bytes(TINY, 4, 1, 1, sequence_parallel=False, recompute="none", act_bytes=2.0,
                                      kernel="sdpa")
    with pytest.raises(AssertionError):
        memory.block_activation_bytes(TINY, 4, 1, 1, sequence_parallel=False, recompute="some", act_bytes=2.0,
                                      kernel="flash")


# --- parameters and layer costs --------------------------------------------------------------
def test_small_tensors_include_the_threshold():
    assert params.Tensors(numels=(80, 81, 3)).small(80) == 83
    assert params.persistence_threshold(TINY) == 80


def test_stage_parameters_add_the_first_and_last_extras():
    lc = LayerCosts(block_time=0, block_time_full_recompute=0, first_stage_time=0, last_stage_time=0,
                    first_stage_tp=0, last_stage_tp=0, block_act_bytes=0, block_act_bytes_full_recompute=0,
                    block_work_bytes=0, first_stage_act_bytes=0, last_stage_act_bytes=0, block_psi=100,
                    first_stage_psi=30, last_stage_psi=7, block_small=10, first_stage_small=3, last_stage_small=1,
                    fixed_bytes=0, in_flight=(1, 1))
    assert lc.stage_psi(0, 2, 4) == (430, 43)
    assert lc.stage_psi(1, 2, 4) == (407, 41)
    assert lc.stage_psi(0, 1, 4) == (437, 44)


# --- pipeline and factors --------------------------------------------------------------------
def test_pipeline_schedule():
    assert pipeline.bubble_fraction(4, 8, 2) == 3 / 16
    assert pipeline.bubble_fraction(1, 8, 1) == 0
    assert pipeline.in_flight(4, 2, 1) == (2, 2, 2, 1)
    scale = 1 + 3 / (4 * 8)                                  # interleaved: (1 + (p-1)/(p m))
    assert pipeline.in_flight(4, 8, 2) == pytest.approx((4 * scale, 3 * scale, 2 * scale, 1 * scale), rel=1e-15, abs=0)
    assert pipeline.pipeline_time((1.0, 3.0, 2.0), 5, 2) == (15.0, 1.5)


def test_cpu_processes_beyond_the_profile_stretch_compute_and_memory_bound_work():
    c = parse_cluster("6xcpu")                              # the cpu profile was measured with 2 processes
    dev = dataclasses.replace(c.device, factors={**c.device.factors, "compute_scale": 1.5, "comm_efficiency": 0.8})
    f = factors.cluster_factors(dataclasses.replace(c, device=dev))
    assert factors.oversubscription(c) == 3
    assert f.compute_scale == 4.5 and f.elementwise_scale == 3 and f.optimizer_scale == 3
    assert f.comm_efficiency == 0.8                      # the network is not shared that way
    assert factors.oversubscription(parse_cluster("8xA100")) == 1


def test_tp_groups_of_several_data_parallel_ranks():
    # nodes of 4, TP 3 x DP 2: ranks 0-2 stay on node 0, ranks 3-5 straddle nodes 0 and 1
    assert comm.group_sharing(4, 2, 3, 1, "tp") == (1,)
    with pytest.raises(AssertionError):
        comm.group_sharing(4, 2, 3, 1, "pp")


def test_attention_core_uses_its_precision_curve():
    dev = dataclasses.replace(SLOPED, gemm_efficiency_by_precision={"fp32": ((1e3, 0.2), (1e9, 0.2))})
    assert compute.core_time(TINY, dev, 1e6, 64, "fp32", 1.0) == pytest.approx(1e6 / (5e12 * 0.2), rel=1e-12, abs=0)


def test_engine_descriptions_refuse_unknown_fields():
    from planner.cost.engines import Buffer, Collective, Engine
    ok = dict(name="x", role="params", bytes=2, basis="psi", phase="always", held_by="module", sharded=False)
    Buffer(**ok)
    for bad in (dict(role="weights"), dict(phase="later"), dict(basis="all"), dict(held_by="nobody"),
                dict(sharded=None)):
        with pytest.raises(AssertionError):
            Buffer(**{**ok, **bad})
    good = dict(kind="all_reduce", bytes=2, per="step", overlap=False)
    Collective(**good)
    for bad in (dict(kind="broadcast"), dict(per="layer"), dict(overlap=None)):
        with pytest.raises(AssertionError):
            Collective(**{**good, **bad})
    with pytest.raises(AssertionError):
        Engine(name="x", buffers=(), collectives=(), optimizer_sharded=None, source="")


# --- link classes and hierarchical collectives (planner/cost/comm.py Route) ------------------

def _route_cluster(nodes: int, per_node: int) -> "ClusterSpec":
    from planner.specs.hardware import Link
    from planner.specs.cluster import ClusterSpec
    return ClusterSpec(nodes=nodes, gpus_per_node=per_node, device=parse_cluster("8xA100").device,
                       intra_node=Link(name="NVLink3 / NVSwitch", busbw_gbps=200, latency_us=2.0),
                       inter_node=Link(name="8x HDR InfiniBand", busbw_gbps=100, latency_us=10.0))


def test_intra_node_all_reduce_by_hand():
    # 8 ranks on one NVSwitch node, 64 MB: ring bytes 2 x 7/8 x 64e6 over 200 GB/s at the class's
    # efficiency 1.0, + the class's base 17.4 us + 14 ring steps x 2 us (one node: no tree)
    c = _route_cluster(1, 8)
    r = comm.group_routes(c, Plan(dp=8), "dp")[0]
    assert (r.per_node, r.nodes) == (8, 1)
    t = comm.route_allreduce(64e6, 8, r, 1.0)
    assert t == pytest.approx(64e6 * 2 * 7 / 8 / 200e9 + 17.4e-6 + 14 * 2e-6, rel=1e-12)
    # half the bandwidth doubles the byte term; no latency leaves it alone
    half = comm.Route(busbw=100e9, efficiency=1.0, per_node=8, nodes=1, intra_step=2e-6, inter_step=0.0,
                      base=17.4e-6)
    assert comm.route_allreduce(64e6, 8, half, 1.0) - t == pytest.approx(64e6 * 2 * 7 / 8 / 200e9, rel=1e-9)


def test_two_node_hierarchical_all_reduce_by_hand():
    # 16 ranks on 2 nodes x 8 (DP 16): the node's network is shared by one crossing group:
    # min(200, 100 / 1) = 100 GB/s at InfiniBand's 0.84; ring: 2 x 15/16 of the bytes, 2 x 7
    # intra-node steps x 2 us + 2 x 1 network step x 10 us; tree: 2 x the bytes, same intra
    # steps + 2 ceil(log2 2) = 2 network steps. Large message: ring; 2 KB: equal latency, ring
    c = _route_cluster(2, 8)
    r = comm.group_routes(c, Plan(dp=16), "dp")[0]
    assert (r.per_node, r.nodes, r.busbw, r.efficiency) == (8, 2, 100e9, 0.84)
    lat = 17.4e-6 + 14 * 2e-6 + 2 * 10e-6
    assert comm.route_allreduce(1e9, 16, r, 1.0) == pytest.approx(1e9 * 2 * 15 / 16 / (100e9 * 0.84) + lat, rel=1e-12)
    # a flat ring would pay 30 network steps: 300 us more than the hierarchical 2
    assert comm.route_allreduce(2048, 16, r, 1.0) == pytest.approx(2048 * 2 * 15 / 16 / 84e9 + lat, rel=1e-12)
    # 8 nodes of 2 (k 2, m 8): small messages go by tree (2 x 3 network steps, not 2 x 7)
    r8 = comm.Route(busbw=84e9, efficiency=1.0, per_node=2, nodes=8, intra_step=2e-6, inter_step=10e-6, base=0.0)
    small = comm.route_allreduce(2048, 16, r8, 1.0)
    assert small == pytest.approx(2048 * 2 / 84e9 + 2 * 2e-6 + 6 * 10e-6, rel=1e-12)
    big = comm.route_allreduce(1e9, 16, r8, 1.0)
    assert big == pytest.approx(1e9 * 2 * 15 / 16 / 84e9 + 2 * 2e-6 + 14 * 10e-6, rel=1e-12)
    # all-gather: (k - 1) intra-node and (m - 1) network steps
    assert comm.route_allgather(1e9, 16, r, 1.0) == pytest.approx(
        1e9 * 15 / 16 / 84e9 + 17.4e-6 + 7 * 2e-6 + 1 * 10e-6, rel=1e-12)


def test_link_classes_from_names():
    from planner.specs.hardware import Link
    assert comm.link_class(Link(name="NVLink4 / NVSwitch", busbw_gbps=1, latency_us=0)) == "nvswitch"
    assert comm.link_class(Link(name="8x NDR InfiniBand 400 Gb/s per node", busbw_gbps=1, latency_us=0)) == "infiniband"
    assert comm.link_class(Link(name="4 Omni-Path links", busbw_gbps=1, latency_us=0)) == "omnipath"
    assert comm.link_class(Link(name="PCIe Gen4 x16", busbw_gbps=1, latency_us=0)) == "pcie"
    assert comm.link_class(Link(name="toy", busbw_gbps=1, latency_us=0)) == ""
    assert comm.class_efficiency(Link(name="toy", busbw_gbps=1, latency_us=0)) == 1.0


def test_network_efficiency_scales_only_network_bound_traffic():
    # the 2-node route's bottleneck is the network: its bandwidth term takes network_efficiency
    # (0.5 doubles it); an intra-node route's does not
    c = _route_cluster(2, 8)
    r = comm.group_routes(c, Plan(dp=16), "dp")[0]
    assert r.network
    full, half = comm.route_allgather(1e9, 16, r, 1.0), comm.route_allgather(1e9, 16, r, 1.0, network=0.5)
    assert half - full == pytest.approx(1e9 * 15 / 16 / 84e9, rel=1e-12)
    inside = comm.group_routes(_route_cluster(1, 8), Plan(dp=8), "dp")[0]
    assert not inside.network
    assert comm.route_allgather(1e9, 8, inside, 1.0, network=0.5) == comm.route_allgather(1e9, 8, inside, 1.0)


def test_pipeline_send_pays_class_base_and_efficiency():
    # across nodes: 1 MB over 100 GB/s / 8 GPUs at InfiniBand's 0.84 (x network 0.5) + 17.4 us + 10 us
    c = _route_cluster(2, 8)
    t = comm.p2p_time(1e6, c, True, 1.0, 0.5)
    assert t == pytest.approx(1e6 / (100e9 / 8 * 0.84 * 0.5) + 17.4e-6 + 10e-6, rel=1e-12)
    # inside a node: 200 GB/s at NVSwitch's 1.0, + 17.4 us + 2 us; network_efficiency does not apply
    assert comm.p2p_time(1e6, c, False, 1.0, 0.5) == pytest.approx(1e6 / 200e9 + 17.4e-6 + 2e-6, rel=1e-12)
