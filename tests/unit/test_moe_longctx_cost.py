"""MoE and long-context cost terms, each pinned to a hand-computed value (a term removed or
halved fails its test), and the legality rules of EP and CP."""
import dataclasses

import pytest

from planner.cost import compute, engines, estimate, layer_costs, longctx, moe
from planner.cost.factors import Factors
from planner.cost.model import moe_state_bytes
from planner.specs.cluster import parse_cluster
from planner.specs.presets import preset, scale
from planner.specs.moe import MoESpec
from planner.specs.plan import Plan
from planner.specs.train import TrainSpec
from planner.specs.validate import plan_problems, runtime_problems

AIR = preset("glm-4.5-air")


def test_ffn_flops_by_hand():
    m = dataclasses.replace(AIR, moe=dataclasses.replace(AIR.moe, imbalance=1.5))
    s, b, t = 4096, 2, 2
    router, shared, routed = moe.ffn_flops(m, s, b, t)
    assert router == 2 * s * b * 4096 * 128
    assert shared == 2 * s * b * 4096 * 1408 * 3 / t
    assert routed == 2 * (s * b * 8 * 1.5 / t) * 4096 * 1408 * 3


def test_alltoall_by_hand():
    # each rank holds 1 GB and keeps 1/4: 0.75 GB at 100 GB/s (efficiency 0.5) + 3 latencies
    assert longctx.alltoall_time(1e9, 4, 100e9, 1e-5, 0.5) == pytest.approx(0.75 / 50 + 3e-5)
    assert longctx.alltoall_time(1e9, 1, 100e9, 1e-5, 0.5) == 0.0


def test_moe_dispatch_combine_by_hand():
    c = parse_cluster("2x8xH100")
    p = Plan(dp=16, ep=8, micro_batch=1, grad_accum=1)
    s = 4096
    fwd, bwd = moe.alltoall_comm(AIR, c, p, s, 2.0, 1.0)
    nbytes = s * 8 * 1.0 * 4096 * 2.0  # T k lf h e
    bw, lat = c.intra_node.busbw_gbps * 1e9, c.intra_node.latency_us * 1e-6
    one = nbytes * 7 / 8 / bw + 7 * lat
    assert fwd == pytest.approx(2 * one) and bwd == pytest.approx(2 * one)
    # ep 16 spans both nodes: the node's network, shared by tp (1) crossing group
    far = moe.alltoall_comm(AIR, c, dataclasses.replace(p, ep=16), s, 2.0, 1.0)[0]
    ibw = min(c.intra_node.busbw_gbps, c.inter_node.busbw_gbps) * 1e9
    assert far == pytest.approx(2 * (nbytes * 15 / 16 / ibw + 15 * c.inter_node.latency_us * 1e-6))


def test_expert_states_shard_over_expert_dp():
    # ZeRO-1, bf16: params 2 + grads 2 bytes whole, 12 bytes of fp32 master + Adam over dp/ep
    p = Plan(dp=8, ep=4, zero=1, micro_batch=1, grad_accum=1)
    psi = 128 // 4 * AIR.expert_params
    pa, gr, op = moe_state_bytes(p, AIR, resident=False)
    assert pa == pytest.approx(2 * psi) and op == pytest.approx(12 * psi / 2)
    # ep 8: half the experts per rank, each with its whole optimizer state (expert_dp 1)
    assert moe_state_bytes(dataclasses.replace(p, ep=8), AIR, False)[2] == pytest.approx(12 * (psi / 2))


def test_mean_block_weights_the_moe_share():
    c, tr = parse_cluster("8xH100"), TrainSpec(global_batch=8, seq_len=4096)
    p = Plan(dp=8, ep=8, zero=1, micro_batch=1, grad_accum=1)
    lc = layer_costs(AIR, c, tr, p)
    share = 45 / 46
    psi_e = 128 // 8 * AIR.expert_params
    # expert_dp 1: the engine's states of psi_e on a ZeRO group of one rank
    held, back, _ = engines.footprint(Plan(dp=1, zero=1)).evaluate(psi_e, 0.0)
    assert sum(lc.block_expert_bytes) == pytest.approx(share * sum(held[:3] + back[:3]))
    assert sum(lc.block_expert_bytes) >= share * 16 * psi_e
    dense = AIR.layer_params
    assert lc.block_psi == pytest.approx((1 - share) * dense + share * AIR.moe_dense_params)


