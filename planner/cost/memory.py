"""Activation memory: exactly the tensors the executor keeps for backward, and DeepSpeed's
pipeline buffers. Model states and buckets are per DeepSpeed engine: planner/cost/engines.py.

Every term below is one line of docs/runtime.md "What each layer keeps for backward"
(measured with saved-tensor hooks, pinned by tests/unit/test_executor_parts.py) or one
buffer of DeepSpeed 0.19.8's PipelineEngine (deepspeed/runtime/pipe/engine.py). Per micro-
batch and TP rank, in bytes; `e` is the activation element size (2 in bf16/fp16, 4 in fp32).
Symbols: b micro-batch, s sequence, h hidden, a heads, g KV groups, d head dim, f FFN size
per matrix, T TP degree, s' = s/T with sequence parallelism (else s), V_p the padded
vocabulary, r the rotary dims.

For GPT (T = 1, a = g, GELU f = 4h, LayerNorm, bf16, dropout 0.1, eager attention) one block
is Korthikanti et al. 2022 (arXiv 2205.05198) Table 2 exactly, 34 s b h + 5 a s^2 b, plus
the norm statistics; flash attention without dropout keeps 32 s b h + 4 b s a (no s^2 term).
"""
from __future__ import annotations

from planner.cost.attention import KERNELS
from planner.specs.model import ModelSpec
from planner.specs.plan import RECOMPUTE

INT64, FP32, BOOL = 8, 4, 1


def layer_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, *, sequence_parallel: bool = False,
                           recompute: str = "none") -> float:
    """Korthikanti et al. 2022 (arXiv 2205.05198), Table 2, bytes per transformer layer: the
    paper's closed form, kept to check block_activation_bytes against (GPT, eager, dropout).

    no parallelism: s b h (34 + 5 a s / h); TP: s b h (10 + 24/t + 5 a s / (h t));
    TP + SP: s b h (34/t + 5 a s / (h t)); selective recompute drops the 5 a s/h term;
    full recompute keeps s b h (2).
    """
    assert recompute in RECOMPUTE, recompute
    if recompute == "full":
        return 2.0 * s * b * h
    attn = 0.0 if recompute == "selective" else 5.0 * a * s / (h * t)
    if sequence_parallel:
        return s * b * h * (34.0 / t + attn)
    return s * b * h * (10.0 + 24.0 / t + attn)


def rotary_dims(model: ModelSpec) -> int:
    """Dims of each head the rotary embedding turns: the first rotary_fraction of each head
    (ChatGLM's 2D-RoPE and GLM-4 half, llama the whole head), rounded down to even
    (planner/model/attention.py rotary_dims); 0 without rotary."""
    if model.position != "rotary":
        return 0
    r = int(model.dim_per_head * model.rotary_fraction)
    return r - r % 2


def norm_stats_bytes(model: ModelSpec, tokens: float, e: float) -> float:
    """Statistics one norm keeps for `tokens` rows: RMSNorm its fp32 rstd (the executor's
    _RMSNormFn); LayerNorm torch's mean and rstd in the activation dtype."""
    return FP32 * tokens if model.norm == "rmsnorm" else 2.0 * e * tokens


def _core_bytes(model: ModelSpec, s: int, b: int, t: int, e: float, kernel: str) -> float:
    """The attention core without recompute (docs/runtime.md: q, k, v, their logsumexp or
    scores, the attention output)."""
    n, g, d = model.heads / t, model.kv_heads / t, model.dim_per_head
    out = e * b * s * n * d                                    # attention output (SDPA / P V and the dense linear)
    if kernel == "linear":
        # causal linear attention (planner/model/attention.py _LinearAttention) keeps q, k, v
        # only and recomputes its chunks in backward: no s x s term, no logsumexp
        return e * b * s * (n + 2 * g) * d + out
    if kernel == "flash":
        # q, k, v (rotary outputs and a copy of v) and the fp32 logsumexp b x heads x s
        return e * b * s * (n + 2 * g) * d + FP32 * b * n * s + out
    # eager (or the CPU math fallback, which the executor runs eagerly): q / sqrt(d), K^T and V
    # (contiguous copies), the softmax b x heads x s x s; with attention dropout its bool mask
    # and its output
    scores = e * b * n * s * s
    if model.attention_dropout > 0:
        scores += (BOOL + e) * b * n * s * s
    return e * b * s * d * (n + 2 * g) + scores + out


