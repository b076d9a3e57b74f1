"""Factor-free seconds of one engine step of a vLLM-style engine: compute, memory reads and TP
traffic of prefill chunks and decodes on one TP rank (combined with the serving factors by
planner/serve/factors.py combine).

Sources (cited where used):
- [P22] Pope et al. 2022, "Efficiently Scaling Transformer Inference" (arXiv 2211.05102):
        decode is memory-bound at small batch (every weight and the whole KV cache read once
        per step), compute-bound (2 x params FLOPs per token) at large batch; prefill is
        compute-bound; KV bytes per token 2 x layers x kv_heads x head_dim x bytes (multi-query
        heads shrink it, sec. 3.3); Megatron TP costs two all-reduces of the activations per
        layer (sec. 3.2).
- [SA]  Agrawal et al. 2023, "SARATHI: Efficient LLM Inference by Piggybacking Decodes with
        Chunked Prefills" (arXiv 2308.16369): a prompt prefilled in chunks, each chunk's
        queries attending to the chunks before it.
"""
from __future__ import annotations

from planner.cost.comm import allgather_time, allreduce_time
from planner.cost.compute import LINEAR_CHUNK, block_gemms, ffn_time_divisors, linear_core_flops
from planner.errors import SpecError
from planner.serve import measured
from planner.serve.kernels import kernel_efficiency
from planner.serve.memory import cache_read_bytes, kv_bytes_per_token_rank, linear_weights, weight_read_bytes
from planner.serve.spec import WEIGHT_BYTES, Deployment
from planner.specs.cluster import ClusterSpec
from planner.specs.dtypes import activation_bytes
from planner.specs.model import ModelSpec

__all__ = ["causal_core_flops", "decode_terms", "prefill_terms", "step_terms"]


def _precision(cluster: ClusterSpec, dep: Deployment) -> str:
    """GEMMs run in bf16 (fp16 where the device has no bf16); weight-only int8/int4 dequantize
    to it; an fp32 deployment (the executor's CPU runs) computes in fp32."""
    if dep.weight_precision in ("fp32", "fp8"):
        return dep.weight_precision
    return "bf16" if cluster.device.supports("bf16") else "fp16"


def _slowdown(cluster: ClusterSpec, dep: Deployment) -> float:
    """CPU 'devices' share the host's cores: a deployment's dep.gpus processes
    (planner.specs.hardware.DeviceProfile.oversubscription). GPUs: 1."""
    return cluster.device.oversubscription(min(dep.gpus, cluster.world_size))


def _gemm_s(cluster: ClusterSpec, dep: Deployment, flops: float, one_gemm: float) -> float:
    """Seconds of `flops` at peak x the efficiency of a GEMM of `one_gemm` FLOPs."""
    dev = cluster.device
    prec = _precision(cluster, dep)
    if prec == "fp8" and not dev.supports("fp8"):
        # FP8 tensor cores run at twice the BF16 rate on Hopper and Ada (H100 SXM datasheet: 1,979
        # vs 989 dense TFLOP/s; L40S 733 vs 362), at the BF16 efficiency curve; step_terms divides the
        # linear layers by the measured FP8 kernel efficiency (planner/serve/kernels.py: vLLM's H100 benchmark)
        return flops / (2.0 * dev.peak_flops("bf16") * dev.gemm_eff(one_gemm, "bf16"))
    return flops / (dev.peak_flops(prec) * dev.gemm_eff(one_gemm, prec))


def _tp_comm_s(model: ModelSpec, cluster: ClusterSpec, dep: Deployment, tokens: int, sampled: int) -> float:
    """TP traffic of one forward of `tokens` tokens [P22 sec. 3.2; Megatron]: two all-reduces of
    tokens x hidden activations per layer, at their measured time where the GPU and TP degree
    were measured (measured.allreduce_s: vidur's NCCL timings), else at the intra-node link's
    busbw and latency, and the all-gather of the vocab-parallel logits of the `sampled` rows on
    the link (TP stays in a node). 0 at tp 1."""
    t = dep.tp
    if t == 1:
        return 0.0
    link = cluster.intra_node
    bw, lat = link.busbw_gbps * 1e9, link.latency_us * 1e-6
    e = activation_bytes(dep.weight_precision)
    # vidur measured 2-byte (fp16) all-reduces; an fp32 deployment (the CPU lab) takes the link's model
    ar = measured.allreduce_s(cluster.device, t, tokens * model.hidden) if e == 2.0 else None
    if ar is None:  # no measured all-reduce on this GPU / TP degree: the link's bandwidth and latency
        ar = allreduce_time(tokens * model.hidden * e, t, bw, lat, 1.0)
    ag = allgather_time(sampled * model.padded_vocab(t) * e, t, bw, lat, 1.0)
    return 2 * model.layers * ar + ag