def test_local_plan_is_dp_times_cp():
    p, tr = Plan(dp=2, cp=4, micro_batch=1, grad_accum=8), TrainSpec(global_batch=16, seq_len=65536)
    lp, ltr = longctx.local(p, tr)
    assert (lp.dp, lp.cp, ltr.seq_len, ltr.global_batch) == (8, 1, 16384, 64)
    assert lp.world_size == p.world_size and lp.global_batch == ltr.global_batch


def test_ulysses_four_alltoalls_by_hand():
    m, c = preset("glm-4-9b"), parse_cluster("8xA100-80GB")
    bw, lat = c.intra_node.busbw_gbps * 1e9, c.intra_node.latency_us * 1e-6
    f, b_ = longctx.ulysses_comm(m, 32768, 1, 1, 2.0, 2, (bw, lat), 1.0)
    per = [32768 * 2.0 * w for w in (4096, 256, 256, 4096)]   # q, k, v, output widths
    assert f == pytest.approx(sum(x / 2 / bw + lat for x in per)) and b_ == f


def test_ring_exposes_only_what_compute_does_not_hide():
    m = preset("glm-4-9b")
    kv = 8192 * 2 * 256 * 2.0
    f, b_ = longctx.ring_comm(m, 8192, 1, 1, 2.0, 4, (1e9, 0.0), 1.0, core_fwd=0.0, core_bwd=0.0)
    assert f == pytest.approx(3 * kv / 1e9) and b_ == pytest.approx(3 * 2 * kv / 1e9)
    hidden = longctx.ring_comm(m, 8192, 1, 1, 2.0, 4, (1e9, 0.0), 1.0, core_fwd=1e3, core_bwd=1e3)
    assert hidden == (0.0, 0.0)


def test_cp_core_is_cp_times_the_local_block():
    # 9B at 64k, one rank's attention core with cp 2 is half the cp 1 core, not a quarter
    m, c = preset("glm-4-9b"), parse_cluster("8xA100-80GB")
    tr = TrainSpec(global_batch=8, seq_len=65536)
    one = estimate(m, c, tr, Plan(dp=8, zero=3, micro_batch=1, grad_accum=1, recompute="full"))
    two = estimate(m, c, tr, Plan(dp=4, cp=2, zero=3, micro_batch=1, grad_accum=2, recompute="full"))
    # same tokens per step and FLOPs; the core dominates at 64k, so the step time stays close
    assert two.model_flops_per_step == one.model_flops_per_step
    assert 0.8 < two.step_time_s / one.step_time_s < 1.25
    assert two.peak_memory_bytes < one.peak_memory_bytes


def test_ep_and_cp_rules():
    c, tr = parse_cluster("8xH100"), TrainSpec(global_batch=8, seq_len=4096)
    dense = preset("glm-4-9b")
    assert any("mixture-of-experts" in x.line for x in plan_problems(dense, c, tr, Plan(dp=8, ep=2)))
    odd = dataclasses.replace(AIR, moe=dataclasses.replace(AIR.moe, experts=12))
    assert any("does not divide the 12 experts" in x.line for x in plan_problems(odd, c, tr, Plan(dp=8, ep=8)))
    assert any("ZeRO-3" in x.line for x in plan_problems(AIR, c, tr, Plan(dp=8, zero=3)))
    p = Plan(dp=2, cp=4, micro_batch=1, grad_accum=4)
    assert any("KV groups" in x.line for x in plan_problems(dense, c, tr, p))
    ring = dataclasses.replace(p, cp_kind="ring")
    assert not plan_problems(dense, c, tr, ring) and runtime_problems(ring)
    short = TrainSpec(global_batch=8, seq_len=4100)
    assert any("2 x cp = 8" in x.line for x in plan_problems(dense, c, short, ring))