def block_activation_bytes(model: ModelSpec, s: int, b: int, t: int, *, sequence_parallel: bool,
                           recompute: str, act_bytes: float, kernel: str) -> float:
    """What one transformer block keeps for backward (docs/runtime.md "One transformer block"):

        block = 4 e b s' h + 2 stats + core + e b s (f/T) (4 GLU | 2 GELU) + (2 b s' h if p_h > 0)

    4 e b s' h: the block input and the residual sum (norm inputs), the QKV and FFN-in inputs
    (sequence shards under SP); the FFN keeps its input-matrix output (GLU: gate and up), the
    activation output and, for a GLU, the product; two 1-byte hidden-dropout masks where
    hidden dropout runs. Post-LN / DeepNorm keeps the same count.

    recompute "selective": the core is replaced by the QKV output the checkpoint holds
    (e b s (a + 2g) d/T, one storage) and the attention output; "full": the block keeps only
    its input, e b s' h, held by the checkpoint. `kernel` is the one that runs
    (planner.cost.attention.attention_kernel): "math" is the CPU's fallback with attention
    dropout, kept like eager.
    """
    assert recompute in RECOMPUTE and kernel in KERNELS, (recompute, kernel)
    e, h = act_bytes, model.hidden
    sr = s / t if sequence_parallel else s
    if recompute == "full":
        return e * b * sr * h
    base = 4 * e * b * sr * h + 2 * norm_stats_bytes(model, b * sr, e)
    if recompute == "selective":
        n, g, d = model.heads / t, model.kv_heads / t, model.dim_per_head
        core = e * b * s * (n + 2 * g) * d + e * b * s * n * d
    else:
        core = _core_bytes(model, s, b, t, e, kernel)
    ffn = e * b * s * model.ffn_size / t * (4 if model.glu else 2)
    masks = 2 * BOOL * b * sr * h if model.hidden_dropout > 0 else 0.0
    return base + core + ffn + masks


def mask_bytes(model: ModelSpec, s: int, b: int, t: int, e: float) -> float:
    """The additive attention mask, causal and within-document: b 1 s s in the activation
    dtype (ALiBi: b (a/T) s s, the per-head biases folded in); linear attention builds none
    (segments are masked chunk by chunk)."""
    if model.linear_attention:
        return 0.0
    heads = model.heads / t if model.position == "alibi" else 1
    return e * b * heads * s * s


