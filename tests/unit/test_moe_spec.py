"""MoE in the model spec: presets with their published shapes, Hugging Face MoE configs,
bad input as one line naming the field."""
import dataclasses

import pytest

from planner.errors import SpecError
from planner.specs.hf import spec_from_hf
from planner.specs.model import ModelSpec
from planner.specs.presets import preset, scale
from planner.specs.moe import MoESpec
from planner.specs.plan import Plan


def test_glm45_air_counts_by_hand():
    m = preset("glm-4.5-air")
    h, q, kv = 4096, 96 * 128, 8 * 128
    attn = h * (q + 2 * kv) + (q + 2 * kv) + q * h               # QKV with bias, output without
    expert = 3 * h * 1408                                         # SwiGLU expert, no bias
    moe_block = attn + 2 * h + h * 128 + expert + 128 * expert    # norms, router, shared, routed
    dense_block = attn + 2 * h + 3 * h * 10944
    emb = 151552 * h
    assert m.params == dense_block + 45 * moe_block + emb + h + emb
    assert m.active_params == dense_block + 45 * (moe_block - 120 * expert) + 2 * emb + h
    # published: 106B total, 12B active (GLM-4.5 report Table 1); MTP layer and embeddings aside
    assert 106e9 < m.params < 107e9
    assert 12.0e9 < m.active_params - 2 * emb < 12.4e9


def test_glm45_published_shape():
    m = preset("glm-4.5")
    assert (m.layers, m.hidden, m.moe.experts, m.moe.top_k, m.moe.first_dense) == (92, 5120, 160, 8, 3)
    assert 352e9 < m.params < 355e9
    assert 31.9e9 < m.active_params - m.embedding_params - m.output_params < 32.3e9


def test_scaled_moe_keeps_experts_small():
    t = scale(preset("glm-4.5-air"), "tiny")
    assert (t.moe.experts, t.moe.top_k, t.moe.first_dense) == (4, 2, 1)
    assert ModelSpec.from_dict(t.to_dict()) == t


GLM45_AIR = {"model_type": "glm4_moe", "hidden_size": 4096, "num_hidden_layers": 46, "num_attention_heads": 96,
             "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 10944, "moe_intermediate_size": 1408,
             "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
             "vocab_size": 151552, "max_position_embeddings": 131072, "attention_bias": True,
             "partial_rotary_factor": 0.5, "rope_theta": 1000000, "rms_norm_eps": 1e-05,
             "tie_word_embeddings": False, "hidden_act": "silu"}


def test_glm4_moe_config_loads_as_the_preset():
    m = spec_from_hf(GLM45_AIR, name="glm-4.5-air")
    assert dataclasses.replace(m, norm_eps=1e-5) == preset("glm-4.5-air")


def test_other_moe_families_load():
    qwen = spec_from_hf({"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
                         "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                         "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                         "num_experts_per_tok": 8, "vocab_size": 151936})
    assert (qwen.moe.experts, qwen.moe.top_k, qwen.moe.router, qwen.moe.first_dense) == (128, 8, "softmax", 0)
    assert 30.0e9 < qwen.params < 31.0e9  # Qwen3-30B-A3B
    mix = spec_from_hf({"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32,
                        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                        "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000})
    assert 46.5e9 < mix.params < 46.8e9 and 12.8e9 < mix.active_params < 13.0e9  # Mixtral 8x7B: 46.7B, 12.9B
    ds = spec_from_hf({"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61,
                       "num_attention_heads": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048,
                       "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
                       "first_k_dense_replace": 3, "vocab_size": 129280, "v_head_dim": 128})
    assert ds.moe.router == "sigmoid" and ds.head_dim == 128


@pytest.mark.parametrize("drop,field", [("n_routed_experts", "n_routed_experts"),
                                        ("num_experts_per_tok", "num_experts_per_tok"),
                                        ("moe_intermediate_size", "moe_intermediate_size")])
def test_missing_expert_field_is_one_line(drop, field):
    cfg = {k: v for k, v in GLM45_AIR.items() if k != drop}
    with pytest.raises(SpecError) as err:
        spec_from_hf(cfg)
    assert field in err.value.line() and "missing" in err.value.line()


def test_bad_moe_fields():
    with pytest.raises(SpecError, match="top_k"):
        MoESpec(experts=4, top_k=8, expert_ffn=16)
    with pytest.raises(SpecError, match="router"):
        MoESpec(experts=4, top_k=2, expert_ffn=16, router="relu")
    with pytest.raises(SpecError, match="imbalance"):
        MoESpec(experts=4, top_k=2, expert_ffn=16, imbalance=0.5)
    with pytest.raises(SpecError, match="moe.expert_ffn"):
        MoESpec.from_dict({"experts": 4, "top_k": 2})
    with pytest.raises(SpecError, match="first_dense"):
        air = preset("glm-4.5-air")
        dataclasses.replace(air, moe=dataclasses.replace(air.moe, first_dense=47))


def test_load_factor_and_drops():
    m = MoESpec(experts=8, top_k=2, expert_ffn=16, capacity_factor=1.25, imbalance=1.5)
    assert m.load_factor == 1.25 and m.dropped_fraction == pytest.approx(1 - 1.25 / 1.5)
    assert MoESpec(experts=8, top_k=2, expert_ffn=16, imbalance=1.2).load_factor == 1.2


def test_plan_ep_must_divide_dp():
    with pytest.raises(SpecError, match="plan.ep"):
        Plan(dp=4, ep=3)
    assert Plan(dp=4, ep=2, cp=2).expert_dp == 4 and Plan(dp=4, cp=2).world_size == 8
