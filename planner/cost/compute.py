"""FLOPs and compute time from the real GEMM shapes of a block.

A GEMM of (m x k) @ (k x n) costs 2 m k n FLOPs forward and twice that backward (input and
weight gradients). For the GPT shape (4h GELU MLP, multi-head attention) the block's forward
is 24 b s h^2 + 4 b s^2 h, and the model's FLOPs per step reduce to Narayanan et al. 2021
(arXiv 2104.04473) eq. 3: 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) with full recompute, 72
instead of 96 without (Korthikanti et al. 2022, eq. 7/8). GLU FFNs and grouped KV heads are
counted from their shapes, never from those closed forms.
"""
from __future__ import annotations

from planner.specs.hardware import DeviceProfile
from planner.specs.model import ModelSpec


def block_gemms(model: ModelSpec, s: int, b: int, t: int) -> tuple[tuple[float, ...], float]:
    """Forward FLOPs of one block on one TP rank: (weight GEMMs, attention-core GEMMs).

    Weight GEMMs: QKV projection, attention output, FFN input matrices, FFN output.
    Attention core: QK^T and attention-over-values, 2 b s^2 q each (all heads; no causal
    halving, as in eq. 3).
    """
    tokens = s * b
    h, q, kv, f, k = model.hidden, model.q_size, model.kv_size, model.ffn_hidden, model.ffn_in_matrices
    qkv = 2.0 * tokens * h * (q + 2 * kv) / t
    out = 2.0 * tokens * q * h / t
    ffn_in = 2.0 * tokens * h * f * k / t
    ffn_out = 2.0 * tokens * f * h / t
    core = 2.0 * 2.0 * b * s * s * q / t
    return (qkv, out, ffn_in, ffn_out), core


def block_forward_flops(model: ModelSpec, s: int, b: int, t: int = 1) -> float:
    gemms, core = block_gemms(model, s, b, t)
    return sum(gemms) + core


def logits_forward_flops(model: ModelSpec, s: int, b: int, t: int = 1) -> float:
    """Output layer: 2 b s h V (vocab-parallel over TP)."""
    return 2.0 * s * b * model.hidden * model.vocab / t


def model_flops_per_sequence(model: ModelSpec, s: int) -> float:
    """Model FLOPs (forward + backward, no recompute) for one sequence: 3 x forward."""
    return 3.0 * (model.layers * block_forward_flops(model, s, 1) + logits_forward_flops(model, s, 1))


def gemm_time(device: DeviceProfile, flops: float, precision: str, scale: float = 1.0) -> float:
    """Seconds for one GEMM of `flops`, at the device's achievable efficiency for that size."""
    if flops <= 0:
        return 0.0
    peak = device.peak_flops(precision)
    return flops / (peak * device.gemm_eff(flops, precision)) * scale


def block_compute_times(model: ModelSpec, device: DeviceProfile, s: int, b: int, t: int, precision: str,
                        *, compute_scale: float, attention_scale: float) -> tuple[float, float]:
    """(forward GEMM seconds, attention-core forward seconds) of one block on one TP rank.

    Backward runs two GEMMs of each forward shape (input and weight gradient): 2x forward.
    """
    gemms, core = block_gemms(model, s, b, t)
    fwd = sum(gemm_time(device, g, precision, compute_scale) for g in gemms)
    heads_per_rank = max(1, model.heads // t)
    # the core is a batch of b x heads small GEMMs; its efficiency is that of one of them
    per_head = core / (b * heads_per_rank)
    core_t = 0.0 if core <= 0 else core / (device.peak_flops(precision) * device.gemm_eff(per_head, precision)) * attention_scale
    return fwd, core_t


def block_elementwise_bytes(model: ModelSpec, s: int, b: int, t: int, act_bytes: float,
                            sequence_parallel: bool, flash: bool = False) -> float:
    """HBM traffic of the memory-bound ops of one block's forward: norms, residual adds,
    bias/activation (GELU or GLU), rotary, dropout and softmax. Each reads its input and writes
    its output once; widths from the real shapes.
    """
    h, q, kv, f, k = model.hidden, model.q_size, model.kv_size, model.ffn_hidden, model.ffn_in_matrices
    sb = s * b
    e = act_bytes
    rep = sb * e * h * (2 * 2 + 2 * 2 + 2 * 2)  # two norms, two residual adds, two dropouts (in + out)
    sharded = sb * e * ((q + 2 * kv) * 2 + (k * f + f) * 2)  # rotary on q/k/v, activation (GLU)
    softmax = 0.0 if flash else b * model.heads * s * s * (e * 2 + e * 2 + 1)  # softmax + dropout
    if sequence_parallel:
        rep /= t
    return rep + (sharded + softmax) / t
