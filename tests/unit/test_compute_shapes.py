"""Compute from shapes (issue 19 item 2): a block's weight GEMMs timed from their (M, N, K) with
tile and wave quantization, the attention core from the flash kernel's measured throughput
(forward and backward apart, causal or not), memory-bound work as bytes over the achievable HBM
bandwidth. Every number below is worked by hand on a toy GPU small enough to check on paper;
removing or halving a term changes it."""
from __future__ import annotations

import pytest

from planner.cost import compute
from planner.cost.factors import Factors
from planner.cost.block import block_times
from planner.specs.cluster import ClusterSpec
from planner.specs.plan import Plan
from planner.specs.train import TrainSpec
from toy_gpu import LINK, MODEL, toy_device

DEV = toy_device({"fa2": [
    {"pass": "fwd", "head_dim": 64, "causal": True, "seq": [1024], "tflops": [200]},
    {"pass": "fwd", "head_dim": 64, "causal": False, "seq": [1024], "tflops": [300]},
    {"pass": "bwd", "head_dim": 64, "causal": True, "seq": [1024], "tflops": [100]}]})
FULL = 5e12  # FLOP/s of a full wave: 10 TFLOP/s x ceiling 0.5


def test_weight_gemms_forward_by_hand_with_partial_waves():
    """256 tokens (s 256, b 1): each forward GEMM [256, K] x [K, N] in 128 x 128 tiles on 4 SMs."""
    qkv = 2 * 256 * 384 * 128 / (FULL * 6 / 8)    # 2 x 3 = 6 tiles: two waves, the second half idle
    out = 2 * 256 * 128 * 128 / (FULL * 2 / 4)    # 2 tiles: one wave, half the SMs idle
    ffn_in = 2 * 256 * 256 * 128 / FULL           # 4 tiles: one full wave
    ffn_out = 2 * 256 * 128 * 256 / (FULL * 2 / 4)
    bc = compute.block_compute_times(MODEL, DEV, 256, 1, 1, "bf16", compute_scale=1.5, attention_scale=1.0)
    assert bc.gemm_fwd == pytest.approx(1.5 * (qkv + out + ffn_in + ffn_out), rel=1e-12)


def test_weight_gemms_backward_from_their_own_shapes():
    """dX = dY W^T is [256, N] x [N, K]; dW = X^T dY is [K, 256] x [256, N]: other tilings, other waves."""
    qkv = 2 * 256 * 128 * 384 / (FULL * 2 / 4) + 2 * 128 * 384 * 256 / (FULL * 3 / 4)
    out = 2 * 256 * 128 * 128 / (FULL * 2 / 4) + 2 * 128 * 128 * 256 / (FULL * 1 / 4)
    ffn_in = 2 * 256 * 128 * 256 / (FULL * 2 / 4) + 2 * 128 * 256 * 256 / (FULL * 2 / 4)
    ffn_out = 2 * 256 * 256 * 128 / FULL + 2 * 256 * 128 * 256 / (FULL * 2 / 4)
    bc = compute.block_compute_times(MODEL, DEV, 256, 1, 1, "bf16", compute_scale=1.5, attention_scale=1.0)
    assert bc.gemm_bwd == pytest.approx(1.5 * (qkv + out + ffn_in + ffn_out), rel=1e-12)
    # not 2x forward: the weight gradients' K x N outputs fill fewer SMs here
    assert bc.gemm_bwd > 2.0 * bc.gemm_fwd


def test_attention_core_forward_and_backward_from_the_flash_kernel_curves():
    # causal: 4 b s^2 a d / 2 FLOPs = 4 x 256^2 x 2 x 64 / 2 at 200 TFLOP/s forward; backward 2.5x
    # them at 100 TFLOP/s (the kernel's own recompute of Q K^T is inside its measured backward)
    flops = 4 * 256 ** 2 * 2 * 64 / 2
    bc = compute.block_compute_times(MODEL, DEV, 256, 1, 1, "bf16", compute_scale=1.0, attention_scale=3.0)
    assert bc.core_fwd == pytest.approx(3.0 * flops / 200e12, rel=1e-12)
    assert bc.core_bwd == pytest.approx(3.0 * 2.5 * flops / 100e12, rel=1e-12)
    # an explicit mask (no block skipping): twice the FLOPs at the non-causal curve; no non-causal
    # backward measured: the causal backward's throughput
    full = compute.AttentionKernel(("fa2",), False)
    nc = compute.block_compute_times(MODEL, DEV, 256, 1, 1, "bf16", compute_scale=1.0, attention_scale=1.0,
                                     attention=full)
    assert nc.core_fwd == pytest.approx(2 * flops / 300e12, rel=1e-12)
    assert nc.core_bwd == pytest.approx(2.5 * 2 * flops / 100e12, rel=1e-12)
    # the runtime's preferred family missing from the profile: the next one it runs
    fams = compute.AttentionKernel(("cudnn", "fa2"), True)
    assert compute.flash_core_times(MODEL, DEV, 256, 1, 1, "bf16", fams) == (flops / 200e12, 2.5 * flops / 100e12)
    # flash does not run fp32: no curve
    assert compute.flash_core_times(MODEL, DEV, 256, 1, 1, "fp32") is None


