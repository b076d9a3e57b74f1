"""Kernel curves (planner/specs/kernels.py) and GEMMs timed from their shapes
(planner.cost.compute.shape_time): the schema, the lookups and the tile/wave model by hand, and
the model against vidur's measured A100 / H100 GEMMs (profiles/kernels/vidur-gemm.json)."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from planner.cost import compute
from planner.errors import ProfileError
from planner.specs import find_device
from planner.specs.hardware import PROFILES_DIR, DeviceProfile, Link, TRAIN_PRECISIONS
from planner.specs.kernels import KernelCurves, kernels_from_dict

LINK = Link(name="l", busbw_gbps=100, latency_us=1)
DEV = DeviceProfile(name="toy", kind="gpu", memory_gb=80, peak_tflops={"bf16": 100, "fp16": 100, "fp32": 10},
                    hbm_bandwidth_gbps=1000, gemm_efficiency=((1.0, 0.25), (1e30, 0.25)), gpus_per_node=8,
                    intra_node=LINK, inter_node=LINK,
                    kernels=KernelCurves(sms=4, gemm_tiles=((128, 128),), gemm_ceiling={"bf16": 0.5},
                                         hbm_efficiency=0.5))


def test_wave_efficiency_by_hand():
    assert compute.wave_efficiency(256, 256, (128, 128), 4) == 1.0            # 4 tiles, one full wave
    assert compute.wave_efficiency(200, 256, (128, 128), 4) == 200 * 256 / (4 * 128 * 128)  # padded row of tiles
    assert compute.wave_efficiency(256, 256, (128, 128), 3) == 256 * 256 / (2 * 3 * 128 * 128)  # 2 waves of 3
    assert compute.wave_efficiency(128, 128, (128, 128), 4, batch=6) == 6 / 8  # 6 tiles in 2 waves of 4


def test_shape_time_compute_bound_by_hand():
    # 2 x 256 x 256 x 1024 FLOPs at 100 TFLOP/s x ceiling 0.5 x q 1 (one full wave of four 128 x 128 tiles)
    want = 2 * 256 * 256 * 1024 / (100e12 * 0.5 * 1.0)
    assert compute.shape_time(DEV, 256, 256, 1024, "bf16") == pytest.approx(want, rel=1e-12)
    # three SMs: two waves, the second a third full: q = 2/3 -> 1.5x the time
    three = dataclasses.replace(DEV, kernels=dataclasses.replace(DEV.kernels, sms=3))
    assert compute.shape_time(three, 256, 256, 1024, "bf16") == pytest.approx(want * 1.5, rel=1e-12)


def test_shape_time_memory_bound_by_hand():
    # a skinny GEMM on a device with a large ceiling: 2 bytes x (m k + k n + m n) / (1000 GB/s x 0.5)
    fast = dataclasses.replace(DEV, peak_tflops={**DEV.peak_tflops, "bf16": 1e6})
    want = 2.0 * (1 * 8192 + 8192 * 128 + 1 * 128) / (1000e9 * 0.5)
    assert compute.shape_time(fast, 1, 128, 8192, "bf16") == pytest.approx(want, rel=1e-12)
    assert DEV.hbm_bytes_per_s == 1000e9 * 0.5


def test_shape_time_falls_back_to_the_flops_curve_without_a_ceiling():
    # fp32 has no ceiling in DEV: the FLOPs-only curve (efficiency 0.25 at 10 TFLOP/s)
    assert compute.shape_time(DEV, 256, 256, 1024, "fp32") == pytest.approx(2 * 256 * 256 * 1024 / (10e12 * 0.25))
    bare = dataclasses.replace(DEV, kernels=KernelCurves())
    assert compute.shape_time(bare, 256, 256, 1024, "bf16") == pytest.approx(2 * 256 * 256 * 1024 / (100e12 * 0.25))


def test_linear_backward_times_the_input_and_weight_gradients_from_their_own_shapes():
    fwd, bwd = compute.linear_times(DEV, 512, 1024, 384, "bf16")
    assert fwd == compute.shape_time(DEV, 512, 384, 1024, "bf16")
    assert bwd == compute.shape_time(DEV, 512, 1024, 384, "bf16") + compute.shape_time(DEV, 1024, 384, 512, "bf16")


def test_the_tile_model_reproduces_vidurs_measured_gemms():
    """vidur's CUDA-event medians of every linear layer of eight models at 512 and 2,048 tokens,
    TP 1-8 (fp16): the shipped A100 and H100 kernels sections time them within 12% MAPE and
    without a bias over 10% (benchmarks/kernel_curves.py prints 8.3% / 10.2% over all 45,240 GEMMs).
    Halving or dropping the ceiling, or the wave quantization, fails this."""
    data = json.loads((PROFILES_DIR / "kernels" / "vidur-gemm.json").read_text())
    for gpu in ("A100-80GB", "H100-SXM"):
        dev = find_device(gpu)[0]
        errs = [compute.shape_time(dev, m, n, k, "fp16") / s - 1 for g, _, _, _, m, n, k, s in data["points"] if g == gpu]
        assert len(errs) > 250
        assert sum(map(abs, errs)) / len(errs) < 0.12, gpu
        assert abs(sum(errs) / len(errs)) < 0.10, gpu


CURVES = {"fa2": [
    {"pass": "fwd_bwd", "head_dim": 64, "causal": True, "seq": [1000, 100000], "tflops": [100, 200]},
    {"pass": "fwd_bwd", "head_dim": 128, "causal": True, "seq": [1000, 100000], "tflops": [200, 300]},
    {"pass": "fwd", "head_dim": 64, "causal": False, "seq": [1000], "tflops": [400]}]}


def test_attention_lookup_interpolates_in_log_seq_and_head_dim():
    k = kernels_from_dict({"attention": CURVES}, TRAIN_PRECISIONS)
    assert k.attention_tflops("fa2", "fwd_bwd", 64, 10000, True) == pytest.approx(150)   # halfway in log(seq)
    assert k.attention_tflops("fa2", "fwd_bwd", 96, 1000, True) == pytest.approx(150)    # halfway in head dim
    assert k.attention_tflops("fa2", "fwd_bwd", 64, 10, True) == 100                     # clamped below
    assert k.attention_tflops("fa2", "fwd_bwd", 256, 1e6, True) == 300                   # clamped above
    # a pass without its own curve uses fwd_bwd; a mask without its own curve, the other mask's
    assert k.attention_tflops("fa2", "bwd", 64, 1000, True) == 100
    assert k.attention_tflops("fa2", "fwd", 64, 1000, True) == 400
    assert k.attention_tflops("cudnn", "fwd", 64, 1000, True) is None


@pytest.mark.parametrize("raw, field", [
    ({"nope": 1}, "kernels"),
    ({"sms": 4}, "kernels.gemm_tiles"),
    ({"gemm_ceiling": {"bf16": 1.5}}, "kernels.gemm_ceiling.bf16"),
    ({"gemm_ceiling": {"int4": 0.5}}, "kernels.gemm_ceiling"),
    ({"hbm_efficiency": 0}, "kernels.hbm_efficiency"),
    ({"attention": {"fa2": [{"pass": "both", "head_dim": 64, "causal": True, "seq": [1], "tflops": [1]}]}},
     "kernels.attention.fa2[0].pass"),
    ({"attention": {"fa2": [{"pass": "fwd", "head_dim": 64, "causal": True, "seq": [1, 2], "tflops": [1]}]}},
     "kernels.attention.fa2[0]"),
])
def test_bad_kernel_sections_name_the_field(raw, field):
    with pytest.raises(ProfileError) as e:
        kernels_from_dict(raw, TRAIN_PRECISIONS)
    assert e.value.field == field


def test_every_gpu_profile_has_kernel_curves_with_sources():
    for p in sorted(PROFILES_DIR.glob("*.json")):
        data = json.loads(p.read_text())
        if data.get("kind") != "gpu":
            continue
        dev = find_device(data["name"])[0]
        assert dev.kernels.tiled and dev.kernels.gemm_ceiling, p.name
        for key in ("kernels.sms", "kernels.gemm_ceiling", "kernels.hbm_efficiency"):
            assert data["sources"].get(key), (p.name, key)
        for kernel in dev.kernels.attention:
            assert data["sources"].get(f"kernels.attention.{kernel}"), (p.name, kernel)
        measured = data["name"] in ("A100-80GB", "H100-SXM")
        assert data["sources"]["kernels.gemm_ceiling"].startswith("measured" if measured else "derived"), p.name
        assert math.isclose(dev.hbm_bytes_per_s, data["hbm_bandwidth_gbps"] * 1e9 * dev.kernels.hbm_efficiency)


def test_gemm_ceilings_not_measured_by_vidur_follow_each_gpus_maximum_achievable_matmul():
    """benchmarks/kernel_curves.py MAMF (stas00/ml-engineering's measured MAMF table): H100's fp8 ceiling
    = its measured bf16 ceiling 0.747 x 0.709 (1402.6 / 1979) / 0.803 (794.5 / 989) = 0.6596 -> 0.66; B200 bf16
    0.747 x 0.776 / 0.803 = 0.7219 -> 0.722, fp8 0.747 x 0.763 / 0.803 = 0.7098 -> 0.71; H200 fp8 0.747 x 0.734 /
    0.803 = 0.6828 -> 0.683; a GPU without a MAMF row keeps its reference's fraction. The shipped profiles
    carry these values."""
    import sys
    sys.path.insert(0, str(PROFILES_DIR.parent / "benchmarks"))
    import kernel_curves as kc  # noqa: PLC0415
    assert kc.mamf_ceiling(0.747, "H100-SXM", "H100-SXM", "bf16") == 0.747
    assert kc.mamf_ceiling(0.747, "H100-SXM", "H100-SXM", "fp8") == 0.66
    assert kc.mamf_ceiling(0.747, "B200", "H100-SXM", "bf16") == kc.mamf_ceiling(0.747, "B200", "H100-SXM", "fp16") == 0.722
    assert kc.mamf_ceiling(0.747, "B200", "H100-SXM", "fp8") == 0.71
    assert kc.mamf_ceiling(0.747, "H200", "H100-SXM", "fp8") == 0.683
    assert kc.mamf_ceiling(0.75, "L40S", "A100-80GB", "fp8") == 0.75
    want = {"H100-SXM": {"bf16": 0.747, "fp16": 0.747, "fp8": 0.66}, "H200": {"bf16": 0.747, "fp16": 0.747, "fp8": 0.683},
            "B200": {"bf16": 0.722, "fp16": 0.722, "fp8": 0.71}}
    for name, ceilings in want.items():
        assert dict(find_device(name)[0].kernels.gemm_ceiling) == ceilings, name
