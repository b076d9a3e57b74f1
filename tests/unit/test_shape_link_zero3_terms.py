"""Shape-timed GEMMs, link routes, ZeRO-3 over the network and the runtimes' refusals, pinned
where every factor shows (issue 19, mutation run over planner/cost/compute.py, comm.py,
zero.py, runtime.py): non-multiple tile counts, batched and memory-bound GEMMs, fp8 and fp16,
micro-batch and TP 2 in the flash core, one-rank collectives on links with a base latency,
comm, latency and network efficiencies other than 1, and each refusal's exact words."""
import dataclasses

import pytest

from planner.cost import comm, compute, zero
from planner.cost.factors import Factors
from planner.cost.runtime import get_runtime, problems
from planner.specs.hardware import parse_cluster
from planner.specs.plan import Plan
from planner.specs.presets import preset, scale

EXACT = 1e-12
H100 = parse_cluster("8xH100").device


# --- compute.py: tiles, waves, shapes ----------------------------------------------------------

def test_wave_efficiency_rounds_each_side_up_to_whole_tiles():
    # 80 x 192 output in 64 x 64 tiles: 2 x 3 = 6 tiles, 2 waves of 4 SMs: 15,360 / (2 x 4 x 4,096)
    assert compute.wave_efficiency(80, 192, (64, 64), 4) == 80 * 192 / (2 * 4 * 64 * 64)
    assert compute.wave_efficiency(192, 80, (64, 64), 4) == 80 * 192 / (2 * 4 * 64 * 64)


def _q(m, n, batch=1):
    return max(compute.wave_efficiency(m, n, tile, H100.kernels.sms, batch) for tile in H100.kernels.gemm_tiles)


def test_shape_time_of_a_single_row_gemm():
    """m = 1 (one token): one row of tiles; its compute bound, not the memory one, decides."""
    m, n, k = 1, 4096, 4096
    compute_s = 2.0 * m * n * k / (H100.peak_flops("bf16") * 0.747 * _q(1, n))
    memory_s = 2.0 * (m * k + k * n + m * n) / H100.hbm_bytes_per_s
    assert compute_s > memory_s
    assert compute.shape_time(H100, m, n, k, "bf16") == pytest.approx(compute_s, rel=EXACT)
    assert compute.shape_time(H100, 4096, 1, 4096, "bf16") == pytest.approx(compute_s, rel=EXACT)


def test_memory_bound_shape_reads_its_precisions_bytes_per_batch():
    """[16896, 128] x [128, 128] (one full wave of 128 x 128 tiles) is bound by HBM: fp8 moves
    1 byte per element, fp16 2; a batch of 3 moves 3 times the bytes."""
    m, n, k = 132 * 128, 128, 128
    elems = m * k + k * n + m * n
    for prec, nbytes in (("fp8", 1.0), ("fp16", 2.0)):
        memory_s = nbytes * elems * 3 / H100.hbm_bytes_per_s
        compute_s = 2.0 * m * n * k * 3 / (H100.peak_flops(prec) * 0.747 * _q(m, n, 3))
        assert memory_s > compute_s
        assert compute.shape_time(H100, m, n, k, prec, batch=3) == pytest.approx(memory_s, rel=EXACT)


def test_shape_time_without_a_tile_model_is_the_flops_curve_per_gemm():
    """A100 has no fp32 ceiling: each of the batch's GEMMs on the FLOPs-only curve, at its own
    size's efficiency (not the batch's)."""
    a100 = parse_cluster("8xA100-80GB").device
    one = 2.0 * 1024 * 1024 * 512
    want = 4 * compute.gemm_time(a100, one, "fp32", 1.0)
    assert compute.gemm_time(a100, 4 * one, "fp32", 1.0) != pytest.approx(want)   # the curve bends here
    assert compute.shape_time(a100, 1024, 1024, 512, "fp32", batch=4) == pytest.approx(want, rel=EXACT)
    assert compute.shape_time(a100, 1024, 1024, 0, "fp32") == 0.0


def test_a_gemm_without_flops_takes_no_time_on_a_tiled_device():
    assert compute.shape_time(H100, 1024, 1024, 0, "bf16") == 0.0


