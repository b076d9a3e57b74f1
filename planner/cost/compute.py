"""FLOPs and compute time from the real GEMM shapes of a block.

A GEMM of (m x k) @ (k x n) costs 2 m k n FLOPs forward and twice that backward (input and
weight gradients). For the GPT shape (4h GELU MLP, multi-head attention) the block's forward
is 24 b s h^2 + 4 b s^2 h, and the model's FLOPs per step reduce to Narayanan et al. 2021
(arXiv 2104.04473) eq. 3: 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) with full recompute, 72
instead of 96 without (Korthikanti et al. 2022, eq. 7/8). GLU FFNs and grouped KV heads are
counted from their shapes, never from those closed forms.
"""
from __future__ import annotations

from dataclasses import dataclass

from planner.cost.attention import KERNELS
from planner.specs.hardware import DeviceProfile
from planner.specs.model import ModelSpec

LINEAR_CHUNK = 64
"""Tokens per chunk of the executor's causal linear attention (planner/model/attention.py
linear_attention): quadratic inside a chunk, a d x d state carried across chunks."""


def linear_core_flops(model: ModelSpec, s: int, b: int, t: int) -> float:
    """Forward FLOPs of causal linear attention on one TP rank (Katharopoulos et al. 2020,
    arXiv 2006.16236, eq. 4-6, in the chunked form the executor runs), C = min(LINEAR_CHUNK, s),
    n = heads/t, g = KV heads/t, d head dim:
        within chunks: phi(Q) phi(K)^T and @ V, 2 x 2 s C d per query head;
        across chunks: phi(Q) @ S (2 s d^2 per query head) and the states' updates
        phi(K)^T V (2 s d^2 per KV head)
    = 2 b s d (2 C n + (n + g) d). Linear in s: no s^2 term. (The normaliser's d-wide dot
    products are left out: < 1/d of the rest.)"""
    c = min(LINEAR_CHUNK, s)
    n, g, d = model.heads / t, model.kv_heads / t, model.dim_per_head
    return 2.0 * b * s * d * (2.0 * c * n + (n + g) * d)


def ffn_time_divisors(model: ModelSpec) -> tuple[float, ...]:
    """Per weight GEMM of block_gemms (QKV, out, FFN in, FFN out), what its time is divided by:
    ModelSpec.sparse_gemm_efficiency on the two FFN GEMMs of a pruned FFN, else 1."""
    e = model.sparse_gemm_efficiency if model.ffn_sparsity else 1.0
    return (1.0, 1.0, e, e)


def block_gemms(model: ModelSpec, s: int, b: int, t: int) -> tuple[tuple[float, ...], float]:
    """Forward FLOPs of one block on one TP rank: (weight GEMMs, attention-core GEMMs).

    Weight GEMMs: QKV projection, attention output, FFN input matrices, FFN output.
    Attention core: QK^T and attention-over-values, 2 b s^2 q each (all heads; no causal
    halving, as in eq. 3); linear attention: linear_core_flops. A pruned FFN
    (ModelSpec.ffn_sparsity) has ffn_size columns: its two GEMMs scale by about (1 - F).
    """
    tokens = s * b
    h, q, kv, f, k = model.hidden, model.q_size, model.kv_size, model.ffn_size, model.ffn_in_matrices
    qkv = 2.0 * tokens * h * (q + 2 * kv) / t
    out = 2.0 * tokens * q * h / t
    ffn_in = 2.0 * tokens * h * f * k / t
    ffn_out = 2.0 * tokens * f * h / t
    core = linear_core_flops(model, s, b, t) if model.linear_attention else 2.0 * 2.0 * b * s * s * q / t
    return (qkv, out, ffn_in, ffn_out), core


def block_forward_flops(model: ModelSpec, s: int, b: int, t: int = 1) -> float:
    gemms, core = block_gemms(model, s, b, t)
    return sum(gemms) + core


