"""The serving cost model (planner/serve/cost.py) pinned to values computed by hand.

A toy device with round numbers: GEMMs at a flat 50% of 100 TFLOP/s (5e13 FLOP/s), memory at
1000 GB/s (1e12 B/s), an intra-node link of 100 GB/s with 10 us per step. A toy model: h 64,
2 layers, 4 heads of 16 with 2 KV heads (q 64, kv 32), a 2-matrix FFN of 128, vocabulary 100,
no biases, RMSNorm, untied output. Per block: linear weights 64*128 + 64*64 + 64*128 + 128*64
= 28,672; params 2 x (28,672 + 2 x 64) + 100 x 64 + (64 + 100 x 64) = 70,464.
"""
from __future__ import annotations

import dataclasses
import math

import pytest

from planner.errors import SpecError
from planner.serve import cost
from planner.serve.factors import GPU_STEP_OVERHEAD_S, combine, serve_factor
from planner.serve.memory import (kv_bytes_per_token, kv_bytes_per_token_rank, linear_weights, serve_memory, weight_bytes,
                                  weight_read_bytes)
from planner.serve.terms import decode_terms, prefill_terms, _serial
from planner.serve.estimate import estimate_serving
from planner.serve.spec import Deployment, Workload
from planner.specs.hardware import DeviceProfile, Link
from planner.specs.cluster import ClusterSpec
from planner.specs.model import ModelSpec

NEUTRAL = {"prefill_compute_scale": 1.0, "decode_bw_efficiency": 1.0, "serve_comm_scale": 1.0,
           "serve_step_overhead_s": 0.0, "memory_overhead_gb": 0.0}
DEVICE = DeviceProfile(
    name="toy", kind="gpu", memory_gb=10, peak_tflops={"bf16": 100, "fp16": 100, "fp32": 10},
    hbm_bandwidth_gbps=1000, gemm_efficiency=((1.0, 0.5), (1e30, 0.5)), gpus_per_node=8,
    intra_node=Link(name="nvlink", busbw_gbps=100, latency_us=10), inter_node=Link(name="ib", busbw_gbps=10, latency_us=0),
    factors=NEUTRAL)
MODEL = ModelSpec(name="toy", hidden=64, layers=2, heads=4, kv_groups=2, ffn_hidden=128, activation="gelu", vocab=100,
                  max_seq=512, norm="rmsnorm", position="rotary", qkv_bias=False, linear_bias=False)


def cluster(n: int = 1, device: DeviceProfile = DEVICE) -> ClusterSpec:
    return ClusterSpec(nodes=1, gpus_per_node=n, device=device, intra_node=device.intra_node,
                       inter_node=device.inter_node)


def test_sizes():
    assert MODEL.params == 70_464
    assert linear_weights(MODEL) == 28_672
    assert weight_bytes(MODEL, Deployment()) == 70_464 * 2
    # int8: 57,344 block weights at 1 + 2/128 bytes (group-128 fp16 scales), the rest bf16
    assert weight_bytes(MODEL, Deployment(weight_precision="int8")) == pytest.approx(57_344 * 1.015625 + 13_120 * 2)
    assert weight_bytes(MODEL, Deployment(weight_precision="int4")) == pytest.approx(57_344 * 0.53125 + 13_120 * 2)
    # one forward reads everything but the input embedding table (100 x 64)
    assert weight_read_bytes(MODEL, Deployment()) == 140_928 - 12_800
    # 2 (K, V) x 2 layers x 2 KV heads x 16 x 2 bytes; fp8 halves it; TP 4 > 2 KV heads keeps one per rank
    assert kv_bytes_per_token(MODEL, Deployment()) == 256
    assert kv_bytes_per_token(MODEL, Deployment(kv_precision="fp8")) == 128
    assert kv_bytes_per_token_rank(MODEL, Deployment(tp=2)) == 128
    assert kv_bytes_per_token_rank(MODEL, Deployment(tp=4)) == 128


