"""The toy GPU and model the hand-computed cost tests share (test_compute_shapes.py,
test_attention_backend.py): small enough to work every number on paper."""
from __future__ import annotations

from planner.specs import ModelSpec
from planner.specs.hardware import TRAIN_PRECISIONS, DeviceProfile, Link
from planner.specs.kernels import KernelCurves, kernels_from_dict

LINK = Link(name="l", busbw_gbps=100, latency_us=1)

# hidden 128, 2 heads of 64, GELU FFN 256, no biases: weight GEMMs (K, N) = QKV (128, 384),
# out (128, 128), FFN in (128, 256), FFN out (256, 128)
MODEL = ModelSpec(name="m", hidden=128, layers=2, heads=2, ffn_hidden=256, activation="gelu", vocab=512,
                  max_seq=1024, norm="layernorm", position="rotary", qkv_bias=False, linear_bias=False)


def toy_device(attention: dict) -> DeviceProfile:
    """10 TFLOP/s bf16, 4 SMs, one 128 x 128 tile, a full wave at half the peak; 1000 GB/s at
    50%; `attention`: the flash kernel families' measured curves (a profile's "attention")."""
    curves = kernels_from_dict({"attention": attention}, TRAIN_PRECISIONS).attention
    return DeviceProfile(name="toy", kind="gpu", memory_gb=80, peak_tflops={"bf16": 10, "fp16": 10, "fp32": 1},
                         hbm_bandwidth_gbps=1000, gemm_efficiency=((1.0, 0.25), (1e30, 0.25)), gpus_per_node=4,
                         intra_node=LINK, inter_node=LINK,
                         kernels=KernelCurves(sms=4, gemm_tiles=((128, 128),), gemm_ceiling={"bf16": 0.5},
                                              hbm_efficiency=0.5, attention=curves))
