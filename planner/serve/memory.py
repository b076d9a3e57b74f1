"""Serving memory: weight and KV-cache sizes, and the per-GPU budget of a vLLM engine.

[PA] Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
PagedAttention" (vLLM; SOSP 2023, arXiv 2309.06180); [P22] Pope et al. 2022, "Efficiently
Scaling Transformer Inference" (arXiv 2211.05102).
"""
from __future__ import annotations

import math
from typing import Any

from planner.cost.factors import factor as train_factor
from planner.serve.spec import KV_BYTES, WEIGHT_BYTES, Deployment, Workload
from planner.specs.cluster import ClusterSpec
from planner.specs.model import ModelSpec
from planner.specs.dtypes import activation_bytes

GB = 2.0 ** 30
"""Serving memory is reported in GiB, as the engines print it. The capacity they fill is the
CUDA driver's total (vLLM V1 vllm/v1/worker/gpu_worker.py: requested_memory =
MemorySnapshot().total_memory x gpu_memory_utilization, the total of torch.cuda.mem_get_info),
the same figure training's peak is checked against: DeviceProfile.memory_bytes (the profile's
memory_total_mib, 79.14 GiB on an A100 80GB; nvidia-smi's 81,920 MiB is not allocatable)."""
GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's --gpu-memory-utilization default: the share of device memory the engine may fill [PA]."""
SGLANG_MEM_FRACTION = {1: 0.88, 2: 0.87, 4: 0.85, 8: 0.81}
"""SGLang's --mem-fraction-static default by TP size (python/sglang/srt/server_args.py: 0.88
at TP 1, 0.87 at 2, 0.85 at 4, 0.81 at 8, 0.79 at 16): the share of memory for the weights and
the KV pool; activations and CUDA graphs use the rest."""


def memory_fraction(dep: Deployment) -> float:
    """The share of device memory the engine's weights and KV cache may fill."""
    if dep.engine == "sglang":
        return next(v for t, v in sorted(SGLANG_MEM_FRACTION.items(), reverse=True) if dep.tp >= t) \
            if dep.tp < 16 else 0.79
    return GPU_MEMORY_UTILIZATION
LOGIT_BYTES = 4.0
"""vLLM's sampler upcasts the sampled rows' logits to fp32."""


# --- sizes -------------------------------------------------------------------------------
def linear_weights(model: ModelSpec) -> int:
    """Weights of one block's matrices (QKV, attention output, FFN in and out): the ones
    weight-only int8/int4 quantizes."""
    h, q, kv, f, k = model.hidden, model.q_size, model.kv_size, model.ffn_size, model.ffn_in_matrices
    return h * (q + 2 * kv) + q * h + k * h * f + f * h


def weight_bytes(model: ModelSpec, dep: Deployment) -> float:
    """Bytes of the whole model: block matrices at the weight precision (with group scales),
    everything else (embedding, output layer, biases, norms) in bf16. Shared layers
    (ModelSpec.share_layers K) are held once: layers / K blocks."""
    return _weights(model, dep, model.unique_layers)


def _weights(model: ModelSpec, dep: Deployment, blocks: int) -> float:
    quant = blocks * linear_weights(model)
    rest = blocks * (model.layer_params - linear_weights(model)) + model.embedding_params + model.output_params
    return quant * WEIGHT_BYTES[dep.weight_precision] + rest * 2.0


def weight_read_bytes(model: ModelSpec, dep: Deployment) -> float:
    """Bytes one forward reads: every weight but the input embedding table, of which only the
    looked-up rows are touched (a tied embedding is read whole, as the output layer).

    Shared layers are read by every layer that uses them (all `layers` blocks, not layers / K):
    one block's matrices (hundreds of MB at GLM sizes; tiny-model blocks aside) exceed any
    GPU's L2 cache (50 MB on H100), so the K uses of one weight set are K reads from HBM. Only
    the memory footprint (weight_bytes) shrinks; decode's weight traffic does not."""
    skip = model.embedding_params if not model.tied_embeddings else model.embedding_params - model.vocab * model.hidden
    return _weights(model, dep, model.layers) - skip * 2.0


def kv_heads_per_rank(model: ModelSpec, tp: int) -> int:
    """KV heads one TP rank holds: vLLM splits them, and replicates them when tp exceeds
    their count (each rank keeps at least one)."""
    return math.ceil(model.kv_heads / tp)


def kv_bytes_per_token(model: ModelSpec, dep: Deployment) -> float:
    """KV-cache bytes of one token, whole model [P22 sec. 3.3]: 2 (K and V) x layers x kv_heads
    x head_dim x bytes at the KV precision. Grouped-query heads (kv_groups) shrink it. Linear
    attention keeps no per-token cache (0): state_bytes_per_sequence instead."""
    if model.linear_attention:
        return 0.0
    return 2.0 * model.layers * model.kv_heads * model.dim_per_head * KV_BYTES[dep.kv_precision]


def kv_bytes_per_token_rank(model: ModelSpec, dep: Deployment) -> float:
    """KV-cache bytes of one token on one TP rank (kv_heads_per_rank of them); 0 for linear attention."""
    if model.linear_attention:
        return 0.0
    return 2.0 * model.layers * kv_heads_per_rank(model, dep.tp) * model.dim_per_head * KV_BYTES[dep.kv_precision]


def state_bytes_per_sequence(model: ModelSpec, dep: Deployment, tp: int = 1) -> float:
    """Linear attention's recurrent state of one sequence on one of `tp` ranks (Katharopoulos et
    al. 2020, arXiv 2006.16236, sec. 3.4: the RNN form): per layer and KV head the d x d sum of
    phi(k) v^T and the d-wide normaliser sum of phi(k), at the KV precision, whatever the
    context length: layers x kv_heads x (d^2 + d) x bytes. 0 for softmax attention."""
    if not model.linear_attention:
        return 0.0
    d = model.dim_per_head
    return model.layers * kv_heads_per_rank(model, tp) * (d * d + d) * KV_BYTES[dep.kv_precision]


