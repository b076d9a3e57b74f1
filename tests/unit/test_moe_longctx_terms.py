"""MoE and long-context cost terms at values where every factor shows (issue 19, mutation run
over planner/cost/moe.py and longctx.py): tensor parallelism 2, micro-batch 2, two shared
experts, a GELU model, scales and efficiencies other than 1, latencies other than 0. The
existing pins (tests/unit/test_moe_longctx_cost.py) use t = b = 1 and unit factors, where a
term multiplied instead of divided, or a branch taken the other way, gives the same number."""
import dataclasses

import pytest

from planner.cost import compute, longctx, moe
from planner.cost.factors import Factors
from planner.cost.runtime import get_runtime
from planner.specs.hardware import parse_cluster
from planner.specs.plan import Plan
from planner.specs.presets import preset

AIR = preset("glm-4.5-air")        # 128 experts, top-8, 1 shared expert of 1408, SwiGLU, h 4096
TWO_SHARED = dataclasses.replace(AIR, moe=dataclasses.replace(AIR.moe, shared_experts=2))
NO_SHARED = dataclasses.replace(AIR, moe=dataclasses.replace(AIR.moe, shared_experts=0))
GELU = dataclasses.replace(TWO_SHARED, activation="gelu")
EXACT = 1e-12                      # relative: a constant off by one part in 1e9 fails


# --- moe.py ------------------------------------------------------------------------------------

def test_shared_experts_flops_scale_with_their_count_and_split_by_tp():
    s, b, t = 1024, 2, 2
    _, shared, _ = moe.ffn_flops(TWO_SHARED, s, b, t)
    assert shared == 2.0 * s * b * 4096 * 1408 * 3 * 2 / 2          # 2 shared experts, t = 2


def test_moe_activation_bytes_at_tp2_b2_two_shared_experts():
    s, b, t, e = 1024, 2, 2, 2.0
    pairs = s * b * 8 / t                                            # T k lf / t
    moe_a, dense_a = moe.ffn_activation_bytes(TWO_SHARED, s, b, t, e)
    assert dense_a == e * b * s * 10944 / t * 4                      # GLU: 4 tensors of f / t
    assert moe_a == (2 * 4 * s * b * 128                             # router scores + probabilities
                     + pairs * e * (2 * 4096 + 1408 * 4)             # dispatched in/out + expert inner
                     + e * b * s * 1408 * 2 / t * 4)                 # 2 shared experts, split by TP
    # a GELU model keeps 2 tensors per FFN width, not 4
    g_moe, g_dense = moe.ffn_activation_bytes(GELU, s, b, t, e)
    assert g_dense == e * b * s * 10944 / t * 2
    assert g_moe == 2 * 4 * s * b * 128 + pairs * e * (2 * 4096 + 1408 * 2) + e * b * s * 1408 * 2 / t * 2


def test_moe_elementwise_bytes_at_tp2_b2_two_shared_experts():
    s, b, t, e = 1024, 2, 2, 2.0
    pairs = s * b * 8 / t
    moe_e, dense_e = moe.ffn_elementwise_bytes(TWO_SHARED, s, b, t, e)
    assert dense_e == s * b * e * (2 * 10944 + 10944) * 2 / t
    assert moe_e == (pairs * e * (2 * 1408 + 1408) * 2 + pairs * 4096 * e * 2 * 2
                     + s * b * e * 3 * 1408 * 2 * 2 / t + s * b * 128 * 4 * 2)


def test_routed_experts_time_uses_the_precisions_curve_and_the_scale():
    """The routed experts' GEMMs at one expert's efficiency on the precision's own curve (a
    measured profile has one per precision), times the compute scale."""
    dev = parse_cluster("8xH100").device
    flat = ((1e6, 0.5), (1e15, 0.5))
    dev = dataclasses.replace(dev, gemm_efficiency=flat, gemm_efficiency_by_precision={"bf16": ((1e6, 0.25), (1e15, 0.25))})
    s, b, t, ep = 4096, 1, 1, 8
    router, shared, routed = moe.ffn_flops(AIR, s, b, t)
    peak = dev.peak_flops("bf16")
    want = (router + shared + routed) / (peak * 0.25) * 1.5
    assert moe.ffn_time(AIR, dev, s, b, t, ep, "bf16", 1.5) == pytest.approx(want, rel=EXACT)