def test_flash_core_by_micro_batch_tp_mask_and_fp16():
    m = preset("glm-4-9b")                                              # 32 heads of 128
    s, b, t = 4096, 2, 2
    kern = compute.AttentionKernel(("fa2",), True)
    fwd, bwd = compute.flash_core_times(m, H100, s, b, t, "fp16", kern)
    flops = 4.0 * b * s * s * (32 / t) * 128 * 0.5
    assert fwd == pytest.approx(flops / (319.0e12), rel=EXACT)          # fa2 causal forward, d 128, s 4k
    assert bwd == pytest.approx(2.5 * flops / (268.7e12), rel=EXACT)    # its causal backward


def test_linear_attention_core_runs_at_one_chunks_efficiency():
    m = dataclasses.replace(preset("glm-4-9b"), attention_kind="linear")
    s, flops = 8192, 1e12
    chunk = 2.0 * compute.LINEAR_CHUNK ** 2 * 128
    want = flops / (H100.peak_flops("bf16") * H100.gemm_eff(chunk, "bf16")) * 1.5
    assert compute.core_time(m, H100, flops, s, "bf16", 1.5) == pytest.approx(want, rel=EXACT)
    dense = preset("glm-4-9b")
    full = 2.0 * s * s * 128
    want = flops / (H100.peak_flops("bf16") * H100.gemm_eff(full, "bf16")) * 1.5
    assert compute.core_time(dense, H100, flops, s, "bf16", 1.5) == pytest.approx(want, rel=EXACT)


# --- comm.py: one rank sends nothing, even on a link with a base latency -------------------------

def test_one_rank_collectives_cost_nothing_on_a_link_with_a_base_latency():
    r = comm.route(parse_cluster("8xH100"), 1, 0, 1, 1)
    assert r.base > 0
    assert comm.route_allreduce(1e9, 1, r, 1.0) == 0.0
    assert comm.route_allgather(1e9, 1, r, 1.0) == 0.0


# --- zero.py: ZeRO-3 across nodes at every efficiency --------------------------------------------

F = Factors(comm_efficiency=0.8, latency_scale=2.0, dp_overlap=0.0, network_efficiency=0.5)
C2 = parse_cluster("2x8xH100")
IB, NVS = C2.inter_node, C2.intra_node


def _unit(n=1_000_000, **kw):
    return zero.Unit(tensors=(n,), elements=n, forward=0.0, backward=0.0, **kw)


def _net_route(share, per_node, nodes):
    """The hand-made Route of a group whose bottleneck is the node's network share."""
    return comm.Route(busbw=IB.busbw_gbps / share * 1e9, efficiency=comm.class_efficiency(IB), per_node=per_node,
                      nodes=nodes, intra_step=NVS.latency_us * 1e-6, inter_step=IB.latency_us * 1e-6,
                      base=max(comm.class_base(NVS), comm.class_base(IB)), network=True)


def _gather(nbytes, n, r):
    bw = r.busbw * r.efficiency * 0.8 * (0.5 if r.network else 1.0)
    return nbytes * (n - 1) / n / bw + r.base + 2.0 * ((r.per_node - 1) * r.intra_step + (r.nodes - 1) * r.inter_step)


def test_zero3_gathers_and_reduce_scatters_over_two_nodes_by_hand():
    p = Plan(dp=16, zero=3, micro_batch=1, grad_accum=1)
    g = _gather(2.0 * 1e6, 16, _net_route(1, 8, 2))
    z = zero.zero3_time(C2, p, (_unit(),), F, 2.0)
    # forward gather, backward gather and the reduce-scatter, none hidden (no compute)
    assert z.gather == pytest.approx(2 * g, rel=1e-9) and z.sync == pytest.approx(g, rel=1e-9)
    # a recomputed unit of two tensors gathers the first again in backward (reuse distance 0)
    p2 = dataclasses.replace(p, live_elements=1)
    two = zero.Unit(tensors=(1_000_000, 1_000_000), elements=2_000_000, forward=0.0, backward=0.0, recomputed=True)
    z2 = zero.zero3_time(C2, p2, (two,), F, 2.0)
    r2 = _gather(2.0 * 2e6, 16, _net_route(1, 8, 2))
    # forward 2 gathers; backward 2 + 1 regathered, sharing the exposed time with the reduce
    assert z2.gather == pytest.approx(2 * g + 3 * g, rel=1e-9) and z2.sync == pytest.approx(r2, rel=1e-9)