def cache_read_bytes(model: ModelSpec, dep: Deployment, batch: int, context_tokens: int) -> float:
    """What one decode step reads of the cache on one TP rank: the KV of `context_tokens`
    tokens [P22], or, with linear attention, the `batch` sequences' fixed states (read and
    written back once each)."""
    if model.linear_attention:
        return 2.0 * batch * state_bytes_per_sequence(model, dep, dep.tp)
    return context_tokens * kv_bytes_per_token_rank(model, dep)


def engine_budget(cluster: ClusterSpec, dep: Deployment) -> float:
    """Tokens per engine step (vLLM --max-num-batched-tokens, SGLang --chunked-prefill-size):
    the deployment's, else the engine's default for this GPU. vLLM V1 (vllm/engine/arg_utils.py
    EngineArgs.get_batch_defaults, OpenAI API server): 8192 on GPUs of >= 70 GiB other than
    A100 (H100, H200, MI300X), 2048 elsewhere (A100: larger budgets lowered its throughput,
    vLLM PR #17885). SGLang (python/sglang/srt/server_args.py): 2048 below 35 GiB, 8192 below
    160 GiB, 16384 above. The CPU executor and vLLM V0 without chunked prefill ("vllm-v0"): whole
    prompts, unbounded (V0's max(max_model_len, 2048) tokens per step is not capped here: set
    prefill_chunk to it)."""
    if dep.prefill_chunk:
        return float(dep.prefill_chunk)
    if dep.engine == "vllm":  # vLLM compares the driver's total (get_device_total_memory) with 70 GiB
        return 8192.0 if cluster.device.memory_bytes >= 70 * GB and "A100" not in cluster.device.name.upper() \
            else 2048.0
    if dep.engine == "sglang":  # SGLang reads nvidia-smi's memory.total: the marketed GiB (memory_gb)
        gib = cluster.device.memory_gb
        return 2048.0 if gib < 35 else 8192.0 if gib < 160 else 16384.0
    return math.inf



# --- memory -------------------------------------------------------------------------------
def serve_memory(model: ModelSpec, cluster: ClusterSpec, dep: Deployment, workload: Workload) -> dict[str, Any]:
    """Per-GPU memory of one replica's rank, GiB, and the paged KV cache it leaves [PA]:
    weights / tp; activations of the profiling forward vLLM runs before sizing the cache
    (max_num_batched_tokens = the prefill chunk, or the longest sequence, tokens x (2 x hidden
    + (k + 1) x ffn_hidden / tp) x 2 bytes: residual, normed input and the FFN's input and
    activation outputs, its largest live set; plus max_batch rows of fp32 logits / tp);
    runtime: the profile's memory_overhead_gb (CUDA context, NCCL, CUDA graphs); KV cache: the
    rest of gpu_memory_utilization (0.9) x capacity (the driver's total, DeviceProfile.memory_bytes,
    as training uses), in whole blocks of block_size tokens (SGLang:
    mem_fraction_static x capacity minus the weights; activations and runtime outside it).
    Blocks are allocated as tokens are computed (planner/serve/scheduler.py), so no sequence
    reserves the longest length: batch_limit is the sequences of the workload's mean length
    (prompt + output) the cache holds at once, capped at max_batch (a guide for the search's
    first screen; the simulation preempts when the cache runs out); fits: the longest request
    (Workload.max_total) fits the cache alone."""
    t = dep.tp
    longest = workload.max_total()
    budget = engine_budget(cluster, dep)
    chunk = longest if math.isinf(budget) else int(budget)
    capacity = cluster.device.memory_bytes * memory_fraction(dep)
    weights = weight_bytes(model, dep) / t
    e = activation_bytes(dep.weight_precision)
    act = chunk * (2 * model.hidden + (model.ffn_in_matrices + 1) * model.ffn_size / t) * e
    act += dep.max_batch * model.padded_vocab(t) / t * LOGIT_BYTES
    runtime = (cluster.memory_headroom if cluster.memory_headroom is not None
               else train_factor(cluster.device, "memory_overhead_gb")) * GB
    free = capacity - weights - (0.0 if dep.engine == "sglang" else act + runtime)
    per_seq = math.ceil(longest / dep.block_size)
    mean_seq = max(1, math.ceil(sum(workload.mean_lengths()) / dep.block_size))
    if model.linear_attention:
        # one fixed state per sequence: the batch limit is the states that fit; the queue's KV
        # blocks are then sized so that `limit` sequences of any admitted length always fit
        state = state_bytes_per_sequence(model, dep, t)
        limit = min(dep.max_batch, max(0, int(free // state)))
        blocks, block = limit * per_seq, limit * state / max(1, limit * per_seq)
    else:
        block = dep.block_size * kv_bytes_per_token_rank(model, dep)
        blocks = max(0, int(free // block))
        limit = min(dep.max_batch, blocks // mean_seq) if blocks >= per_seq else 0
    kv = blocks * block
    return {"weights": weights / GB, "kv_cache": kv / GB, "activations": act / GB, "runtime": runtime / GB,
            "total": (weights + kv + act + runtime) / GB, "capacity": capacity / GB,
            "kv_blocks": blocks, "kv_capacity_tokens": blocks * dep.block_size, "blocks_per_sequence": per_seq,
            "batch_limit": limit, "fits": free > 0 and limit >= 1, "short_gb": max(0.0, -free) / GB}
