"""The measured kernel curves (planner/serve/measured.py, profiles/serving/vidur.json) in the
serving cost model, pinned to the file's numbers by hand."""
from __future__ import annotations

import math

import pytest

from planner.serve import cost, measured
from planner.serve.factors import GPU_STEP_OVERHEAD_S, serve_factor, serve_factors
from planner.serve.memory import kv_bytes_per_token, linear_weights, weight_read_bytes
from planner.serve.terms import causal_core_flops, decode_terms, _gemm_s, _prefill_attention_s, prefill_terms
from planner.serve.spec import Deployment
from planner.specs import parse_cluster, preset

A100 = parse_cluster("1xA100")
REF = 2 * 4096 * (3 * 4096 + 4096 + 3 * 11008)   # Llama-2-7B's linear weights of one layer, bf16 bytes: 404,750,336


def test_file_holds_vidur_medians_with_their_source():
    data = measured._data()
    assert "microsoft/vidur at commit" in data["source"] and data["model"]["linear_weights_per_layer"] * 2 == REF
    c = measured.curve(A100.device, 1)
    assert c["tokens"][:5] == [1, 2, 4, 8, 16] and c["linear_ms"][:5] == [0.266, 0.258, 0.259, 0.26, 0.263]
    assert measured.curve(parse_cluster("1xA100-40GB").device, 1) is None      # not measured: the analytic model
    assert measured.curve(A100.device, 3) is None


def test_bandwidth_share_is_the_measured_memory_bound_read():
    # median of 0.266, 0.258, 0.259, 0.260, 0.263 ms = 0.260 ms for 404,750,336 B at 2,039 GB/s
    assert measured.bandwidth_share(A100.device) == pytest.approx(REF / 0.26e-3 / 2039e9)
    assert serve_factor(A100, "decode_bw_efficiency") == pytest.approx(0.7635, abs=1e-4)
    assert serve_factor(parse_cluster("1xL40S"), "decode_bw_efficiency") == 0.8     # assumed where unmeasured


def test_linear_time_interpolates_and_scales_with_bytes():
    c = measured.curve(A100.device, 1)
    assert measured.linear_s(c, 16, REF) == pytest.approx(0.263e-3)
    assert measured.linear_s(c, 16, REF / 2) == pytest.approx(0.263e-3 / 2)           # half the weights
    # 3 tokens: log-log between 2 (0.258) and 4 (0.259), log2(3/2) = 0.585 of the way
    w = math.log(1.5) / math.log(2)
    assert measured.linear_s(c, 3, REF) == pytest.approx(math.exp(math.log(0.258) + w * math.log(0.259 / 0.258)) * 1e-3)
    assert measured.linear_s(c, 8192, REF) == pytest.approx(2 * 7.3985e-3)            # above 4096: in proportion
    assert measured.other_ops_s(c, 4096, 2048) == pytest.approx(0.676e-3 / 2)          # x hidden / 4096


def test_step_uses_the_measured_layers_on_a_measured_gpu():
    m = preset("chatglm3-6b")
    c = measured.curve(A100.device, 1)
    lin = 2.0 * linear_weights(m)
    t = decode_terms(m, A100, Deployment(), 1, 600)
    assert t["fixed_s"] == pytest.approx(m.layers * (measured.linear_s(c, 1, lin) + measured.other_ops_s(c, 1, 4096)))
    # the linear weights' read is inside their measured time: memory holds the rest and the cache
    rest = weight_read_bytes(m, Deployment()) - m.layers * linear_weights(m) * 2.0
    assert t["memory_s"] == pytest.approx((rest + 600 * kv_bytes_per_token(m, Deployment())) / 2039e9)
    analytic = decode_terms(m, A100, Deployment(), 1, 600, curves=False)
    assert analytic["fixed_s"] == 0.0 and analytic["memory_s"] > t["memory_s"]
    step = cost.decode_step_time_s(m, A100, Deployment(), 1, 600)
    f = serve_factors(A100)
    # the measured layers, the roofline max, and the 160 us gap between steps (GPU_STEP_OVERHEAD_S)
    assert f["serve_step_overhead_s"] == 160e-6
    assert step == pytest.approx(t["fixed_s"] + max(t["compute_s"], t["memory_s"] / f["decode_bw_efficiency"]) + 160e-6)


