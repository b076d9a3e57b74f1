"""Memory formulas: activations (Korthikanti et al.) and logits. Model states and buckets are
per DeepSpeed engine: planner/cost/engines.py.

All results are bytes per device.
"""
from __future__ import annotations

from planner.cost.attention import KERNELS
from planner.specs.model import ModelSpec
from planner.specs.plan import RECOMPUTE


def layer_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, *, sequence_parallel: bool = False,
                           recompute: str = "none") -> float:
    """Korthikanti et al. 2022 (arXiv 2205.05198), Table 2, bytes per transformer layer.

    no parallelism: s b h (34 + 5 a s / h); TP: s b h (10 + 24/t + 5 a s / (h t));
    TP + SP: s b h (34/t + 5 a s / (h t)); selective recompute drops the 5 a s/h term;
    full recompute keeps s b h (2). (GPT with a 4h GELU MLP and multi-head attention.)
    """
    assert recompute in RECOMPUTE, recompute
    if recompute == "full":
        return 2.0 * s * b * h
    attn = 0.0 if recompute == "selective" else 5.0 * a * s / (h * t)
    if sequence_parallel:
        return s * b * h * (34.0 / t + attn)
    return s * b * h * (10.0 + 24.0 / t + attn)


def block_activation_bytes(model: ModelSpec, s: int, b: int, t: int, *, sequence_parallel: bool,
                           recompute: str, act_bytes: float = 2.0, kernel: str = "eager") -> float:
    """Saved activations of one block from its real tensor shapes (generalises Table 2).

    Table 2's breakdown (section 4.1): attention 11 sbh + 5 a s^2 b; MLP 19 sbh; norms 4 sbh.
    Here each stored tensor is sized from the actual widths: query q, key/value kv (grouped
    attention), FFN width f with k input matrices (GLU: k = 2). With q = kv = h, f = 4h, k = 1
    this is exactly Table 2. `act_bytes` is the activation element size (2 for bf16/fp16, 4 for
    fp32); masks stay 1 byte. `kernel` is the attention kernel that runs
    (planner.cost.attention.attention_kernel): only eager and math store the scores; the
    dropouts are the model's (model.hidden_dropout, model.attention_dropout).
    """
    assert recompute in RECOMPUTE and kernel in KERNELS, (recompute, kernel)
    h, q, kv, f, k = model.hidden, model.q_size, model.kv_size, model.ffn_hidden, model.ffn_in_matrices
    a = model.heads
    e = act_bytes
    sb = s * b
    if recompute == "full":
        # only the block's input is kept (Table 2: 2 sbh); with SP it is sharded by sequence
        return e * sb * h / (t if sequence_parallel else 1)
    # replicated in the TP region: two norm inputs, the QKV input and the MLP input (e sbh
    # each) and two dropout masks (1 byte each): 10 sbh at e = 2
    replicated = sb * (4 * e * h + 2 * h)
    # sharded by TP: Q and K (for QK^T), V (for AV), the output-projection input, the MLP
    # activation input (k f wide) and the down-projection input (f wide): 24 sbh at e = 2
    sharded = sb * e * (q + kv + kv + q + k * f + f)
    # attention core: softmax output (e), its dropout mask (1 byte), dropout output (e),
    # per head and score: 5 a s^2 b at e = 2
    attn_core = 0.0 if recompute == "selective" or kernel == "flash" else a * s * s * b * (2 * e + 1)
    if sequence_parallel:
        return (replicated + sharded + attn_core) / t
    return replicated + (sharded + attn_core) / t


def logits_bytes(s: int, b: int, vocab: int, t: int, act_bytes: float) -> float:
    """Output layer and loss on the last stage: the logits (activation precision), their fp32
    upcast kept for the cross-entropy backward, and the fp32 gradient of the logits; vocab-
    parallel over TP (Megatron's VocabParallelEmbedding / parallel cross-entropy)."""
    return s * b * vocab / t * (act_bytes + 4.0 + 4.0)