def test_qgz_reduces_in_two_hops_the_second_over_the_network():
    p = Plan(dp=16, zero=3, quantized_gradients=True, micro_batch=1, grad_accum=1)
    psi, q = 1e6, zero.QGZ_BYTES
    intra = comm.route(C2, 8, 0, 8, 1)
    inter = comm.Route(busbw=IB.busbw_gbps * 1e9, efficiency=comm.class_efficiency(IB), per_node=1, nodes=2,
                       intra_step=0.0, inter_step=IB.latency_us * 1e-6, base=comm.class_base(IB), network=True)
    want = _gather(psi * q, 8, intra) + _gather(psi / 8 * q, 2, inter)
    assert zero.zero3_time(C2, p, (_unit(),), F, 2.0).sync == pytest.approx(want, rel=1e-9)


def test_mics_replicas_all_reduce_across_nodes_once_per_step():
    p = Plan(dp=16, zero=3, mics_shard=8, micro_batch=1, grad_accum=2)
    psi, e = 1e6, 2.0
    inner = _gather(psi * e, 8, comm.route(C2, 8, 0, 8, 1))                # reduce-scatter in the shard
    r = _net_route(8, 1, 2)                                                 # 8 replica pairs share a node's NIC
    bw = r.busbw * r.efficiency * 0.8 * 0.5
    across = psi * e / 8 * 2.0 * 1 / 2 / bw + r.base + 2.0 * (0 + 2 * 1 * r.inter_step)
    z = zero.zero3_time(C2, p, (_unit(),), F, e)
    assert z.sync == pytest.approx(2 * inner + across, rel=1e-9)


def test_zero3_on_one_rank_exposes_nothing():
    z = zero.zero3_time(parse_cluster("1xH100"), Plan(dp=1, zero=3, micro_batch=1, grad_accum=1), (_unit(),), F, 2.0)
    assert (z.gather, z.sync) == (0.0, 0.0)


# --- runtime.py: each refusal's exact words ------------------------------------------------------

def _one(rt, **plan):
    out = problems(get_runtime(rt), Plan(micro_batch=1, grad_accum=1, **plan))
    assert len(out) == 1, out
    return out[0]


def test_runtime_refusals_name_the_field_rule_and_fix():
    p = _one("deepspeed", dp=8, precision="fp8")
    assert (p.field, p.code, p.message, p.fix, p.detail) == (
        "--runtime", "runtime-precision", "runtime deepspeed does not offer fp8",
        "use bf16, or --runtime megatron-core / fsdp", "no Transformer Engine")
    p = _one("megatron-core", dp=8, zero=2)
    assert (p.field, p.code, p.message, p.fix) == ("--zero", "runtime-zero", "runtime megatron-core has no ZeRO-2",
                                                   "choose another --zero")
    mc = get_runtime("megatron-core")
    assert p.detail == "offers " + ", ".join(f"{z} ({mc.zero_names[str(z)]})" for z in (0, 1, 3))
    zero1, pp = problems(get_runtime("fsdp"), Plan(dp=4, pp=2, zero=1, micro_batch=1, grad_accum=1))
    assert zero1.detail == "offers 2 (SHARD_GRAD_OP), 3 (FULL_SHARD)"
    assert (pp.field, pp.code, pp.message, pp.fix) == ("--pp", "runtime-pp", "runtime fsdp has no pipeline parallelism",
                                                       "use pp=1 or another --runtime")


def test_a_runtime_without_a_precision_lists_the_ones_it_has():
    rt = dataclasses.replace(get_runtime("fsdp"), precisions=("bf16", "fp32"))
    out = problems(rt, Plan(dp=8, zero=3, precision="fp16", micro_batch=1, grad_accum=1))
    assert [(p.field, p.code, p.message, p.fix) for p in out] == [
        ("--runtime", "runtime-precision", "runtime fsdp does not offer fp16", "use one of bf16, fp32")]


def test_runtime_without_tp_interleaving_or_zero_variants_says_which():
    mc = get_runtime("megatron-core")
    flat = dataclasses.replace(mc, tensor_parallel=False, interleaved=False)
    out = problems(flat, Plan(dp=2, tp=2, pp=2, schedule="interleaved", interleave=2, micro_batch=1, grad_accum=4))
    assert [(p.field, p.code, p.message, p.fix) for p in out] == [
        ("--tp", "runtime-tp", "runtime megatron-core has no tensor parallelism", "use tp=1 or another --runtime"),
        ("--interleave", "runtime-interleaved", "runtime megatron-core has no interleaved schedule",
         "use 1f1b or --runtime megatron-core")]
    hpz = Plan(dp=4, zero=3, hpz=2, quantized_weights=True, micro_batch=1, grad_accum=1)
    assert len(hpz.variants) == 2
    (p,) = problems(get_runtime("fsdp"), hpz)
    assert (p.field, p.code, p.message, p.fix, p.detail) == (
        "--runtime", "runtime-variants", "runtime fsdp has none of DeepSpeed's ZeRO variants",
        "drop them or use --runtime deepspeed", ", ".join(hpz.variants))


