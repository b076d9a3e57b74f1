"""The built-in models (PRESETS, each field's source cited) and the shrunken scales that run on
CPUs (SCALES, `--scale tiny|small`)."""
from __future__ import annotations

import dataclasses

from planner.errors import SpecError
from planner.specs.model import ModelSpec
from planner.specs.moe import MoESpec

# Public configs; reference/calibration.md "GLM family architectures" and the models'
# Hugging Face config.json files (THUDM/chatglm-6b, chatglm2-6b, chatglm3-6b, glm-4-9b).
PRESETS: dict[str, ModelSpec] = {
    "glm-10b": ModelSpec(
        name="glm-10b", model_type="glm", hidden=4096, layers=48, heads=64, ffn_hidden=16384,
        activation="gelu", vocab=50304, max_seq=1024, norm="layernorm", norm_position="pre",
        position="learned", tied_embeddings=True, hidden_dropout=0.1, attention_dropout=0.1),
    "glm-130b": ModelSpec(
        name="glm-130b", model_type="glm", hidden=12288, layers=70, heads=96, ffn_hidden=32768,
        activation="geglu", vocab=150528, max_seq=2048, norm="layernorm", norm_position="deepnorm",
        position="rotary", tied_embeddings=False, hidden_dropout=0.1, attention_dropout=0.1),
    "chatglm-6b": ModelSpec(
        name="chatglm-6b", model_type="chatglm", hidden=4096, layers=28, heads=32, ffn_hidden=16384,
        activation="gelu", vocab=130528, max_seq=2048, norm="layernorm", norm_position="deepnorm",
        position="rotary", tied_embeddings=False),
    "chatglm2-6b": ModelSpec(
        name="chatglm2-6b", model_type="chatglm", hidden=4096, layers=28, heads=32, kv_groups=2,
        ffn_hidden=13696, activation="swiglu", vocab=65024, max_seq=32768, norm="rmsnorm",
        norm_position="pre", position="rotary", qkv_bias=True, linear_bias=False),
    "chatglm3-6b": ModelSpec(
        name="chatglm3-6b", model_type="chatglm", hidden=4096, layers=28, heads=32, kv_groups=2,
        ffn_hidden=13696, activation="swiglu", vocab=65024, max_seq=8192, norm="rmsnorm",
        norm_position="pre", position="rotary", qkv_bias=True, linear_bias=False),
    "glm-4-9b": ModelSpec(
        name="glm-4-9b", model_type="glm4", hidden=4096, layers=40, heads=32, kv_groups=2,
        ffn_hidden=13696, activation="swiglu", vocab=151552, max_seq=131072, norm="rmsnorm",
        norm_position="pre", position="rotary", qkv_bias=True, linear_bias=False),
    # GLM-4.5 and GLM-4.5-Air (Zeng et al. 2025, "GLM-4.5", arXiv 2508.06471, Table 1; the
    # config.json of zai-org/GLM-4.5 and zai-org/GLM-4.5-Air; the same shapes as Megatron
    # arguments in THUDM/slime scripts/models/glm4.5-355B-A32B.sh and glm4.5-106B-A12B.sh).
    # Air's shape is also transformers 5.24's Glm4MoeConfig default. Rotary on half of each
    # head with rotate_half pairs (transformers glm4_moe apply_rotary_pos_emb), theta 1e6; a QKV
    # bias (--add-qkv-bias), no other bias; sigmoid router with a balancing bias, one shared
    # expert of the routed size, dropless. GLM-4.5 only: QK-norm (use_qk_norm; slime's
    # --qk-layernorm: 2 x 128 weights per layer) and routed_scaling_factor 2.5 (slime's
    # --moe-router-topk-scaling-factor 2.5); GLM-4.5-Air has neither (factor 1.0, no QK-norm:
    # NVIDIA-NeMo/Megatron-Bridge docs/models/llm/glm45.md). Left out: the multi-token-prediction
    # layer (num_nextn_predict_layers 1), which is why the totals here (352.8B, 106.9B; active
    # without embeddings 32.1B, 12.2B, published 32B and 12B: tests/unit/test_moe_spec.py) sit
    # under the published 355B / 106B totals.
    "glm-4.5": ModelSpec(
        name="glm-4.5", model_type="glm4_moe", hidden=5120, layers=92, heads=96, kv_groups=8, head_dim=128,
        ffn_hidden=12288, activation="swiglu", vocab=151552, max_seq=131072, norm="rmsnorm", norm_position="pre",
        position="rotary", qkv_bias=True, linear_bias=False, rope_theta=1e6, rope_interleaved=False, qk_norm=True,
        moe=MoESpec(experts=160, top_k=8, expert_ffn=1536, shared_experts=1, first_dense=3, router="sigmoid",
                    routed_scale=2.5)),
    "glm-4.5-air": ModelSpec(
        name="glm-4.5-air", model_type="glm4_moe", hidden=4096, layers=46, heads=96, kv_groups=8, head_dim=128,
        ffn_hidden=10944, activation="swiglu", vocab=151552, max_seq=131072, norm="rmsnorm", norm_position="pre",
        position="rotary", qkv_bias=True, linear_bias=False, rope_theta=1e6, rope_interleaved=False,
        moe=MoESpec(experts=128, top_k=8, expert_ffn=1408, shared_experts=1, first_dense=1, router="sigmoid")),
}

