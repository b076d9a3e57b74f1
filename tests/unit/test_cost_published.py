"""The cost model pinned to published numbers (shared/reference/calibration.md)."""
from __future__ import annotations

import pytest

from planner.cost.compute import block_forward_flops, logits_forward_flops, model_flops_per_sequence
from planner.cost.engines import Sizes, engine_for
from planner.cost.memory import block_activation_bytes, layer_activation_bytes
from planner.specs import ModelSpec, Plan

# ZeRO (Rajbhandari et al. 2020) Table 1: GB per device, stage 1 / 2 / 3, K = 12.
ZERO_TABLE1 = {
    1: {7.5: (120, 120, 120), 128: (2048, 2048, 2048), 1000: (16000, 16000, 16000)},
    4: {7.5: (52.5, 41.3, 30), 128: (896, 704, 512), 1000: (7000, 5500, 4000)},
    16: {7.5: (35.6, 21.6, 7.5), 128: (608, 368, 128), 1000: (4750, 2875, 1000)},
    64: {7.5: (31.4, 16.6, 1.88), 128: (536, 284, 32), 1000: (4187, 2218, 250)},
    256: {7.5: (30.4, 15.4, 0.47), 128: (518, 263, 8), 1000: (4046, 2054, 62.5)},
    1024: {7.5: (30.1, 15.1, 0.12), 128: (513, 257, 2), 1000: (4011, 2013, 15.6)},
}


def _digits(x: float) -> int:
    """Decimal places the paper printed for x."""
    text = repr(x)
    return len(text.split(".")[1]) if "." in text and not text.endswith(".0") else 0


def _states_gb(psi: float, dp: int, zero: int, precision: str = "bf16") -> float:
    """Parameters + gradients + optimizer states of DeepSpeed's engine for a ZeRO stage (no
    pipeline), without communication buckets or step-only copies (Table 1 leaves those out)."""
    engine = engine_for(Plan(dp=dp, zero=zero, precision=precision))
    by_role = engine.bytes_by_role(Sizes(psi=psi, dp=dp))
    return (by_role["params"] + by_role["grads"] + by_role["optimizer"]) / 1e9


@pytest.mark.parametrize("dp", sorted(ZERO_TABLE1))
@pytest.mark.parametrize("size_b", [7.5, 128, 1000])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_table1_to_rounding(dp, size_b, stage):
    """DeepSpeed 0.19.8's stages 2 and 3 hold exactly Table 1's model states. Its stage 1 also
    keeps the owned partition of the accumulated gradients (stage_1_and_2.py
    independent_gradient_partition_epilogue: averaged_gradients) while the full gradients
    still exist: Table 1 + 2 Psi / Nd, which the paper's stage 1 (4 Psi + K Psi / Nd) leaves out."""
    published = ZERO_TABLE1[dp][size_b][stage - 1]
    gb = _states_gb(size_b * 1e9, dp, stage)
    if stage == 1:
        gb -= 2 * size_b / dp
    # the paper truncates or rounds to its printed digits (e.g. 4187.5 -> 4187, 2218.75 -> 2218)
    tol = 10 ** -_digits(published)
    assert abs(gb - published) <= tol, (gb, published)


def test_zero_stage0_is_16_bytes_per_parameter():
    # FP16_Optimizer (bf16 without a pipeline): 2 + 2 + 12, nothing partitioned
    assert _states_gb(1e9, 64, 0, "bf16") == 16
    # fp32 without ZeRO: the bare optimizer, 4 + 4 + 8 (no master copy)
    assert _states_gb(1e9, 64, 0, "fp32") == 16
    # fp32 ZeRO-3 keeps an fp32 master partition besides the fp32 weight partition:
    # (4 + 4 + 4 + 8) / Nd, not the paper's mixed-precision 16 / Nd
    assert _states_gb(1e9, 4, 3, "fp32") == 5


# Korthikanti et al. 2022, Table 2, bytes per layer
@pytest.mark.parametrize("s,b,h,a,t", [(2048, 1, 12288, 96, 8), (2048, 4, 4096, 32, 4), (1024, 2, 2304, 24, 2)])
def test_korthikanti_table2_exact(s, b, h, a, t):
    sbh = s * b * h
    assert layer_activation_bytes(s, b, h, a) == sbh * (34 + 5 * a * s / h)
    assert layer_activation_bytes(s, b, h, a, t) == sbh * (10 + 24 / t + 5 * a * s / (h * t))
    assert layer_activation_bytes(s, b, h, a, t, sequence_parallel=True) == pytest.approx(
        sbh * (34 / t + 5 * a * s / (h * t)), rel=1e-12)
    assert layer_activation_bytes(s, b, h, a, t, recompute="selective") == sbh * (10 + 24 / t)
    assert layer_activation_bytes(s, b, h, a, t, sequence_parallel=True, recompute="selective") == pytest.approx(
        sbh * 34 / t, rel=1e-12)
    assert layer_activation_bytes(s, b, h, a, t, recompute="full") == 2 * sbh