# --- the output layer and its loss at TP 2, micro-batch 2 ----------------------------------------

def test_output_layer_times_its_three_shapes_per_tp_rank():
    m = preset("glm-4-9b")
    s, b, t = 2048, 2, 2
    T, h, n = s * b, 4096, m.padded_vocab(t) / t
    three = (compute.shape_time(H100, T, n, h, "bf16") + compute.shape_time(H100, T, h, n, "bf16")
             + compute.shape_time(H100, h, n, T, "bf16"))
    assert compute.logits_times(m, H100, s, b, t, "bf16", 1.5) == pytest.approx(three * 1.5, rel=EXACT)


def test_fused_cross_entropy_keeps_logits_and_lse_instead_of_the_fp32_softmax():
    from planner.cost import memory
    m = preset("glm-4-9b")
    s, b, t, e = 2048, 2, 2, 2.0
    v = m.padded_vocab(t) / t
    kw = dict(sequence_parallel=False, act_bytes=e)
    fused = memory.head_bytes(m, s, b, t, fused_ce=True, **kw)
    plain = memory.head_bytes(m, s, b, t, **kw)
    assert fused - plain == pytest.approx(e * b * s * v + 4 * b * s - 4 * b * s * v, rel=EXACT)


def test_linear_attention_feature_map_reads_and_writes_q_and_k():
    m = dataclasses.replace(preset("glm-4-9b"), attention_kind="linear")
    s, b, t, e = 2048, 2, 2, 2.0
    lin = compute.block_elementwise_bytes(m, s, b, t, e, False, "linear")
    flash = compute.block_elementwise_bytes(m, s, b, t, e, False, "flash")
    assert lin - flash == pytest.approx(s * b * e * (4096 + 256) * 2 / t, rel=EXACT)


def test_a_pcie_bound_group_across_nodes_is_not_slowed_by_the_network_efficiency():
    """L40S: 20 GB/s PCIe inside the node, 40 GB/s of network per node: a DP group over two
    nodes is bound by PCIe, so the runtime's network_efficiency does not apply."""
    c = parse_cluster("2x8xL40S")
    r = comm.route(c, 16, 1, 8, 2)
    assert r.busbw == 20e9 and not r.network
    assert comm.route_allreduce(1e9, 16, r, 1.0, 1.0, 0.5) == comm.route_allreduce(1e9, 16, r, 1.0, 1.0, 1.0)


# --- compute.py: the block's compute on each path -----------------------------------------------

PRUNED = dataclasses.replace(preset("glm-4-9b"), ffn_sparsity=0.5, sparse_gemm_efficiency=0.6)


def test_pruned_ffn_gemms_divide_by_the_sparse_efficiency_on_both_paths():
    s, b, t = 2048, 2, 2
    shapes = compute.weight_shapes(PRUNED, t)
    per = compute.weight_gemm_times(PRUNED, H100, s, b, t, "bf16")
    for (k, n), (f_, b_), e in zip(shapes, per, (1.0, 1.0, 0.6, 0.6)):
        lf, lb = compute.linear_times(H100, s * b, k, n, "bf16")
        assert (f_, b_) == (pytest.approx(lf / e, rel=EXACT), pytest.approx(lb / e, rel=EXACT))
    a100 = parse_cluster("8xA100-80GB").device                          # fp32: no tile model
    assert not compute.shaped(a100, "fp32") and compute.shaped(a100, "bf16")
    gemms, _ = compute.block_gemms(PRUNED, s, b, t)
    per = compute.weight_gemm_times(PRUNED, a100, s, b, t, "fp32")
    for g, (f_, b_), e in zip(gemms, per, (1.0, 1.0, 0.6, 0.6)):
        one = compute.gemm_time(a100, g, "fp32", 1.0)
        assert (f_, b_) == (pytest.approx(one / e, rel=EXACT), pytest.approx(2 * one / e, rel=EXACT))