def test_quantized_weights_scale_the_measured_time_by_their_roofline():
    m = preset("chatglm3-6b")
    bf = decode_terms(m, A100, Deployment(), 1, 600)["fixed_s"]
    q = decode_terms(m, A100, Deployment(weight_precision="int4"), 1, 600)["fixed_s"]
    ops = m.layers * measured.other_ops_s(measured.curve(A100.device, 1), 1, 4096)
    # batch 1 is memory-bound: the int4 layers take their bytes' share of the bf16 time
    assert (q - ops) / (bf - ops) == pytest.approx((0.5 + 4 / 128) / 2.0, rel=1e-3)
    # a 4096-token prefill is compute-bound: int4 is no faster, and Marlin's measured 0.61 of the
    # bf16 speed there (vLLM PR #2497, A100) makes its linear layers take 1 / 0.61 of bf16's
    big_bf = prefill_terms(m, A100, Deployment(), 4096)["fixed_s"]
    big_q = prefill_terms(m, A100, Deployment(weight_precision="int4"), 4096)["fixed_s"]
    ops4k = m.layers * measured.other_ops_s(measured.curve(A100.device, 1), 4096, 4096)
    assert (big_q - ops4k) / (big_bf - ops4k) == pytest.approx(1 / 0.61, rel=0.02)


def test_tp_all_reduce_is_vidurs_measured_nccl_time():
    c = measured._data()["devices"]["A100-80GB"]["all_reduce"]["2"]
    assert "all_reduce.csv" in measured._data()["all_reduce_source"]
    assert c["elements"][:3] == [4096, 8192, 16384] and all(b >= a for a, b in zip(c["ms"], c["ms"][1:]))
    assert measured.allreduce_s(A100.device, 2, 8192) == pytest.approx(c["ms"][1] * 1e-3)
    # log-log between two measured sizes, in proportion above the largest
    mid = math.exp(0.5 * (math.log(c["ms"][1]) + math.log(c["ms"][2]))) * 1e-3
    assert measured.allreduce_s(A100.device, 2, math.sqrt(8192 * 16384)) == pytest.approx(mid)
    assert measured.allreduce_s(A100.device, 2, 2 * c["elements"][-1]) == pytest.approx(2e-3 * c["ms"][-1])
    assert measured.allreduce_s(parse_cluster("2xL40S").device, 2, 8192) is None
    assert measured.allreduce_s(A100.device, 3, 8192) is None
    # a TP 2 step of 2 tokens: 2 all-reduces of 2 x 4096 elements per layer, plus the logits all-gather on the link
    from planner.cost.comm import allgather_time
    m, two = preset("chatglm3-6b"), parse_cluster("2xA100")
    link = two.intra_node
    gather = allgather_time(2 * m.padded_vocab(2) * 2.0, 2, link.busbw_gbps * 1e9, link.latency_us * 1e-6, 1.0)
    t = decode_terms(m, two, Deployment(tp=2), 2, 4)
    assert t["comm_s"] == pytest.approx(2 * m.layers * measured.allreduce_s(two.device, 2, 2 * m.hidden) + gather)


def test_prefill_attention_runs_at_the_flash_kernels_published_throughput():
    m = preset("chatglm3-6b")
    h100, a100 = parse_cluster("1xH100"), A100
    flops = causal_core_flops(m, 2048, 0, 1)
    # H100: FlashAttention-3's forward, causal, head dim 128, at sequence 2048 (the profile's curve)
    fa3 = h100.device.kernels.attention_tflops("fa3", "fwd", 128, 2048, True)
    assert fa3 and _prefill_attention_s(m, h100, Deployment(), 2048, 0) == pytest.approx(flops / (fa3 * 1e12))
    # a later chunk: its queries against the cached context, at the whole sequence's throughput
    fa3_4k = h100.device.kernels.attention_tflops("fa3", "fwd", 128, 4096, True)
    assert _prefill_attention_s(m, h100, Deployment(), 2048, 2048) == pytest.approx(
        causal_core_flops(m, 2048, 2048, 1) / (fa3_4k * 1e12))
    # A100: FA2 (its forward+backward curve stands for the forward)
    fa2 = a100.device.kernels.attention_tflops("fa2", "fwd_bwd", 128, 2048, True)
    assert _prefill_attention_s(m, a100, Deployment(), 2048, 0) == pytest.approx(flops / (fa2 * 1e12))
    # no curves (the CPU): one head's QK^T at the GEMM efficiency
    cpu = parse_cluster("1xcpu")
    assert _prefill_attention_s(m, cpu, Deployment(), 64, 0) == pytest.approx(
        _gemm_s(cpu, Deployment(), causal_core_flops(m, 64, 0, 1), 2.0 * 64 * 64 * 128))