def test_decode_memory_bound():
    t = decode_terms(MODEL, cluster(), Deployment(), 1, 100)
    # weights 128,128 B + KV 100 tokens x 256 B, at 1e12 B/s
    assert t["memory_s"] == pytest.approx((128_128 + 25_600) / 1e12)
    # 2 layers x (2 x 28,672 GEMM + 4 x 100 x 64 attention) + 2 x 64 x 100 logits, at 5e13
    assert t["compute_s"] == pytest.approx((2 * (57_344 + 25_600) + 12_800) / 5e13)
    assert t["comm_s"] == 0.0
    assert cost.decode_step_time_s(MODEL, cluster(), Deployment(), 1, 100) == pytest.approx(153_728e-12)
    slow = dataclasses.replace(DEVICE, factors={**NEUTRAL, "decode_bw_efficiency": 0.5, "serve_step_overhead_s": 1e-3})
    assert cost.decode_step_time_s(MODEL, cluster(device=slow), Deployment(), 1, 100) == pytest.approx(
        2 * 153_728e-12 + 1e-3)


def test_cpu_adds_memory_and_compute():
    # a CPU 'device' streams the weights and runs the FMAs on the same cores: no overlap, the
    # step is memory + compute (_serial), where the GPU roofline takes their max
    cpu = dataclasses.replace(DEVICE, kind="cpu")
    t = decode_terms(MODEL, cluster(device=cpu), Deployment(), 1, 100)
    assert t["serial"] == 1.0 and decode_terms(MODEL, cluster(), Deployment(), 1, 100)["serial"] == 0.0
    # memory 153,728 B at 1e12 B/s + compute (2 x (57,344 + 25,600) + 12,800) = 178,688 FLOPs at 5e13
    assert cost.decode_step_time_s(MODEL, cluster(device=cpu), Deployment(), 1, 100) == pytest.approx(
        153_728e-12 + 178_688 / 5e13)
    # prefill of 100 tokens: its compute (as below) + the 128,128 B weight read
    flops = 2 * (2 * 100 * 28_672 + 4 * 5050 * 64) + 2 * 64 * 100  # causal: 5,050 pairs
    assert cost.prefill_time_s(MODEL, cluster(device=cpu), Deployment(), 100) == pytest.approx(
        flops / 5e13 + 128_128 / 1e12)
    # step_fns (the simulation's memoised path) agrees with the direct one
    pre, dec = cost.step_fns(MODEL, cluster(device=cpu), Deployment())
    assert dec(1, 100) == pytest.approx(153_728e-12 + 178_688 / 5e13)
    assert pre(100, 0) == pytest.approx(flops / 5e13 + 128_128 / 1e12)


def test_decode_compute_floor_at_large_batch():
    # batch 4096 with 1 token each: GEMMs 2 x 4096 x 28,672 per layer dwarf the weight read
    t = decode_terms(MODEL, cluster(), Deployment(), 4096, 4096)
    flops = 2 * (2 * 4096 * 28_672 + 4 * 4096 * 64) + 2 * 4096 * 64 * 100
    assert t["compute_s"] == pytest.approx(flops / 5e13)
    assert cost.decode_step_time_s(MODEL, cluster(), Deployment(), 4096, 4096) == pytest.approx(flops / 5e13)


def test_prefill_compute_bound_and_chunks():
    t = prefill_terms(MODEL, cluster(), Deployment(), 100)
    # causal attention: 100 x 101 / 2 = 5,050 (query, key) pairs kept of the 100 x 100 square
    flops = 2 * (2 * 100 * 28_672 + 4 * 5050 * 64) + 2 * 64 * 100   # logits of the last token only
    assert t["compute_s"] == pytest.approx(flops / 5e13)
    assert t["memory_s"] == pytest.approx(128_128 / 1e12)                  # the weight-read floor
    assert cost.prefill_time_s(MODEL, cluster(), Deployment(), 100) == pytest.approx(flops / 5e13)
    # a chunk of 50 after 50 cached tokens attends to the 50 cached keys and, causally, its own
    # 50 x 51 / 2 pairs [SARATHI]: 2,500 + 1,275 = 3,775 pairs; it reads the 50 cached tokens' KV
    t2 = prefill_terms(MODEL, cluster(), Deployment(), 50, 50)
    assert t2["compute_s"] == pytest.approx((2 * (2 * 50 * 28_672 + 4 * 3775 * 64) + 12_800) / 5e13)
    assert t2["memory_s"] == pytest.approx((128_128 + 50 * 256) / 1e12)
    whole = cost.prompt_time_s(MODEL, cluster(), Deployment(prefill_chunk=50), 100)
    first = cost.prefill_time_s(MODEL, cluster(), Deployment(), 50, 0)
    assert whole == pytest.approx(first + cost.prefill_time_s(MODEL, cluster(), Deployment(), 50, 50))