def test_attention_core_without_a_flash_curve_is_two_batched_gemms_and_flash_recomputes_qk():
    """V100 has no flash-attention curve: the core is timed from its batched GEMMs; backward is
    two GEMMs per forward GEMM, and flash recomputes Q K^T on top."""
    v100 = parse_cluster("8xV100").device
    m, s, b, t = preset("glm-4-9b"), 2048, 2, 2
    qk, pv = compute.core_gemm_times(m, v100, s, b, t, "fp16")
    kw = dict(compute_scale=1.0, attention_scale=1.5)
    fl = compute.block_compute_times(m, v100, s, b, t, "fp16", kernel="flash", **kw)
    eg = compute.block_compute_times(m, v100, s, b, t, "fp16", kernel="eager", **kw)
    assert fl.core_fwd == pytest.approx((qk + pv) * 1.5, rel=EXACT) == eg.core_fwd
    assert fl.core_bwd == pytest.approx((2 * (qk + pv) + qk) * 1.5, rel=EXACT)
    assert eg.core_bwd == pytest.approx(2 * (qk + pv) * 1.5, rel=EXACT)


def test_linear_attention_core_and_its_recompute_on_both_paths():
    m = dataclasses.replace(preset("glm-4-9b"), attention_kind="linear")
    s, b, t = 2048, 2, 2
    _, core = compute.block_gemms(m, s, b, t)
    rec_flops = compute.flash_recompute_flops(m, s, b, t)
    for dev, prec in ((H100, "bf16"), (parse_cluster("8xA100-80GB").device, "fp32")):
        cf = compute.core_time(m, dev, core, s, prec, 1.5)
        rec = compute.core_time(m, dev, rec_flops, s, prec, 1.5)
        assert rec > 0
        got = compute.block_compute_times(m, dev, s, b, t, prec, compute_scale=1.0, attention_scale=1.5,
                                          kernel="linear")
        assert got.core_fwd == pytest.approx(cf, rel=EXACT) and got.core_bwd == pytest.approx(2 * cf + rec, rel=EXACT)
    a100 = parse_cluster("8xA100-80GB").device
    eager = compute.block_compute_times(m, a100, s, b, t, "fp32", compute_scale=1.0, attention_scale=1.5, kernel="eager")
    cf = compute.core_time(m, a100, core, s, "fp32", 1.5)
    assert eager.core_bwd == pytest.approx(2 * cf, rel=EXACT)


# --- runtime.py: data files and the factors a runtime keeps from the device --------------------

def test_a_runtime_keeps_the_devices_memory_allowances():
    from planner.cost.runtime import runtime_factors
    rt = dataclasses.replace(get_runtime("megatron-core"), factors={"compute_scale": 1.1}, by_device={})
    out = runtime_factors(rt, "H100-SXM", {"memory_overhead_gb": 3.0, "memory_fragmentation": 0.2,
                                           "compute_scale": 9.0, "dp_overlap": 0.1},
                          {"memory_overhead_gb": 1.0, "memory_fragmentation": 0.1, "compute_scale": 1.0,
                           "dp_overlap": 0.7})
    assert out == {"memory_overhead_gb": 3.0, "memory_fragmentation": 0.2, "compute_scale": 1.1, "dp_overlap": 0.7}


def test_a_runtime_file_missing_fields_names_them(tmp_path):
    from planner.cost.runtime import _load
    from planner.errors import SpecError
    path = tmp_path / "mine.json"
    path.write_text('{"name": "mine", "executable": false, "zero_stages": [0], "pipeline": true, '
                    '"tensor_parallel": true, "interleaved": false, "attention": "plan", "tp_comm_overlap": false, '
                    '"p2p_overlap": false}')
    with pytest.raises(SpecError) as err:
        _load(path)
    assert str(err.value) == ("runtime mine.json: missing field(s) ['flat_parameters', 'device_factors'] "
                              "(fix: fix the runtime data file)")


REQUIRED = ('"executable": false, "zero_stages": [0, 1], "pipeline": true, "tensor_parallel": true, '
            '"interleaved": false, "attention": "plan", "tp_comm_overlap": false, "p2p_overlap": false, '
            '"flat_parameters": false, "device_factors": false')


def test_a_minimal_runtime_file_takes_the_stated_defaults(tmp_path):
    from planner.cost.runtime import _load
    path = tmp_path / "mine.json"
    path.write_text('{"name": "mine", ' + REQUIRED + '}')
    rt = _load(path)
    assert (rt.zero_names, rt.precisions, rt.attention_kernels, rt.causal_attention, rt.fused_cross_entropy,
            rt.factors, rt.by_device, rt.sources, rt.path) == (
        {}, ("bf16", "fp16", "fp32"), ("fa2",), True, False, {}, {}, {}, str(path))
    assert rt.zero_label(1) == "ZeRO-1"