def _serial(cluster: ClusterSpec) -> float:
    """1.0 where a step's weight/KV reads and its FLOPs add instead of overlapping (CPU 'devices':
    the same cores stream the weights and run the FMAs of a few-row GEMM, no separate copy
    engine or warp scheduler hides one behind the other; measured on this machine, a small-model
    decode step grows by ~0.8 ms per extra row from batch 1, where the memory term alone binds
    under max()); 0.0 on GPUs (the roofline max() [P22])."""
    return 1.0 if cluster.device.kind == "cpu" else 0.0


def _hbm(cluster: ClusterSpec) -> float:
    return cluster.device.hbm_bandwidth_gbps * 1e9


def causal_core_flops(model: ModelSpec, tokens: int, context: int, t: int) -> float:
    """QK^T and AV of a prefill chunk of `tokens` queries after `context` cached keys, under the
    causal mask, one TP rank, one layer: 2 x 2 x q_size / t per (query, key) pair kept, and a
    chunk keeps tokens x context + tokens (tokens + 1) / 2 of them (each query sees the cache
    and the chunk's tokens up to itself). FlashAttention skips the masked-out blocks (Dao 2023,
    "FlashAttention-2", sec. 3.1.1: causal attention at about half the FLOPs of the full
    square), so the mask halves the square's cost, not the cache's."""
    return 4.0 * (tokens * context + tokens * (tokens + 1) / 2.0) * model.q_size / t


def _prefill_attention_s(model: ModelSpec, cluster: ClusterSpec, dep: Deployment, tokens: int, context: int) -> float:
    """Seconds of one layer's causal attention core for a prefill chunk on one TP rank
    (causal_core_flops). Where the profile holds the flash kernels' measured throughput
    (planner/specs/kernels.py, from the FlashAttention-2/-3 papers' figures: benchmarks/
    kernel_curves.py) at the chunk's whole sequence (context + tokens), causal, forward: FA3 where
    measured (vLLM V1's kernel on Hopper: the V1 release post, "FlashAttention 3"), else FA2 (a
    profile with FA2's forward+backward curve only uses it for the forward: KernelCurves'
    rule); elsewhere (and fp32, linear attention) at the GEMM efficiency of one head's
    QK^T."""
    flops = causal_core_flops(model, tokens, context, dep.tp)
    curves = cluster.device.kernels
    if dep.weight_precision != "fp32" and curves.attention:
        kernel = "fa3" if "fa3" in curves.attention else "fa2"
        tflops = curves.attention_tflops(kernel, "fwd", model.dim_per_head, context + tokens, True)
        if tflops:
            return flops / (tflops * 1e12) * _slowdown(cluster, dep)
    return _gemm_s(cluster, dep, flops, 2.0 * tokens * (context + tokens) * model.dim_per_head)