def rotary_bytes(model: ModelSpec, s: int, b: int) -> float:
    """Rotary cos and sin, b s 1 (r/2) fp32 each."""
    return 2 * FP32 * b * s * (rotary_dims(model) // 2)


def ids_bytes(s: int, b: int) -> float:
    """The micro-batch's position and segment ids, int64 b s each."""
    return 2 * INT64 * b * s


def shared_bytes(model: ModelSpec, s: int, b: int, t: int, *, act_bytes: float, kernel: str, plain: bool,
                 recomputed: bool, mask: bool = True) -> float:
    """What a stage's blocks keep once per micro-batch (docs/runtime.md "Shared by a stage's
    blocks"): the mask, kept by SDPA in flash blocks that are not recomputed, and the rotary
    cos/sin, kept by blocks that are not recomputed (`plain`: the stage has such a block);
    the position and segment ids the checkpoints hold (`recomputed`: it has a recomputed one)."""
    assert kernel in KERNELS, kernel
    out = 0.0
    if plain:
        out += rotary_bytes(model, s, b) + (mask_bytes(model, s, b, t, act_bytes) if kernel == "flash" and mask else 0.0)
    if recomputed:
        out += ids_bytes(s, b)
    return out


def cache_bytes(model: ModelSpec, s: int, b: int, t: int, act_bytes: float, mask: bool = True) -> float:
    """The stage cache's own set (the latest micro-batch's mask and cos/sin), one per stage
    whatever the kernel or recompute (planner/model/attention.py StageCache). `mask` False: a
    runtime whose attention takes a causal flag instead of a mask tensor
    (planner.cost.runtime.Runtime.materialises_mask) builds none."""
    return (mask_bytes(model, s, b, t, act_bytes) if mask else 0.0) + rotary_bytes(model, s, b)


def embedding_bytes(model: ModelSpec, s: int, b: int, t: int) -> float:
    """First stage: the token ids (int64; under TP the shard-local ids), the out-of-shard
    flags (bool, T > 1) and, for learned positions, the position ids (int64). The embedding's
    output is the first block's input, counted there."""
    out = INT64 * b * s
    if t > 1:
        out += BOOL * b * s
    if model.position == "learned":
        out += INT64 * b * s
    return out


def head_bytes(model: ModelSpec, s: int, b: int, t: int, *, sequence_parallel: bool, act_bytes: float,
               fused_ce: bool = False) -> float:
    """Last stage: the final-norm input and statistics, the output-layer input (sequence
    shards under SP), the vocab-parallel cross-entropy's fp32 softmax b s V_p/T (Megatron's
    _VocabParallelCrossEntropy; the logits are never gathered), its out-of-shard target flags
    (bool) and shard-local targets (int64), the loss's fp32 real-token weights and their count.

    `fused_ce` (a fused cross-entropy kernel: flash-attn's CrossEntropyLoss, llm-foundry MPT's
    default loss_fn; Megatron-Core's fused vocab-parallel cross-entropy, NeMo's
    cross_entropy_loss_fusion): the kernel keeps its input logits in the activation dtype and an
    fp32 log-sum-exp per token, and computes the gradient from them in backward, instead of an
    fp32 softmax b s V_p/T."""
    e = act_bytes
    sr = s / t if sequence_parallel else s
    norm = e * b * sr * model.hidden + norm_stats_bytes(model, b * sr, e)
    kept = (e * b * s * model.padded_vocab(t) / t + FP32 * b * s) if fused_ce else FP32 * b * s * model.padded_vocab(t) / t
    loss = kept + (BOOL + INT64 + FP32) * b * s + FP32
    return norm + e * b * sr * model.hidden + loss


def logits_bytes(model: ModelSpec, s: int, b: int, t: int, act_bytes: float) -> float:
    """The logits, b s V_p/T in the activation dtype: never kept for backward, but alive during
    the last stage's forward next to their fp32 copy (which becomes the kept softmax) and again
    as the gradient entering the output layer."""
    return act_bytes * b * s * model.padded_vocab(t) / t


def pipe_buffers(p: int, stage: int, m: int) -> int:
    """DeepSpeed's TrainSchedule.num_pipe_buffers: max(2, min(p - stage, m))
    (deepspeed/runtime/pipe/schedule.py)."""
    return max(2, min(p - stage, m))


def pipeline_bytes(model: ModelSpec, s: int, b: int, t: int, *, sequence_parallel: bool, act_bytes: float,
                   stage: int, p: int, m: int) -> tuple[float, float]:
    """(per in-flight micro-batch, fixed) bytes of DeepSpeed's PipelineEngine buffers on one
    stage (deepspeed/runtime/pipe/engine.py; 0 without a pipeline). The stage's activation
    message is (hidden b s' h in the activation dtype, position ids, segment ids).

    Per in-flight micro-batch: a later stage keeps the received message (_exec_recv_activations
    clones it into pipe_buffers["inputs"]; _exec_send_grads frees it; the forward runs on
    another clone, which the first block keeps); an earlier stage keeps its output message
    (pipe_buffers["outputs"], freed after its backward).
    Fixed: a later stage's receive buffer (pipe_recv_buf) and an earlier stage's gradient
    buffer (_grad_layer_buf, floating tensors only); the first stage's loaded (ids, positions,
    segments) in each pipe buffer and the last stage's labels, never freed; and the last
    stage's previous logits, which pipe_buffers["outputs"] keeps (its backward returns before
    freeing them) while the next micro-batch's cross-entropy runs (m >= 2).
    """
    if p == 1:
        return 0.0, 0.0
    e = act_bytes
    hidden = e * b * (s / t if sequence_parallel else s) * model.hidden
    message = hidden + ids_bytes(s, b)
    per_mb = fixed = 0.0
    if stage > 0:
        per_mb += message
        fixed += message
    if stage < p - 1:
        per_mb += message
        fixed += hidden
    nbuf = pipe_buffers(p, stage, m)
    if stage == 0:
        fixed += nbuf * 3 * INT64 * b * s
    if stage == p - 1:
        fixed += nbuf * INT64 * b * s + (logits_bytes(model, s, b, t, e) if m >= 2 else 0.0)
    return per_mb, fixed


FP8_WEIGHT_BYTES = 2.0
"""fp8 training keeps, per weight element of a Transformer Engine linear, its FP8 copy and the
copy's transpose (1 byte each: the forward GEMM reads one, the backward's input-gradient GEMM
the other), cached across the micro-batches of a step (TE Linear's weight caching,
is_first_microbatch; Megatron-Core --fp8-format)."""
TE_LINEARS = 4
"""Transformer Engine linears per block: QKV, attention output, FFN in, FFN out."""
AMAX_HISTORY = 1024
"""DelayedScaling's amax_history_len default (transformer_engine.common.recipe): per linear, an
fp32 history of this length for each of its three FP8 tensors (input, weight, output gradient)."""


BF16_WEIGHT_BYTES = 2.0
"""The bf16 weight an fp8 plan otherwise holds per element (the engine's params, counted at bf16)."""


def fp8_bytes(blocks: int, block_psi: float, zero3: bool, param_gather: bool = False) -> float:
    """Extra device bytes of fp8 training for a stage of `blocks` blocks: the FP8 weight copies
    (FP8_WEIGHT_BYTES per element of each block's weights; under ZeRO-3 / FULL_SHARD only the
    gathered unit and the prefetched one hold them) and the amax histories (kept for every block).

    param_gather (Megatron-Core --fp8-param-gather, the runtime's fp8_param_gather, with the
    distributed optimizer): the weights are held in FP8 only (Transformer Engine's fp8_model_init;
    the fp32 master shard in the optimizer re-quantizes them after each step), so the blocks' bf16
    copy the engine's params count, BF16_WEIGHT_BYTES per element, is not there: it comes off
    (negative extra). The caller passes it only where the runtime and the plan have it."""
    live = min(blocks, 2) if zero3 else blocks
    extra = live * block_psi * FP8_WEIGHT_BYTES + blocks * TE_LINEARS * 3 * AMAX_HISTORY * 4.0
    if param_gather:
        extra -= blocks * block_psi * BF16_WEIGHT_BYTES
    return extra


def fp8_param_gather(plan) -> bool:
    """Whether an fp8 plan holds its weights in FP8 only: its runtime's fp8_param_gather
    (profiles/runtimes/<name>.json, sourced there) with the distributed optimizer (ZeRO-1):
    Megatron-LM's validate_args rejects --fp8-param-gather without it; Megatron-FSDP (ZeRO-3)
    shards the weights and is left at the bf16 accounting."""
    from planner.cost.runtime import get_runtime
    return plan.precision == "fp8" and plan.zero == 1 and get_runtime(plan.runtime).fp8_param_gather