# --scale shrinks a preset to run on a CPU machine: fewer layers, smaller hidden, same
# shape family (norm, activation, GQA ratio, biases, position scheme).
SCALES: dict[str, dict[str, int]] = {
    # MoE presets also shrink their experts (scale_moe): 4 routed experts (top-2) at tiny,
    # 8 (top-2) at small, one dense block first where the original has any
    "tiny": {"hidden": 128, "layers": 4, "heads": 4, "vocab": 1024, "max_seq": 256},
    "small": {"hidden": 512, "layers": 8, "heads": 8, "vocab": 8192, "max_seq": 1024},
}


def scale(spec: ModelSpec, size: str | None) -> ModelSpec:
    """Shrink a spec to `size` (tiny|small), keeping its family; None or 'full' returns it."""
    if size in (None, "full"):
        return spec
    if size not in SCALES:
        raise SpecError("--scale", f"unknown scale {size!r}", f"use one of full, {', '.join(SCALES)}")
    s = SCALES[size]
    ratio = spec.ffn_hidden / spec.hidden
    kv = None
    if spec.kv_groups is not None:
        # keep attention grouped (>= 2 KV groups where the original had >= 2) so TP 2 stays legal
        kv = max(min(2, spec.kv_groups, s["heads"]), s["heads"] * spec.kv_groups // spec.heads)
        while s["heads"] % kv:
            kv -= 1
    return dataclasses.replace(
        spec, name=f"{spec.name}-{size}", hidden=s["hidden"], layers=s["layers"], heads=s["heads"],
        kv_groups=kv, ffn_hidden=int(round(s["hidden"] * ratio / 8)) * 8, vocab=s["vocab"],
        max_seq=min(spec.max_seq, s["max_seq"]), head_dim=None, moe=scale_moe(spec, size))


def scale_moe(spec: ModelSpec, size: str) -> MoESpec | None:
    """The MoE part at a CPU scale: experts 4 (tiny) or 8 (small), top-k min(2, k), expert FFN
    shrunk by the hidden size's ratio (multiple of 8), at most one dense block first."""
    m = spec.moe
    if m is None:
        return None
    ratio = SCALES[size]["hidden"] / spec.hidden
    experts = 4 if size == "tiny" else 8
    return dataclasses.replace(
        m, experts=experts, top_k=min(2, m.top_k), expert_ffn=max(8, int(round(m.expert_ffn * ratio / 8)) * 8),
        shared_ffn=max(8, int(round(m.shared_ffn * ratio / 8)) * 8) if m.shared_ffn else 0,
        first_dense=min(1, m.first_dense))


def preset(name: str) -> ModelSpec:
    key = name.strip().lower()
    if key not in PRESETS:
        raise SpecError("--model", f"unknown model {name!r}",
                        f"use a preset ({', '.join(PRESETS)}) or a path to a Hugging Face config.json")
    return PRESETS[key]