def logits_forward_flops(model: ModelSpec, s: int, b: int, t: int = 1) -> float:
    """Output layer on one TP rank: 2 b s h V_pad / t (vocab-parallel over the padded
    vocabulary, ModelSpec.padded_vocab; V_pad = V at t = 1)."""
    return 2.0 * s * b * model.hidden * model.padded_vocab(t) / t


def flash_recompute_flops(model: ModelSpec, s: int, b: int, t: int = 1) -> float:
    """Extra backward FLOPs of flash attention on one TP rank: it recomputes the scores QK^T
    (2 b s^2 q / t; Dao et al. 2022, arXiv 2205.14135, Algorithm 4) instead of storing them.
    Hardware FLOPs only, never model FLOPs. Linear attention's kernel recomputes its whole
    forward (linear_core_flops) in backward instead of keeping its chunk states."""
    if model.linear_attention:
        return linear_core_flops(model, s, b, t)
    return 2.0 * b * s * s * model.q_size / t


def model_flops_per_sequence(model: ModelSpec, s: int) -> float:
    """Model FLOPs (forward + backward, no recompute) for one sequence: 3 x forward."""
    return 3.0 * (model.layers * block_forward_flops(model, s, 1) + logits_forward_flops(model, s, 1))


def gemm_time(device: DeviceProfile, flops: float, precision: str, scale: float) -> float:
    """Seconds for one GEMM of `flops`, at the device's achievable efficiency for that size
    (the FLOPs-only curve: profiles without kernel curves, and a GEMM whose shape is unknown)."""
    peak = device.peak_flops(precision)
    return flops / (peak * device.gemm_eff(flops, precision)) * scale


ELEMENT_BYTES = {"fp8": 1.0, "bf16": 2.0, "fp16": 2.0, "fp32": 4.0}