def test_moe_block_without_shared_experts_costs_no_shared_gemm():
    dev = parse_cluster("8xH100").device
    router, shared, routed = moe.ffn_flops(NO_SHARED, 4096, 1, 1)
    assert shared == 0.0
    one = routed / (128 // 8) / 3
    want = (compute.gemm_time(dev, router, "bf16", 1.0)
            + routed / (dev.peak_flops("bf16") * dev.gemm_eff(one, "bf16")))
    assert moe.ffn_time(NO_SHARED, dev, 4096, 1, 1, 8, "bf16", 1.0) == pytest.approx(want, rel=EXACT)


def test_no_expert_parallelism_no_dispatch_and_ep2_pays_it():
    c = parse_cluster("8xH100")
    p = Plan(dp=8, ep=1, micro_batch=1, grad_accum=1)
    assert moe.alltoall_comm(AIR, c, p, 4096, 2.0, 1.0) == (0.0, 0.0)
    fwd, bwd = moe.alltoall_comm(AIR, c, dataclasses.replace(p, ep=2), 4096, 2.0, 0.5)
    nbytes = 4096 * 8 * 4096 * 2.0                                     # T k lf h e
    bw, lat = c.intra_node.busbw_gbps * 1e9, c.intra_node.latency_us * 1e-6
    one = nbytes / 2 / (bw * 0.5) + lat
    assert fwd == pytest.approx(2 * one, rel=EXACT) and bwd == pytest.approx(2 * one, rel=EXACT)


def test_expert_plan_drops_the_zero3_group_variants():
    """The experts' ZeRO group is the dp / ep expert-data-parallel ranks, without MiCS or hpZ
    sub-groups (those are the dense ZeRO-3 group's)."""
    for variant in ({"mics_shard": 2}, {"hpz": 2}):
        p = Plan(dp=8, ep=2, zero=3, micro_batch=1, grad_accum=1, **variant)
        e = moe.expert_plan(p)
        assert (e.dp, e.ep, e.mics_shard, e.hpz) == (4, 1, 0, 1)


def _sync_step(plan, f, backward=(0.0,), sharded=True):
    return moe.expert_sync_and_step(AIR, parse_cluster("2x8xH100"), plan, (46,), f, backward, 2.0, sharded)


def test_expert_sync_and_step_factors_precision_and_sharding():
    c = parse_cluster("2x8xH100")
    f = Factors(latency_scale=2.0, comm_efficiency=1.0, dp_overlap=0.0, optimizer_scale=1.5)
    p = Plan(dp=16, ep=4, zero=1, micro_batch=1, grad_accum=3)
    psi = 46 * (45 / 46) * (128 // 4) * AIR.expert_params
    bw = min(c.intra_node.busbw_gbps, c.inter_node.busbw_gbps / 4) * 1e9
    lat = c.inter_node.latency_us * 1e-6
    ring = psi * 2.0 * 2 * 3 / 4 / bw + 2 * 3 * lat * 2.0               # latency_scale 2
    tree = psi * 2.0 * 2 * 3 / 4 / bw + 2 * 2 * lat * 2.0
    sync, step = _sync_step(p, f)
    # ZeRO-1: synced once per step whatever the accumulation; the cheaper of ring and tree
    assert sync == pytest.approx(min(ring, tree), rel=1e-9)
    hbm = c.device.hbm_bandwidth_gbps * 1e9
    assert step == pytest.approx(psi / 4 * 30.0 / hbm * 1.5, rel=EXACT)   # optimizer_scale 1.5
    # ZeRO-2 reduces the experts' gradients every micro-batch: 3 accumulation steps, 3 syncs
    z2 = _sync_step(dataclasses.replace(p, zero=2), f)[0]
    assert z2 == pytest.approx(3 * sync, rel=1e-9)
    # fp32 Adam moves 28 bytes per parameter; an unsharded optimizer updates all the experts
    fp32 = _sync_step(dataclasses.replace(p, precision="fp32"), f)[1]
    assert fp32 == pytest.approx(psi / 4 * 28.0 / hbm * 1.5, rel=EXACT)
    whole = _sync_step(p, f, sharded=False)[1]
    assert whole == pytest.approx(psi * 30.0 / hbm * 1.5, rel=EXACT)


# --- longctx.py --------------------------------------------------------------------------------

def test_axis_link_bandwidth_and_latency_exactly():
    c = parse_cluster("2x8xH100")
    bw, lat, _ = longctx.axis_link(c, 2, 4)                            # 8 ranks: one node
    assert bw == pytest.approx(370.0 * 1e9, rel=EXACT) and lat == pytest.approx(1.32e-6, rel=EXACT)
    bw, lat, _ = longctx.axis_link(c, 4, 4)                            # 16 ranks: the network, 1/4 each
    assert bw == pytest.approx(340.0 / 4 * 1e9, rel=EXACT) and lat == pytest.approx(11.5e-6, rel=EXACT)


def test_ulysses_messages_split_by_tp():
    m, c = preset("glm-4-9b"), parse_cluster("8xA100-80GB")
    bw, lat = c.intra_node.busbw_gbps * 1e9, c.intra_node.latency_us * 1e-6
    f, b_ = longctx.ulysses_comm(m, 16384, 2, 2, 2.0, 4, (bw, lat), 0.5)
    per = [2 * 16384 * 2.0 / 2 * w for w in (4096, 256, 256, 4096)]   # b s/cp e / t x width
    assert f == pytest.approx(sum(x * 3 / 4 / (bw * 0.5) + 3 * lat for x in per), rel=EXACT) and b_ == f


def test_ring_at_cp2_tp2_with_latency_efficiency_and_partial_hiding():
    m = preset("glm-4-9b")
    s, b, t, e, cp = 8192, 2, 2, 2.0, 2
    bw, lat, eff = 100e9, 5e-6, 0.5
    kv = b * s * 2 * 256 / t * e                                       # the rank's KV chunk
    step = kv / (bw * eff) + lat
    core_f, core_b = step, 2 * step                                    # hides half of each step
    f, b_ = longctx.ring_comm(m, s, b, t, e, cp, (bw, lat), eff, core_f, core_b)
    assert f == pytest.approx((cp - 1) * (step - core_f / cp), rel=EXACT)
    assert b_ == pytest.approx((cp - 1) * (2 * step - lat - core_b / cp), rel=EXACT)
    assert f > 0 and b_ > 0
    assert longctx.ring_comm(m, s, b, t, e, 1, (bw, lat), eff, 0.0, 0.0) == (0.0, 0.0)


def test_block_comm_routes_by_kind_over_the_cp_axis():
    m, c = preset("glm-4-9b"), parse_cluster("8xA100-80GB")
    s, b, t, e = 8192, 2, 2, 2.0
    assert longctx.block_comm(m, c, t, b, 1, "ring", s, e, 0.5, 0.0, 0.0) == (0.0, 0.0)
    bw, lat, _ = longctx.axis_link(c, t, 2)
    ring = longctx.ring_comm(m, s, b, t, e, 2, (bw, lat), 0.5, 1e-4, 2e-4)
    assert ring[0] > 0 and ring[1] > 0
    assert longctx.block_comm(m, c, t, b, 2, "ring", s, e, 0.5, 1e-4, 2e-4) == ring
    uly = longctx.ulysses_comm(m, s, b, t, e, 2, (bw, lat), 0.5)
    assert longctx.block_comm(m, c, t, b, 2, "ulysses", s, e, 0.5, 1e-4, 2e-4) == uly != ring


# --- compute.py / runtime.py -------------------------------------------------------------------

def test_core_gemms_batch_the_heads_of_a_tp_rank():
    dev = parse_cluster("8xH100").device
    m = preset("glm-4-9b")                                             # 32 heads of 128
    s = 4096
    qk, pv = compute.core_gemm_times(m, dev, s, 2, 4, "bf16")
    n = 2 * 32 // 4                                                    # b a / t = 16
    assert qk == compute.shape_time(dev, s, s, 128, "bf16", batch=n)
    assert pv == compute.shape_time(dev, s, 128, s, "bf16", batch=n)
    assert pv > compute.shape_time(dev, s, 128, s, "bf16", batch=1)
    one = dataclasses.replace(m, heads=4, kv_groups=2, head_dim=128)     # b a / t = 1
    assert compute.core_gemm_times(one, dev, s, 1, 4, "bf16")[0] == compute.shape_time(dev, s, s, 128, "bf16", batch=1)


def test_zero_labels_follow_the_runtime():
    assert get_runtime("megatron-core").zero_label(1).startswith("distributed optimizer")
    assert get_runtime("fsdp").zero_label(3) == "FULL_SHARD"
    assert get_runtime("deepspeed").zero_label(2) == "ZeRO-2"


def test_moe_model_flops_swap_the_dense_ffn_for_active_experts_without_padding():
    """GLM-4.5-Air at 4k with a capacity factor of 1.25 (padding is not model FLOPs): a MoE
    block is the dense block less its FFN (2 s h 10944 x 3, SwiGLU) plus the router (2 s h E),
    the shared expert (2 s h 1408 x 3) and k = 8 routed experts per token (2 s k h 1408 x 3);
    45 of the 46 blocks are MoE blocks. Forward + backward = 3 x (46 blocks + output layer)."""
    s, h = 4096, 4096
    padded = dataclasses.replace(AIR, moe=dataclasses.replace(AIR.moe, capacity_factor=1.25))
    dense = compute.block_forward_flops(padded, s, 1)
    swap = 2 * s * h * 128 + 2 * s * h * 1408 * 3 + 2 * s * 8 * h * 1408 * 3 - 2 * s * h * 10944 * 3
    block = dense + 45 / 46 * swap
    assert moe.block_forward_flops(padded, s) == pytest.approx(block, rel=EXACT)
    logits = 2.0 * s * h * 151552
    assert moe.model_flops_per_sequence(padded, s) == pytest.approx(3.0 * (46 * block + logits), rel=EXACT)
    # dropless with a stated imbalance: the busiest rank's extra tokens are not model FLOPs either
    skewed = dataclasses.replace(AIR, moe=dataclasses.replace(AIR.moe, imbalance=1.5))
    assert moe.block_forward_flops(skewed, s) == pytest.approx(block, rel=EXACT)
    dense_model = preset("glm-4-9b")
    assert moe.model_flops_per_sequence(dense_model, s) == compute.model_flops_per_sequence(dense_model, s)
    assert moe.block_forward_flops(dense_model, s) == compute.block_forward_flops(dense_model, s, 1)