def test_tp_all_reduces():
    # TP 2, batch 4: per layer two all-reduces of 4 x 64 x 2 B = 512 B (ring bytes 512 x 2 x 1/2 at
    # 1e11 B/s + 2 latency steps of 10 us), then the logits all-gather of 4 x 100 x 2 B = 800 B
    # (800 x 1/2 / 1e11 + 1 step)
    t = decode_terms(MODEL, cluster(2), Deployment(tp=2), 4, 4)
    ar = 512 / 1e11 + 2e-5
    ag = 400 / 1e11 + 1e-5
    assert t["comm_s"] == pytest.approx(2 * 2 * ar + ag)
    # memory halves: weights / 2 and 4 tokens x 128 B per rank
    assert t["memory_s"] == pytest.approx((128_128 / 2 + 4 * 128) / 1e12)


def test_memory_and_kv_capacity():
    # a device whose driver reports 1.024 MiB (memory_total_mib; = 0.001 GiB, 1,073,741.824 B; its
    # marketed memory_gb 0.001 = 1,000,000 B is not what the engine fills): 0.9 of it usable - weights 140,928 - activations of the
    # profiling step of max_num_batched_tokens = 150 tokens (150 x (2 x 64 + 2 x 128) x 2 B + 64 x 100
    # fp32 logits) = 966,367.64 - 140,928 - 115,200 - 25,600 = 684,639.64 B -> 167 blocks of 16 x 256 B
    tiny = dataclasses.replace(DEVICE, memory_gb=0.001, memory_total_mib=1.024)
    dep = Deployment(max_batch=64, prefill_chunk=150)
    mem = serve_memory(MODEL, cluster(device=tiny), dep, Workload(prompt_len=100, output_len=50))
    assert mem["capacity"] == pytest.approx(0.9 * 0.001)                   # GiB
    # one capacity for training and serving: DeviceProfile.memory_bytes (training's peak check)
    assert mem["capacity"] * 2**30 == pytest.approx(0.9 * cluster(device=tiny).memory_bytes)
    # without the driver's total, memory_gb x 1e9 (as training): 0.9 x 1,000,000 B, not 0.9 x 2^30 x 0.001
    marketed = serve_memory(MODEL, cluster(device=dataclasses.replace(DEVICE, memory_gb=0.001)), dep,
                            Workload(prompt_len=100, output_len=50))
    assert marketed["capacity"] == pytest.approx(0.9 * 1e6 / 2**30)
    assert mem["weights"] == pytest.approx(140_928 / 2**30)
    assert mem["activations"] == pytest.approx((115_200 + 25_600) / 2**30)
    assert mem["kv_blocks"] == 167
    assert mem["kv_capacity_tokens"] == 167 * 16
    assert mem["blocks_per_sequence"] == 10                                # ceil(150 / 16)
    assert mem["batch_limit"] == 16                                        # 167 // 10 < max_batch 64
    assert mem["fits"]
    # a log-normal spread does not reserve the tail for every sequence: the batch limit counts mean
    # lengths (100 e^0.125 + 50 e^0.125 = 170 tokens, 11 blocks), the longest request only has to fit
    spread = serve_memory(MODEL, cluster(device=tiny), dep,
                               Workload(prompt_len=100, output_len=50, prompt_sigma=0.5, output_sigma=0.5))
    assert spread["batch_limit"] == 167 // 11 and spread["blocks_per_sequence"] == 44  # ceil(704 / 16): the 99.9th percentiles
    # SGLang: mem_fraction_static 0.88 x capacity holds the weights and the KV pool
    sg = serve_memory(MODEL, cluster(device=tiny), Deployment(max_batch=64, engine="sglang"),
                           Workload(prompt_len=100, output_len=50))
    assert sg["kv_blocks"] == int((0.88 * 0.001 * 2**30 - 140_928) // 4096)
    small = dataclasses.replace(DEVICE, memory_gb=0.0003)
    assert not serve_memory(MODEL, cluster(device=small), Deployment(), Workload(prompt_len=100, output_len=50))["fits"]


def test_infeasible_is_a_value_and_bad_input_raises():
    w = Workload(prompt_len=100, output_len=50)
    est = estimate_serving(MODEL, cluster(), Deployment(kv_precision="fp8"), w)
    assert not est.feasible and "FP8" in est.reasons[0]
    est = estimate_serving(MODEL, cluster(4), Deployment(tp=3), w)
    assert not est.feasible and any("heads" in r for r in est.reasons)
    with pytest.raises(SpecError, match="context of 512"):
        estimate_serving(MODEL, cluster(), Deployment(), Workload(prompt_len=500, output_len=50))


def test_estimate_alone_latencies():
    w = Workload(prompt_len=100, output_len=50)
    est = estimate_serving(MODEL, cluster(), Deployment(max_batch=8), w, requests=40)
    assert est.feasible
    # the prefill step plus the request's way through the engine's HTTP server (4 ms, measured)
    assert est.ttft_alone_s == pytest.approx(cost.prefill_time_s(MODEL, cluster(), Deployment(), 100) + 0.004)
    assert est.tpot_alone_s == pytest.approx((128_128 + 101 * 256) / 1e12)
    assert est.max_qps > 0 and math.isfinite(est.e2e_p99_s) and est.e2e_p99_s >= est.e2e_p50_s
    js = est.to_json()
    assert js["deployment"]["max_batch"] == 8 and set(js["memory_gb"]) >= {"weights", "kv_cache", "activations", "runtime"}


@pytest.mark.parametrize("gpus,size", [("1xA100", None), ("2xcpu", "tiny"), ("2xH100", None)])
def test_memoised_step_functions_match_the_direct_ones(gpus, size):
    from planner.specs.cluster import parse_cluster
    from planner.specs.presets import preset, scale
    model, c = scale(preset("chatglm3-6b"), size), parse_cluster(gpus)
    for dep in (Deployment(max_batch=256), Deployment(tp=2, weight_precision="int4")):
        if dep.tp > c.world_size:
            continue
        pre, dec = cost.step_fns(model, c, dep)
        for b, ctx in ((1, 1), (1, 700), (8, 8 * 300), (64, 64 * 1000), (256, 512), (256, 256 * 5), (256, 256 * 4000)):
            assert dec(b, ctx) == pytest.approx(cost.decode_step_time_s(model, c, dep, b, ctx), rel=1e-9), (b, ctx)
        assert pre(100, 50) == pytest.approx(cost.prefill_time_s(model, c, dep, 100, 50), rel=1e-12)


def test_profile_fp8_flag():
    from planner.errors import ProfileError
    from planner.specs.hardware import PROFILES_DIR, find_device, profile_from_dict
    import json
    assert find_device("H100")[0].fp8 and find_device("L40S")[0].fp8
    assert not find_device("A100")[0].fp8 and not find_device("cpu")[0].fp8
    data = json.loads((PROFILES_DIR / "A100-80GB.json").read_text())
    with pytest.raises(ProfileError, match="fp8"):
        profile_from_dict({**data, "fp8": "yes"})


def test_decode_attention_parts_and_their_scale():
    """decode_terms names the parts that grow with the context (the KV read, the attention core)
    and decode_attention_scale multiplies exactly those, inside each side of the step."""
    t = decode_terms(MODEL, cluster(), Deployment(), 1, 100)
    # KV 100 tokens x 256 B at 1e12 B/s; core 2 layers x 4 x 100 x 64 FLOPs at 5e13
    assert t["attn_memory_s"] == pytest.approx(25_600 / 1e12)
    assert t["attn_compute_s"] == pytest.approx(2 * 25_600 / 5e13)
    # GPU, memory-bound: x 3 on the KV read only: (128,128 + 3 x 25,600) B at 1e12 B/s
    f = {**NEUTRAL, "decode_attention_scale": 3.0}
    assert combine(t, f, decode=True) == pytest.approx((128_128 + 3 * 25_600) / 1e12)
    assert combine(t, f) == pytest.approx(combine(t, NEUTRAL))  # a prefill's terms: untouched
    # CPU (serial): both sides: memory (128,128 + 3 x 25,600) B + compute (2 x 57,344 + 3 x 51,200 + 12,800)
    cpu = dataclasses.replace(DEVICE, kind="cpu", factors={**NEUTRAL, "decode_attention_scale": 3.0})
    assert cost.decode_step_time_s(MODEL, cluster(device=cpu), Deployment(), 1, 100) == pytest.approx(
        (128_128 + 76_800) / 1e12 + (114_688 + 153_600 + 12_800) / 5e13)
    pre, dec = cost.step_fns(MODEL, cluster(device=cpu), Deployment())
    assert dec(1, 100) == pytest.approx((128_128 + 76_800) / 1e12 + (114_688 + 153_600 + 12_800) / 5e13)
    # the memoised GPU path (memory-bound: the KV part linear in the context) agrees
    gpu = dataclasses.replace(DEVICE, factors={**NEUTRAL, "decode_attention_scale": 3.0})
    _, dec = cost.step_fns(MODEL, cluster(device=gpu), Deployment())
    assert dec(1, 100) == pytest.approx((128_128 + 76_800) / 1e12)
    # terms without attention parts (older callers): the scale changes nothing
    bare = {k: v for k, v in t.items() if not k.startswith("attn_")}
    assert combine(bare, f, decode=True) == pytest.approx(combine(bare, NEUTRAL, decode=True))


def test_linear_attention_decode_core_does_not_grow_with_context():
    """Linear attention: each new token against a d x d state, so the attention core's FLOPs and
    the state read do not depend on the context; they grow with the batch."""
    from planner.cli.common import apply_variants
    lin = apply_variants(MODEL, ["linear-attention"])
    a, b = (decode_terms(lin, cluster(), Deployment(), 4, n) for n in (40, 4000))
    assert a["attn_compute_s"] == b["attn_compute_s"] > 0 and a["attn_memory_s"] == b["attn_memory_s"] > 0
    one = decode_terms(lin, cluster(), Deployment(), 1, 10)
    assert a["attn_compute_s"] == pytest.approx(4 * one["attn_compute_s"])
    # one token (s = C = 1), per layer 2 b s d (2 C n + (n + g) d) (compute.linear_core_flops:
    # phi(q) phi(k)^T and @ v within the token, phi(q) S and the state update phi(k)^T v):
    # 2 x 16 x (2 x 4 + 6 x 16) = 3,328, for 2 layers at 5e13
    assert one["attn_compute_s"] == pytest.approx(2 * 3_328 / 5e13)


def test_decode_terms_refuse_an_empty_batch_and_slow_sparse_ffn_gemms():
    with pytest.raises(SpecError, match="batch >= 1"):
        decode_terms(MODEL, cluster(), Deployment(), 0, 10)
    with pytest.raises(SpecError, match="context_tokens >= batch"):
        decode_terms(MODEL, cluster(), Deployment(), 4, 3)
    # ffn-sparsity 0.5 with sparse GEMMs at half efficiency: the FFN's two GEMMs (2 x 64 x 64 each,
    # ffn_size 64) take twice their FLOPs' time; QKV (64 x 128) and out (64 x 64) do not
    from planner.cli.common import apply_variants
    sp = apply_variants(MODEL, ["ffn-sparsity=0.5", "sparse-gemm-efficiency=0.5"])
    t = decode_terms(sp, cluster(), Deployment(), 1, 100)
    gemm = 2 * (64 * 128 + 64 * 64) + 2 * 2 * (2 * 64 * 64)
    assert t["compute_s"] == pytest.approx((2 * (gemm + 25_600) + 12_800) / 5e13)


def test_request_and_step_overheads_by_engine_and_device():
    from planner.specs.cluster import parse_cluster
    a100, cpu = parse_cluster("1xA100"), parse_cluster("2xcpu")
    # through the engine's HTTP server: 4 ms measured (tt-inference-server #190); the CPU lab's load
    # generator hands requests over in-process
    assert cost.request_overhead_s(a100, Deployment()) == 0.004
    assert cost.request_overhead_s(a100, Deployment(engine="sglang")) == 0.004
    assert cost.request_overhead_s(cpu, Deployment(engine="executor")) == 0.0
    # the GPU gap between steps under async scheduling (160 us); a CPU's is fitted (default 0)
    assert serve_factor(a100, "serve_step_overhead_s") == GPU_STEP_OVERHEAD_S == 160e-6
    assert serve_factor(cpu, "serve_step_overhead_s") == 0.0