def step_terms(model: ModelSpec, cluster: ClusterSpec, dep: Deployment, chunks: list[tuple[int, int]],
               batch: int = 0, context_tokens: int = 0, *, curves: bool = True) -> dict[str, float]:
    """Factor-free seconds of one engine step on one TP rank: prefill chunks [(tokens, cached
    context)] of several sequences [SA] beside a decode of `batch` sequences attending to
    `context_tokens` tokens in all (each one's cached tokens plus its new one) [P22].
    compute: the block GEMMs over every row of the step at once (2 x rows x weights / tp,
    compute.block_gemms: the engine flattens the step's tokens into one batch), each chunk's
    causal attention (causal_core_flops), the decodes' attention (2 x 2 x context_tokens x
    q_size / tp per layer) and the output layer for one row per sequence (vLLM computes the
    logits of the sampled rows only); memory: every weight read once (weights / tp at
    hbm_bandwidth, the floor [P22]), the decodes' KV cache and each chunk's cached context;
    comm: _tp_comm_s of the step's rows. attn_*: the decodes' attention parts
    (decode_attention_scale).

    On a GPU with measured block curves (planner/serve/measured.py: vidur's A100-80GB and
    H100-SXM timings) and `curves`, the linear layers and the elementwise ops are their measured
    seconds at the step's rows instead (fixed_s, run one after another with the rest: added
    outside the max); quantized weights divide the measured bf16 time by the roofline speedup
    of their fewer bytes (the ideal of the Marlin figure) and by the kernel's efficiency."""
    rows = sum(n for n, _ in chunks) + batch
    if rows < 1 or any(n < 1 or c < 0 for n, c in chunks) or batch < 0 or (batch and context_tokens < batch):
        raise SpecError("step", f"needs tokens >= 1, context >= 0 and context_tokens >= batch, got chunks {chunks}, "
                        f"batch {batch}, context_tokens {context_tokens}", "")
    t, k = dep.tp, _slowdown(cluster, dep)
    gemms, _ = block_gemms(model, rows, 1, t)
    keff = kernel_efficiency(dep.weight_precision, rows)  # quantized kernels: measured share of their roofline
    lin = sum(_gemm_s(cluster, dep, g, g) / e for g, e in zip(gemms, ffn_time_divisors(model))) / keff
    meas = measured.curve(cluster.device, t) if curves and cluster.device.kind != "cpu" \
        and dep.weight_precision != "fp32" and all(e == 1 for e in ffn_time_divisors(model)) else None
    fixed = 0.0
    if meas is not None:
        bf16_bytes = 2.0 * linear_weights(model) / t
        lin_bf16 = measured.linear_s(meas, rows, bf16_bytes)
        if dep.weight_precision not in ("bf16", "fp16"):
            # the roofline speedup of the quantized layer at these rows (its bytes at the bandwidth,
            # its FLOPs at its rate) against bf16's, as the Marlin figure's "ideal"
            bf = Deployment(tp=t, weight_precision="bf16")
            roof_bf = max(sum(_gemm_s(cluster, bf, g, g) for g in gemms), bf16_bytes / _hbm(cluster))
            q_bytes = linear_weights(model) * WEIGHT_BYTES[dep.weight_precision] / t
            roof_q = max(sum(_gemm_s(cluster, dep, g, g) for g in gemms), q_bytes / _hbm(cluster))
            lin_bf16 *= roof_q / roof_bf / keff
        fixed = model.layers * (lin_bf16 + measured.other_ops_s(meas, rows, model.hidden))
        lin = 0.0
    per_layer = lin
    for n, c in chunks:
        if model.linear_attention:  # chunked, the earlier chunks' state carried: no context term
            w = min(LINEAR_CHUNK, n)
            per_layer += _gemm_s(cluster, dep, linear_core_flops(model, n, 1, t), 2.0 * w * w * model.dim_per_head)
        else:
            per_layer += _prefill_attention_s(model, cluster, dep, n, c)
    core = 0.0
    if batch and model.linear_attention:  # each sequence's new token against its d x d state
        core = _gemm_s(cluster, dep, linear_core_flops(model, 1, batch, t), 2.0 * model.dim_per_head ** 2)
    elif batch:
        core = _gemm_s(cluster, dep, 4.0 * context_tokens * model.q_size / t,
                       2.0 * model.dim_per_head * context_tokens / batch)
    seqs = len(chunks) + batch
    logits = 2.0 * seqs * model.hidden * model.padded_vocab(t) / t
    compute = (model.layers * (per_layer + core) + _gemm_s(cluster, dep, logits, logits)) * k
    cache = cache_read_bytes(model, dep, batch, context_tokens) / _hbm(cluster) * k if batch else 0.0
    ctx_read = sum(c for _, c in chunks) * kv_bytes_per_token_rank(model, dep) / _hbm(cluster) * k
    quant = model.layers * linear_weights(model) * WEIGHT_BYTES[dep.weight_precision]
    if meas is not None:  # the linear weights' read is inside their measured time
        weights = weight_read_bytes(model, dep) - quant
    else:
        weights = weight_read_bytes(model, dep) + (quant * (1.0 / keff - 1.0) if keff < 1.0 else 0.0)
    memory = weights / t / _hbm(cluster) * k + cache + ctx_read
    return {"compute_s": compute, "memory_s": memory, "comm_s": _tp_comm_s(model, cluster, dep, rows, seqs),
            "tp_steps": 1.0 if t > 1 else 0.0, "serial": _serial(cluster),
            "attn_compute_s": model.layers * core * k, "attn_memory_s": cache,
            "mixed": 1.0 if chunks and batch else 0.0, "fixed_s": fixed}


def prefill_terms(model: ModelSpec, cluster: ClusterSpec, dep: Deployment, tokens: int,
                  context: int = 0, *, curves: bool = True) -> dict[str, float]:
    """Factor-free seconds of one prefill step of `tokens` prompt tokens of one sequence whose
    first `context` tokens are already cached (a later chunk [SA]): step_terms of that chunk."""
    if tokens < 1 or context < 0:
        raise SpecError("prefill", f"needs tokens >= 1 and context >= 0, got {tokens}, {context}", "")
    terms = step_terms(model, cluster, dep, [(tokens, context)], curves=curves)
    return {k: v for k, v in terms.items() if k not in ("attn_compute_s", "attn_memory_s")}


def decode_terms(model: ModelSpec, cluster: ClusterSpec, dep: Deployment, batch: int,
                 context_tokens: int, *, curves: bool = True) -> dict[str, float]:
    """Factor-free seconds of one decode step of `batch` sequences attending to
    `context_tokens` tokens in all [P22]: step_terms of the decodes alone."""
    if batch < 1 or context_tokens < batch:
        raise SpecError("decode", f"needs batch >= 1 and context_tokens >= batch, got {batch}, {context_tokens}", "")
    return step_terms(model, cluster, dep, [], batch, context_tokens, curves=curves)