def test_a_runtime_file_is_read_field_by_field(tmp_path):
    from planner.cost.runtime import _load
    path = tmp_path / "full.json"
    path.write_text('{"name": "full", ' + REQUIRED + ', "zero_names": {"1": "sharded optimizer"}, '
                    '"precisions": ["bf16", "fp8"], "attention_kernels": ["fa3", "cudnn"], '
                    '"causal_attention": false, "fused_cross_entropy": true, "factors": {"compute_scale": 2}, '
                    '"by_device": {"H100-SXM": {"compute_scale": 3}}, "sources": {"compute_scale": "measured"}}')
    rt = _load(path)
    assert (rt.name, rt.zero_stages, rt.zero_names, rt.precisions, rt.attention_kernels) == (
        "full", (0, 1), {"1": "sharded optimizer"}, ("bf16", "fp8"), ("fa3", "cudnn"))
    assert (rt.causal_attention, rt.fused_cross_entropy, rt.factors, rt.by_device, rt.sources) == (
        False, True, {"compute_scale": 2.0}, {"H100-SXM": {"compute_scale": 3.0}}, {"compute_scale": "measured"})
    assert isinstance(rt.factors["compute_scale"], float) and isinstance(rt.by_device["H100-SXM"]["compute_scale"], float)
    assert (rt.executable, rt.pipeline, rt.interleaved, rt.attention) == (False, True, False, "plan")
    assert rt.zero_label(1) == "sharded optimizer"


# --- the cached layout helpers (mutated with benchmarks/mutation.py --uncache) -----------------

def test_group_shape_per_stage_by_hand():
    # 4 GPUs per node, PP 2 x DP 3: stage 0 is ranks 0-2 (node 0), stage 1 ranks 3-5 (nodes 0, 1, 1)
    assert comm.group_shape(4, 3, 1, 2, "dp") == ((3, 1), (2, 2))
    # DP 2 x TP 8 on 8-GPU nodes: each DP group is one rank on each of two nodes
    assert comm.group_shape(8, 2, 8, 1, "dp") == ((1, 2),)


def test_mics_replica_groups_across_nodes_by_hand():
    """DP 8 x TP 2 on two 8-GPU nodes, replica groups of 2 DP ranks 4 apart: DP j and j + 4 are
    global ranks 2 j + t and 2 j + 8 + t, one on each node; all 8 groups cross, 8 per node."""
    from planner.cost.zero import _strided
    assert _strided(8, 2, 8, 2, 4) == (8, 1, 2)
    assert _strided(8, 1, 16, 2, 4) == (0, 2, 1)                    # 16 DP ranks: pairs inside a node
    # DP 8 x TP 4 (2 DP ranks per node), groups of 2 DP ranks 2 apart in 2 blocks of 4: DP
    # (0, 2), (1, 3), (4, 6), (5, 7), each on nodes (0, 1) or (2, 3): 2 groups x 4 TP per node
    assert _strided(8, 4, 8, 2, 2) == (8, 1, 2)


def test_a_biased_moe_block_holds_the_shared_experts_biases():
    """Tiny GLM-4.5-Air with linear biases at TP 2: the attention part of the dense block (its
    last four tensors are the FFN's two weights and two biases), the h x E router, one shared
    expert's weights h k s / t and s h / t and its biases k s / t and h."""
    from planner.cost import params
    air = dataclasses.replace(scale(preset("glm-4.5-air"), "tiny"), linear_bias=True)   # h 128, E 4, s 48, k 2
    dense = params.block_tensors(air, 2).numels
    assert params.moe_block_tensors(air, 2).numels == dense[:-4] + (128 * 4, 128 * 2 * 48 // 2, 48 * 128 // 2,
                                                                     2 * 48 // 2, 128)


def test_at_a_bandwidth_tie_the_intra_node_link_is_the_bottleneck():
    """L40S: 40 GB/s of network per node shared by 2 crossing groups = the 20 GB/s PCIe link;
    the route counts PCIe as the bottleneck, so the runtime's network efficiency does not apply."""
    r = comm.route(parse_cluster("2x8xL40S"), 16, 2, 8, 2)
    assert r.busbw == 20e9 and not r.network