def test_eager_core_as_batched_gemms_from_their_shapes():
    """Eager attention (no kernel curve): b a = 2 batched GEMMs each, Q K^T [256, 64] x [64, 256]
    (4 tiles each, 8 in two full waves) and P V [256, 256] x [256, 64] (2 tiles each, 4 in one
    wave, but each tile only half used: 64 of its 128 columns); backward two GEMMs per forward GEMM."""
    qk = 2 * 2 * 256 * 256 * 64 / FULL
    pv = 2 * 2 * 256 * 64 * 256 / (FULL * 64 / 128)
    bc = compute.block_compute_times(MODEL, DEV, 256, 1, 1, "bf16", compute_scale=1.0, attention_scale=2.0,
                                     kernel="eager")
    assert bc.core_fwd == pytest.approx(2.0 * (qk + pv), rel=1e-12)
    assert bc.core_bwd == pytest.approx(2.0 * 2 * (qk + pv), rel=1e-12)


def test_output_layer_from_its_three_shapes():
    # [256, 128] x [128, 512]: 2 x 4 = 8 tiles, two full waves; dX [256, 512] x [512, 128]: 2 tiles;
    # dW [128, 256] x [256, 512]: 4 tiles, one full wave
    want = (2 * 256 * 512 * 128 / FULL + 2 * 256 * 128 * 512 / (FULL * 2 / 4) + 2 * 128 * 512 * 256 / FULL) * 1.5
    assert compute.logits_times(MODEL, DEV, 256, 1, 1, "bf16", 1.5) == pytest.approx(want, rel=1e-12)


def test_memory_bound_work_is_bytes_over_the_achievable_bandwidth():
    """The block's norms, adds, rotary and activation (block_elementwise_bytes) at 1000 GB/s x the
    measured 50%, x elementwise_scale: what is left of the forward after the GEMMs and the core."""
    cluster = ClusterSpec(nodes=1, gpus_per_node=4, device=DEV, intra_node=LINK, inter_node=LINK)
    train = TrainSpec(global_batch=4, seq_len=256, precision="bf16", attention="flash")
    plan = Plan(dp=4, micro_batch=1, grad_accum=1, precision="bf16", zero=0)
    f = Factors(elementwise_scale=2.0, compute_scale=1.5, attention_scale=3.0)
    bt = block_times(MODEL, cluster, train, plan, f)
    bc = compute.block_compute_times(MODEL, DEV, 256, 1, 1, "bf16", compute_scale=1.5, attention_scale=3.0,
                                     attention=compute.AttentionKernel(("fa2",), False))
    elem = compute.block_elementwise_bytes(MODEL, 256, 1, 1, 2.0, False, "flash")
    assert bt.forward - bc.gemm_fwd - bc.core_fwd == pytest.approx(elem / (1000e9 * 0.5) * 2.0, rel=1e-9)
    assert bt.backward == pytest.approx(bc.gemm_bwd + bc.core_bwd + 2 * elem / (1000e9 * 0.5) * 2.0, rel=1e-9)


# --- memory by runtime (issue 19 item 2's memory half) -------------------------------------------
def test_fused_cross_entropy_keeps_the_logits_not_an_fp32_softmax():
    from planner.cost import memory
    m = MODEL  # V_p 512, h 128, bf16; s 256, b 2
    plain = memory.head_bytes(m, 256, 2, 1, sequence_parallel=False, act_bytes=2.0)
    fused = memory.head_bytes(m, 256, 2, 1, sequence_parallel=False, act_bytes=2.0, fused_ce=True)
    # fp32 softmax 4 b s V -> the bf16 logits 2 b s V and an fp32 log-sum-exp 4 b s
    assert plain - fused == pytest.approx(4 * 2 * 256 * 512 - (2 * 2 * 256 * 512 + 4 * 2 * 256), rel=1e-12)


def test_runtimes_with_a_causal_flag_keep_no_mask_and_fsdp_no_per_block_copies():
    """The executor (deepspeed) gives SDPA an explicit b x s x s mask, kept per stage (per block
    under ZeRO-3); Megatron-Core (Transformer Engine) and FSDP (flash-attn) pass a causal flag."""
    from planner.cost import memory
    from planner.cost.model import rebuilds_shared_per_block
    from planner.cost.runtime import get_runtime
    assert get_runtime("deepspeed").materialises_mask
    assert not get_runtime("fsdp").materialises_mask and not get_runtime("megatron-core").materialises_mask
    assert get_runtime("fsdp").fused_cross_entropy and get_runtime("megatron-core").fused_cross_entropy
    assert not get_runtime("deepspeed").fused_cross_entropy
    assert rebuilds_shared_per_block(Plan(dp=8, zero=3)) and not rebuilds_shared_per_block(Plan(dp=8, zero=3, runtime="fsdp"))
    with_mask = memory.cache_bytes(MODEL, 256, 2, 1, 2.0)
    assert with_mask - memory.cache_bytes(MODEL, 256, 2, 1, 2.0, False) == 2.0 * 2 * 256 * 256  # e b s s
    kw = dict(act_bytes=2.0, kernel="flash", plain=True, recomputed=False)
    assert memory.shared_bytes(MODEL, 256, 2, 1, **kw) - memory.shared_bytes(MODEL, 256, 2, 1, mask=False, **kw) \
        == 2.0 * 2 * 256 * 256