def wave_efficiency(m: int, n: int, tile: tuple[int, int], sms: int, batch: int = 1) -> float:
    """Share of the SMs' tile slots a GEMM's output [m, n] (x batch) fills with useful work:
    tile quantization (the last row / column of tiles is partly padding) times wave
    quantization (the tiles run in waves of `sms`, one per SM; the last wave is partly idle).
    NVIDIA, "Matrix Multiplication Background User's Guide" (Deep Learning Performance
    documentation), sections "Tile Quantization" and "Wave Quantization"."""
    tm, tn = tile
    tiles = -(-m // tm) * -(-n // tn) * batch
    waves = -(-tiles // sms)
    return m * n * batch / (waves * sms * tm * tn)


def shape_time(device: DeviceProfile, m: float, n: float, k: float, precision: str, batch: int = 1) -> float:
    """Seconds of `batch` GEMMs [m, k] x [k, n] from their shape (planner/specs/kernels.py):

        max(2 m n k batch / (peak x ceiling x q),  bytes / achievable HBM bandwidth)

    q = wave_efficiency of the candidate tile that fills its waves best (the library's heuristic
    picks per shape); the ceiling is the measured fraction of the dense peak a full wave reaches;
    the memory bound reads A and B and writes C once. A device or precision without a tile
    model or ceiling falls back to the FLOPs-only curve (gemm_time)."""
    kc = device.kernels
    flops = 2.0 * m * n * k * batch
    ceiling = kc.gemm_ceiling.get(precision)
    if not kc.tiled or ceiling is None or flops <= 0:
        return gemm_time(device, flops / batch, precision, 1.0) * batch if flops > 0 else 0.0
    mi, ni = max(1, round(m)), max(1, round(n))
    q = max(wave_efficiency(mi, ni, tile, kc.sms, batch) for tile in kc.gemm_tiles)
    compute = flops / (device.peak_flops(precision) * ceiling * q)
    memory = ELEMENT_BYTES.get(precision, 2.0) * (m * k + k * n + m * n) * batch / device.hbm_bytes_per_s
    return max(compute, memory)


def linear_times(device: DeviceProfile, tokens: float, k: float, n: float, precision: str) -> tuple[float, float]:
    """(forward, backward) seconds of a linear layer Y[T, n] = X[T, k] W[k, n]: forward one GEMM
    (T, n, k); backward the input gradient dX = dY W^T (T, k, n) and the weight gradient
    dW = X^T dY (k, n, T), each timed from its own shape."""
    return (shape_time(device, tokens, n, k, precision),
            shape_time(device, tokens, k, n, precision) + shape_time(device, k, n, tokens, precision))


@dataclass(frozen=True, slots=True)
class BlockCompute:
    """Seconds of one block's compute on one TP rank for ONE micro-batch, no communication."""

    gemm_fwd: float
    """The weight GEMMs' forward (QKV, attention output, FFN in, FFN out), x compute_scale."""
    gemm_bwd: float
    """Their backward: input and weight gradients, each from its own shape."""
    core_fwd: float
    """The attention core's forward, x attention_scale."""
    core_bwd: float
    """Its backward, including what the kernel recomputes (flash: QK^T)."""


@dataclass(frozen=True, slots=True)
class AttentionKernel:
    """Which measured attention kernel family a runtime runs, and whether its mask lets the kernel
    skip the blocks above the diagonal (profiles/runtimes/<name>.json "attention_kernels",
    "causal_attention")."""

    families: tuple[str, ...] = ("fa2",)
    """Kernel families in the runtime's order of preference; the first one the profile measured is used."""
    causal: bool = True


def block_compute_times(model: ModelSpec, device: DeviceProfile, s: int, b: int, t: int, precision: str,
                        *, compute_scale: float, attention_scale: float, kernel: str = "flash",
                        attention: AttentionKernel = AttentionKernel()) -> BlockCompute:
    """One block's compute on one TP rank.

    On a device with a tile model (planner/specs/kernels.py: SMs, tiles, a measured GEMM ceiling
    for this precision) every weight GEMM is timed from its (M, N, K) (linear_times: forward,
    input gradient, weight gradient; shape_time's tile and wave quantization) and the attention
    core from the flash kernel's measured throughput (flash_core_times) or, for a kernel without a
    curve (eager, math; a GPU whose profile has none), from its batched GEMMs' shapes
    (core_gemm_times). Without a tile model (a CPU profile): the FLOPs-only curve, backward
    2x forward (and flash's recomputed QK^T)."""
    gemms, core = block_gemms(model, s, b, t)
    core_prec = bf16_part(precision)
    per = weight_gemm_times(model, device, s, b, t, precision)
    fwd, bwd = sum(x[0] for x in per) * compute_scale, sum(x[1] for x in per) * compute_scale
    if not shaped(device, precision):
        cf = core_time(model, device, core, s, core_prec, attention_scale)
        rec = core_time(model, device, flash_recompute_flops(model, s, b, t), s, core_prec, attention_scale) \
            if kernel in ("flash", "linear") else 0.0
        return BlockCompute(gemm_fwd=fwd, gemm_bwd=bwd, core_fwd=cf, core_bwd=2.0 * cf + rec)
    if model.linear_attention:
        cf = core_time(model, device, core, s, core_prec, attention_scale)
        cf_b = 2.0 * cf + core_time(model, device, flash_recompute_flops(model, s, b, t), s, core_prec, attention_scale)
    else:
        times = flash_core_times(model, device, s, b, t, core_prec, attention) if kernel == "flash" else None
        if times is None:  # backward: two GEMMs per forward GEMM; flash also recomputes Q K^T
            qk, pv = core_gemm_times(model, device, s, b, t, core_prec)
            times = (qk + pv, 2.0 * (qk + pv) + (qk if kernel == "flash" else 0.0))
        cf, cf_b = times[0] * attention_scale, times[1] * attention_scale
    return BlockCompute(gemm_fwd=fwd, gemm_bwd=bwd, core_fwd=cf, core_bwd=cf_b)


def weight_gemm_times(model: ModelSpec, device: DeviceProfile, s: int, b: int, t: int,
                      precision: str) -> list[tuple[float, float]]:
    """(forward, backward) seconds of each weight GEMM of block_gemms (QKV, attention output, FFN
    in, FFN out) on one TP rank, before compute_scale, a pruned FFN's divided by its
    sparse_gemm_efficiency: from their shapes (linear_times) where the device has a tile model,
    else the FLOPs-only curve with backward 2x forward."""
    divs = ffn_time_divisors(model)
    if not shaped(device, precision):
        gemms, _ = block_gemms(model, s, b, t)
        return [(gemm_time(device, g, precision, 1.0) / e, 2.0 * gemm_time(device, g, precision, 1.0) / e)
                for g, e in zip(gemms, divs)]
    out = []
    for (k, n), e in zip(weight_shapes(model, t), divs):
        f_, b_ = linear_times(device, s * b, k, n, precision)
        out.append((f_ / e, b_ / e))
    return out


def shaped(device: DeviceProfile, precision: str) -> bool:
    """Whether the device's GEMMs at `precision` are timed from their shapes: a tile model and a
    measured (or derived) ceiling for that precision in its profile's "kernels"."""
    return device.kernels.tiled and precision in device.kernels.gemm_ceiling


def weight_shapes(model: ModelSpec, t: int) -> tuple[tuple[float, float], ...]:
    """(K, N) of each weight GEMM of block_gemms on one TP rank (M is the tokens, s b): QKV h ->
    (q + 2 kv)/t, attention output q/t -> h, FFN in h -> k f/t (a GLU's gate and up fused into one
    GEMM, as Megatron-Core's linear_fc1 and vidur's profiled mlp_up_proj run them), FFN out f/t -> h."""
    h, q, kv, f, k = model.hidden, model.q_size, model.kv_size, model.ffn_size, model.ffn_in_matrices
    return (h, (q + 2 * kv) / t), (q / t, h), (h, k * f / t), (f / t, h)


def flash_core_times(model: ModelSpec, device: DeviceProfile, s: int, b: int, t: int, precision: str,
                     attention: AttentionKernel = AttentionKernel()) -> tuple[float, float] | None:
    """(forward, backward) seconds of the flash attention core on one TP rank from the kernel's
    measured throughput (profiles' kernels.attention: the FlashAttention-2/-3 papers' figures, by
    head dim, sequence length and mask) in the flash-attention benchmark's convention
    (planner/specs/kernels.py): forward 4 b s^2 (a/t) d FLOPs, halved under a causal mask;
    backward 2.5x that (it recomputes QK^T). The first of the runtime's kernel families the
    profile measured; None when it has none, or for a precision flash does not run (fp32)."""
    if precision not in ("bf16", "fp16"):
        return None
    d = model.dim_per_head
    flops = 4.0 * b * s * s * (model.heads / t) * d * (0.5 if attention.causal else 1.0)
    for fam in attention.families:
        fwd = device.kernels.attention_tflops(fam, "fwd", d, s, attention.causal)
        if fwd is not None:
            bwd = device.kernels.attention_tflops(fam, "bwd", d, s, attention.causal)
            return flops / (fwd * 1e12), 2.5 * flops / (bwd * 1e12)
    return None


def core_gemm_times(model: ModelSpec, device: DeviceProfile, s: int, b: int, t: int,
                    precision: str) -> tuple[float, float]:
    """Forward seconds of the attention core's two batched GEMMs, b a/t of each, from their
    shapes: (scores Q K^T [s, d] x [d, s], P V [s, s] x [s, d]) (shape_time: tile and wave
    quantization over the SMs; the s x s scores read and written through HBM where that bounds)."""
    n = max(1, round(b * model.heads / t))
    d = model.dim_per_head
    return shape_time(device, s, s, d, precision, batch=n), shape_time(device, s, d, s, precision, batch=n)


def logits_times(model: ModelSpec, device: DeviceProfile, s: int, b: int, t: int, precision: str,
                 compute_scale: float) -> float:
    """Forward + backward seconds of the output layer on one TP rank: [s b, h] x [h, V_pad/t]
    timed from its three shapes (linear_times) where the device has a tile model, else 3x the
    forward on the FLOPs-only curve."""
    if not shaped(device, precision):
        return 3.0 * gemm_time(device, logits_forward_flops(model, s, b, t), precision, compute_scale)
    f_, b_ = linear_times(device, s * b, model.hidden, model.padded_vocab(t) / t, precision)
    return (f_ + b_) * compute_scale


def bf16_part(precision: str) -> str:
    """The precision of the GEMMs fp8 training does not cover: Transformer Engine runs the
    linear layers' GEMMs (QKV, attention output, FFN: block_gemms' weight GEMMs) in FP8, while
    the attention core (its fused attention in bf16) and the output layer (Megatron-Core's
    ColumnParallelLinear, not a TE module) stay bf16 (NVIDIA Transformer Engine docs, "Using FP8
    with Transformer Engine"; Megatron-Core --fp8-format). Any other precision: itself."""
    return "bf16" if precision == "fp8" else precision


def core_time(model: ModelSpec, device: DeviceProfile, flops: float, s: int, precision: str,
              attention_scale: float) -> float:
    """Seconds of attention-core FLOPs: a batch of b x heads/t small GEMMs (s x d by d x s,
    or s x s by s x d: 2 s^2 d each), at the efficiency of one of them (linear attention: one
    chunk's C x d by d x C, 2 C^2 d)."""
    c = min(LINEAR_CHUNK, s) if model.linear_attention else s
    one = 2.0 * c * c * model.dim_per_head
    return flops / (device.peak_flops(precision) * device.gemm_eff(one, precision)) * attention_scale


def block_elementwise_bytes(model: ModelSpec, s: int, b: int, t: int, act_bytes: float,
                            sequence_parallel: bool, kernel: str) -> float:
    """Memory traffic of the memory-bound ops of one block's forward, from the real widths;
    each reads its input and writes its output once:
    - replicated in the TP region (sharded by sequence under SP): two norms, two residual adds,
      and the two hidden dropouts (read, write, 1-byte mask) only when hidden_dropout > 0;
    - sharded by TP: rotary on q/k/v, the FFN activation (GLU);
    - attention scores, only for a kernel that materialises them (eager, math): the softmax
      (read, write) and the attention dropout (read, write, mask) when attention_dropout > 0.
      Flash fuses both into its kernel; linear attention has none, but its feature map
      elu(x) + 1 on q and k (read, write).
    """
    assert kernel in KERNELS, kernel
    h, q, kv, f, k = model.hidden, model.q_size, model.kv_size, model.ffn_size, model.ffn_in_matrices
    sb = s * b
    e = act_bytes
    rep = sb * h * (2 * 2 * e + 2 * 2 * e)                      # two norms, two residual adds
    if model.hidden_dropout > 0:
        rep += sb * h * 2 * (2 * e + 1)                         # two dropouts: read, write, mask
    sharded = sb * e * ((q + 2 * kv) * 2 + (k * f + f) * 2)     # rotary on q/k/v, activation (GLU)
    scores = 0.0
    if kernel == "linear":
        sharded += sb * e * (q + kv) * 2
    elif kernel != "flash":
        per_score = 2 * e                                       # softmax: read, write
        if model.attention_dropout > 0:
            per_score += 2 * e + 1                              # dropout: read, write, mask
        scores = b * model.heads * s * s * per_score
    if sequence_parallel:
        rep /= t
    return rep + (sharded + scores) / t
