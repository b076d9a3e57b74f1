"""Hugging Face config.json -> ModelSpec for the mixture-of-experts families.

Field names follow transformers 5.24's configuration classes: Glm4MoeConfig (GLM-4.5 and
GLM-4.5-Air), Qwen3MoeConfig, MixtralConfig, DeepseekV3Config. The attention and dense parts
read as the llama-like families do (planner/specs/hf_dense.py); the expert fields are required: a MoE
config without them is one SpecError naming the missing key.

DeepSeek-V3's multi-head latent attention (MLA: low-rank q and kv projections, q_lora_rank,
kv_lora_rank) is not modelled: it loads as multi-head attention of num_attention_heads heads of
v_head_dim, which over-counts its attention parameters (about 0.47B per layer instead of about
0.19B, some 17B of 671B) and leaves out MLA's compressed KV. docs/moe.md says so.
"""
from __future__ import annotations

import dataclasses

from planner.errors import SpecError
from planner.specs.hf_dense import _Config, _llama_like
from planner.specs.model import ModelSpec
from planner.specs.moe import MoESpec


def _dense_prefix(cfg: _Config) -> int:
    """Qwen3-MoE's dense blocks: mlp_only_layers must be a prefix 0..k-1 and decoder_sparse_step 1
    (the planner's blocks are dense first, then MoE)."""
    step = cfg.int("decoder_sparse_step", default=1)
    only = cfg.data.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(not isinstance(i, int) or isinstance(i, bool) for i in only):
        raise SpecError(f"{cfg.where}: mlp_only_layers", "must be a list of layer indices", "fix the config.json")
    if step != 1 or sorted(only) != list(range(len(only))):
        raise SpecError(f"{cfg.where}: mlp_only_layers", "dense blocks other than the first k are not modelled",
                        "use decoder_sparse_step 1 and mlp_only_layers [0, ..., k-1] (or [])")
    return len(only)


def _moe(cfg: _Config, base: ModelSpec, **kw) -> ModelSpec:
    return dataclasses.replace(base, moe=MoESpec(**kw))


def _glm4_moe(cfg: _Config, name: str, family: str) -> ModelSpec:
    """GLM-4.5 / GLM-4.5-Air: sigmoid router with a balancing bias (Glm4MoeTopkRouter), shared
    experts of the routed size, the first first_k_dense_replace blocks dense; rotary on
    partial_rotary_factor (0.5) of each head with rotate_half pairs."""
    base = dataclasses.replace(_llama_like(cfg, name, family), rope_interleaved=False,
                               qkv_bias=cfg.bool("attention_bias", False), qk_norm=cfg.bool("use_qk_norm", False))
    scale = cfg.data.get("routed_scaling_factor", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise SpecError(f"{cfg.where}: routed_scaling_factor", f"must be a number, got {scale!r}",
                        "fix the config.json (GLM-4.5: 2.5, GLM-4.5-Air: 1.0)")
    return _moe(cfg, base, experts=cfg.int("n_routed_experts", "num_local_experts"),
                top_k=cfg.int("num_experts_per_tok"), expert_ffn=cfg.int("moe_intermediate_size"),
                shared_experts=cfg.data.get("n_shared_experts") or 0,
                first_dense=cfg.data.get("first_k_dense_replace") or 0, router="sigmoid",
                routed_scale=float(scale))


def _qwen3_moe(cfg: _Config, name: str, family: str) -> ModelSpec:
    """Qwen3-MoE: softmax router, no shared experts, whole-head rotary (llama style)."""
    base = dataclasses.replace(_llama_like(cfg, name, "llama"), model_type=family,
                               qkv_bias=cfg.bool("attention_bias", False))
    return _moe(cfg, base, experts=cfg.int("num_experts", "num_local_experts"), top_k=cfg.int("num_experts_per_tok"),
                expert_ffn=cfg.int("moe_intermediate_size"), first_dense=_dense_prefix(cfg), router="softmax")


def _mixtral(cfg: _Config, name: str, family: str) -> ModelSpec:
    """Mixtral: every block MoE, each expert an FFN of intermediate_size, softmax top-2."""
    base = dataclasses.replace(_llama_like(cfg, name, "llama"), model_type=family, qkv_bias=False)
    return _moe(cfg, base, experts=cfg.int("num_local_experts", "num_experts"), top_k=cfg.int("num_experts_per_tok"),
                expert_ffn=cfg.int("intermediate_size"), router="softmax")


def _deepseek_v3(cfg: _Config, name: str, family: str) -> ModelSpec:
    """DeepSeek-V3 without MLA (module docstring): heads of v_head_dim, sigmoid router."""
    heads = cfg.int("num_attention_heads")
    base = dataclasses.replace(_llama_like(cfg, name, "llama"), model_type=family, qkv_bias=False,
                               kv_groups=None, head_dim=cfg.int("v_head_dim", default=128))
    if base.heads != heads:
        raise SpecError(f"{cfg.where}: num_attention_heads", "inconsistent", "fix the config.json")
    return _moe(cfg, base, experts=cfg.int("n_routed_experts"), top_k=cfg.int("num_experts_per_tok"),
                expert_ffn=cfg.int("moe_intermediate_size"), shared_experts=cfg.data.get("n_shared_experts") or 0,
                first_dense=cfg.data.get("first_k_dense_replace") or 0,
                router="sigmoid" if cfg.str("scoring_func", "sigmoid") == "sigmoid" else "softmax")


MOE_FAMILIES = {"glm4_moe": _glm4_moe, "qwen3_moe": _qwen3_moe, "mixtral": _mixtral, "deepseek_v3": _deepseek_v3}