def gpt(h: int, a: int, L: int, V: int = 51200, s: int = 2048, dropout: float = 0.0) -> ModelSpec:
    return ModelSpec(name="gpt", hidden=h, heads=a, layers=L, ffn_hidden=4 * h, activation="gelu", vocab=V,
                     max_seq=s, position="learned", tied_embeddings=True, hidden_dropout=dropout,
                     attention_dropout=dropout)


@pytest.mark.parametrize("t", [1, 2, 8])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("rc", ["none", "selective", "full"])
def test_shape_based_activations_reduce_to_table2_for_gpt(t, sp, rc):
    """Table 2's runtime: eager attention, dropout 0.1, bf16. The executor also keeps the two
    LayerNorms' mean and rstd (bf16, b s' each), which Table 2 leaves out."""
    m = gpt(4096, 32, 4, dropout=0.1)
    got = block_activation_bytes(m, 2048, 2, t, sequence_parallel=sp, recompute=rc, act_bytes=2.0, kernel="eager")
    want = layer_activation_bytes(2048, 2, 4096, 32, t, sequence_parallel=sp, recompute=rc)
    rows = 2048 * 2 / (t if sp else 1)
    if rc == "full":
        want /= t if sp else 1  # the checkpointed input is sharded by sequence under SP
    else:
        want += 2 * (2 * 2 * rows)  # two LayerNorms x (mean + rstd) x 2 bytes
    assert got == pytest.approx(want, rel=1e-12, abs=0)


def test_glu_and_grouped_kv_change_activations_from_shapes():
    mha = gpt(4096, 32, 4)
    gqa = ModelSpec(name="g", hidden=4096, heads=32, kv_groups=2, layers=4, ffn_hidden=13696,
                    activation="swiglu", vocab=65024, max_seq=8192)
    sb = 2048
    # eager, bf16, no dropout: norm inputs and the QKV / FFN inputs (4 x 2 sbh), LayerNorm mean
    # and rstd (2 x 2 x 2 sb); q / sqrt(d), K^T, V with K and V 2/32 as wide (128 x (32 + 4));
    # the softmax (2 a s^2 b); the attention output; SwiGLU keeps gate + up, the activation
    # output and the product (4 x 13696)
    expected = sb * (4 * 2 * 4096 + 2 * 2 * 2) + 2 * sb * 128 * (32 + 4) + 2 * 32 * 2048 * 2048 \
        + 2 * sb * 4096 + 2 * sb * 13696 * 4
    got = block_activation_bytes(gqa, 2048, 1, 1, sequence_parallel=False, recompute="none", act_bytes=2.0,
                                 kernel="eager")
    assert got == expected
    assert expected != block_activation_bytes(mha, 2048, 1, 1, sequence_parallel=False, recompute="none",
                                              act_bytes=2.0, kernel="eager")


# Megatron-LM (Narayanan et al. 2021) Table 1 models: eq. 2 parameter counts
TABLE1 = [(1.7, 24, 2304, 24), (3.6, 32, 3072, 30), (7.5, 32, 4096, 36), (18.4, 48, 6144, 40),
          (39.1, 64, 8192, 48), (76.1, 80, 10240, 60), (145.6, 96, 12288, 80), (310.1, 128, 16384, 96),
          (529.6, 128, 20480, 105), (1008.0, 160, 25600, 128)]


@pytest.mark.parametrize("params_b,a,h,L", TABLE1)
def test_megatron_eq2_parameter_counts(params_b, a, h, L):
    m = gpt(h, a, L)
    V, s = 51200, 2048
    eq2 = 12 * L * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * L * h))
    # our count adds only the final LayerNorm (2h), which eq. 2 leaves out
    assert m.params == pytest.approx(eq2 + 2 * h, rel=1e-12)
    assert round(m.params / 1e9, 1) == pytest.approx(params_b, abs=0.051)


@pytest.mark.parametrize("params_b,a,h,L", TABLE1)
def test_megatron_eq3_flops(params_b, a, h, L):
    m = gpt(h, a, L)
    B, s, V = 512, 2048, 51200
    # model FLOPs without recompute: Korthikanti et al. 2022: 72 B L s h^2 (1 + s/(6h) + V/(12 h L))
    model_flops = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    assert model_flops_per_sequence(m, s) * B == pytest.approx(model_flops, rel=1e-12)
    # full recompute adds one forward of every block: 96 instead of 72 (eq. 3)
    with_recompute = model_flops_per_sequence(m, s) * B + L * block_forward_flops(m, s, 1) * B
    assert with_recompute == pytest.approx(96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h)), rel=1e-12)
    assert logits_forward_flops(m, s, 1) == 2 * s * h * V