def test_expert_gradient_sync_and_step_by_hand():
    c = parse_cluster("2x8xH100")
    f = Factors(latency_scale=1.0, comm_efficiency=1.0, dp_overlap=0.0, optimizer_scale=1.0)
    p = Plan(dp=16, ep=4, zero=1, micro_batch=1, grad_accum=1)
    sync, step = moe.expert_sync_and_step(AIR, c, p, (46,), f, (0.0,), 2.0, True)
    psi = 46 * (45 / 46) * (128 // 4) * AIR.expert_params      # the mean block's experts on one rank
    # dp/ep = 4 expert-data-parallel ranks at stride tp x ep = 4: they span both nodes
    bw = min(c.intra_node.busbw_gbps, c.inter_node.busbw_gbps / 4) * 1e9
    want = psi * 2.0 * 2 * 3 / 4 / bw + 2 * 2 * c.inter_node.latency_us * 1e-6
    assert sync == pytest.approx(want)
    assert step == pytest.approx(psi / 4 * 30.0 / (c.device.hbm_bandwidth_gbps * 1e9))
    # half of it hidden behind a long backward
    half = moe.expert_sync_and_step(AIR, c, p, (46,), f.replace(dp_overlap=0.5), (1e9,), 2.0, True)[0]
    assert half == pytest.approx(want / 2)
    assert moe.expert_sync_and_step(AIR, c, dataclasses.replace(p, ep=16), (46,), f, (0.0,), 2.0, True)[0] == 0.0


def test_moe_activation_and_traffic_by_hand():
    s, b, t, e = 1024, 1, 1, 2.0
    moe_a, dense_a = moe.ffn_activation_bytes(AIR, s, b, t, e)
    pairs = s * b * 8  # k = 8, dropless, balanced
    assert dense_a == e * b * s * 10944 * 4
    assert moe_a == 2 * 4 * s * b * 128 + pairs * e * (2 * 4096 + 1408 * 4) + e * b * s * 1408 * 4
    moe_e, dense_e = moe.ffn_elementwise_bytes(AIR, s, b, t, e)
    assert dense_e == s * b * e * (2 * 10944 + 10944) * 2
    assert moe_e == (pairs * e * (2 * 1408 + 1408) * 2 + pairs * 4096 * e * 4 + s * b * e * 3 * 1408 * 2
                     + s * b * 128 * 4 * 2)


def test_grouped_expert_gemms_run_at_one_experts_efficiency():
    c = parse_cluster("8xH100")
    dev = c.device
    s, b = 4096, 1
    router, shared, routed = moe.ffn_flops(AIR, s, b, 1)
    one = routed / (128 // 8) / 3
    want = (compute.gemm_time(dev, router, "bf16", 1.0) + compute.gemm_time(dev, shared, "bf16", 1.0)
            + routed / (dev.peak_flops("bf16") * dev.gemm_eff(one, "bf16")))
    assert moe.ffn_time(AIR, dev, s, b, 1, 8, "bf16", 1.0) == pytest.approx(want)


def test_cp_block_core_is_cp_times_the_local_one():
    from planner.cost.factors import cluster_factors
    from planner.cost.block import block_times
    m, c = preset("glm-4-9b"), parse_cluster("8xA100-80GB")
    f = cluster_factors(c)
    p, tr = Plan(dp=4, cp=2, micro_batch=1, grad_accum=1), TrainSpec(global_batch=4, seq_len=65536)
    lp, ltr = longctx.local(p, tr)
    plain = block_times(m, c, ltr, lp, f)
    cp2 = block_times(m, c, ltr, lp, f, (2, "ulysses"))
    # the local core from the flash kernel's measured throughput (the executor: FA2 over every block)
    core = compute.block_compute_times(m, c.device, 32768, 1, 1, "bf16", compute_scale=f.compute_scale,
                                       attention_scale=f.attention_scale,
                                       attention=compute.AttentionKernel(("fa2",), False)).core_fwd
    assert core == pytest.approx(compute.flash_core_times(m, c.device, 32768, 1, 1, "bf16",
                                                          compute.AttentionKernel(("fa2",), False))[0]
                                 * f.attention_scale)
    assert cp2.forward - plain.forward == pytest.approx(core)          # (2 - 1) x the local core
    assert cp2.selective - plain.selective == pytest.approx(core)
    assert cp2.a2a_fwd > 0 and plain.a2a_fwd == 0
