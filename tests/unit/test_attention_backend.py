"""TrainSpec.attention_backend: the flash kernel family a runtime is configured to run (e.g.
Transformer Engine with NVTE_FUSED_ATTN=0 runs FlashAttention-2, not cuDNN), timed from that
family's measured curve (planner.cost.block.attention_kernel_of)."""
from __future__ import annotations

import pytest

from planner.cost import compute
from planner.cost.block import attention_kernel_of
from planner.cost.runtime import get_runtime
from planner.errors import SpecError
from planner.specs import ModelSpec
from planner.specs.train import TrainSpec
from toy_gpu import MODEL, toy_device

DEV = toy_device({
    "fa2": [{"pass": "fwd", "head_dim": 64, "causal": True, "seq": [1024], "tflops": [200]},
            {"pass": "bwd", "head_dim": 64, "causal": True, "seq": [1024], "tflops": [100]}],
    "cudnn": [{"pass": "fwd", "head_dim": 64, "causal": True, "seq": [1024], "tflops": [400]},
              {"pass": "bwd", "head_dim": 64, "causal": True, "seq": [1024], "tflops": [320]}]})


def _core(train: TrainSpec) -> tuple[float, float]:
    att = attention_kernel_of(get_runtime("megatron-core"), train)
    bc = compute.block_compute_times(MODEL, DEV, 256, 1, 1, "bf16", compute_scale=1.0, attention_scale=1.0,
                                     attention=att)
    return bc.core_fwd, bc.core_bwd


def test_megatron_core_runs_cudnn_unless_told_to_run_fa2():
    # causal forward 4 b s^2 a d / 2 = 4 x 256^2 x 2 x 64 / 2 FLOPs; backward 2.5x them
    flops = 4 * 256 ** 2 * 2 * 64 / 2
    fwd, bwd = _core(TrainSpec(global_batch=1, seq_len=256))
    assert (fwd, bwd) == pytest.approx((flops / 400e12, 2.5 * flops / 320e12), rel=1e-12)
    fwd, bwd = _core(TrainSpec(global_batch=1, seq_len=256, attention_backend="fa2"))
    assert (fwd, bwd) == pytest.approx((flops / 200e12, 2.5 * flops / 100e12), rel=1e-12)


def test_named_backend_first_then_the_runtime_order_without_repeats():
    rt = get_runtime("megatron-core")
    assert rt.attention_kernels == ("cudnn", "fa2")
    assert attention_kernel_of(rt, TrainSpec(global_batch=1, seq_len=8)).families == ("cudnn", "fa2")
    assert attention_kernel_of(rt, TrainSpec(global_batch=1, seq_len=8, attention_backend="fa2")).families \
        == ("fa2", "cudnn")
    # a family the profile lacks falls back to the runtime's order (here: cudnn's curve)
    flops = 4 * 256 ** 2 * 2 * 64 / 2
    assert _core(TrainSpec(global_batch=1, seq_len=256, attention_backend="fa3"))[0] == pytest.approx(flops / 400e12)


def test_backend_is_validated_and_left_out_of_old_run_directories():
    with pytest.raises(SpecError, match="--attention-backend"):
        TrainSpec(global_batch=1, seq_len=8, attention_backend="xformers")
    assert "attention_backend" not in TrainSpec(global_batch=1, seq_len=8).to_dict()
    d = TrainSpec(global_batch=1, seq_len=8, attention_backend="fa2").to_dict()
    assert d["attention_backend"] == "fa2" and TrainSpec(**d).attention_backend == "fa2"


def test_a100_triton_curve_is_the_figures_flashattention_triton_bars():
    """FlashAttention-2 paper Figure 4 (A100 80GB SXM4), 'FlashAttention Triton' bar labels: one
    fwd_bwd curve per (head dim, mask), used for both passes; the 40 GB part has the same compute."""
    from planner.specs.hardware import find_device
    for name in ("A100-80GB", "A100-40GB"):
        k = find_device(name)[0].kernels
        assert k.attention_tflops("triton", "fwd", 128, 16384, True) == 80
        assert k.attention_tflops("triton", "bwd", 128, 16384, True) == 80
        assert k.attention_tflops("triton", "fwd", 64, 512, False) == 90
        assert k.attention_tflops("triton", "fwd", 128, 2048, True) == 68
        assert k.attention_tflops("triton", "fwd", 64, 4096, True) == 76
        # and FlashAttention-2's in the same figure, for contrast: 189 at 16k, causal, head dim 128
        assert k.attention_tflops("fa2", "fwd", 128, 16384, True) == 189


def test_a100_core_under_the_triton_kernel_by_hand():
    """MPT-7B-shaped heads (32 x 128) at 16k, causal, on the A100's triton curve (80 TFLOP/s both passes):
    forward 4 b s^2 a d / 2 FLOPs / 80e12, backward 2.5x that."""
    from planner.specs.hardware import find_device
    dev = find_device("A100-80GB")[0]
    model = ModelSpec(name="m", hidden=4096, layers=1, heads=32, ffn_hidden=16384, activation="gelu", vocab=512,
                      max_seq=16384, norm="layernorm", position="learned", qkv_bias=False, linear_bias=False)
    att = attention_kernel_of(get_runtime("fsdp"), TrainSpec(global_batch=1, seq_len=16384, attention_backend="triton"))
    assert att.families == ("triton", "fa2")
    fwd, bwd = compute.flash_core_times(model, dev, 16384, 1, 1, "bf16", att)
    flops = 4 * 16384 ** 2 * 32 * 128 / 2
    assert fwd == pytest.approx(flops / 80e12, rel=1e-12)
    assert bwd == pytest.approx(2.5 * flops / 80e12, rel=1e-12)
    # the runtime's own kernel (FlashAttention-2) is 189 / 80 = 2.4x faster there
    fa2 = compute.flash_core_times(model, dev, 16384, 1, 1, "bf16", attention_kernel_of(get_runtime("fsdp"),
                                                                                        TrainSpec(global_batch=1, seq_len=16384)))
    assert fwd / fa2[0] == pytest.approx(189 / 80, rel=1e-12)


def test_cli_passes_the_backend_through_and_leaves_it_unset_by_default():
    from planner.cli.common import load_train
    from planner.specs.cluster import parse_cluster
    cluster = parse_cluster("8xH100")
    assert load_train(MODEL, cluster, 8, 256, None, "flash").attention_backend == ""
    assert load_train(MODEL, cluster, 8, 256, None, "flash", "fa2").attention_backend == "fa2"
