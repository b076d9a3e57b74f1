"""Hugging Face config.json -> ModelSpec, per family, against the public configs' numbers."""
from __future__ import annotations

import json

import pytest

from planner.errors import SpecError
from planner.specs.hf import FAMILIES, load_hf_config, spec_from_hf
from planner.specs.presets import PRESETS

# Field values copied from the public config.json files named in each case.
CHATGLM3_6B = {  # THUDM/chatglm3-6b
    "model_type": "chatglm", "hidden_size": 4096, "num_layers": 28, "num_attention_heads": 32,
    "multi_query_attention": True, "multi_query_group_num": 2, "ffn_hidden_size": 13696, "padded_vocab_size": 65024,
    "seq_length": 8192, "rmsnorm": True, "add_qkv_bias": True, "add_bias_linear": False, "kv_channels": 128,
    "apply_residual_connection_post_layernorm": False}
CHATGLM_6B = {  # THUDM/chatglm-6b
    "model_type": "chatglm", "hidden_size": 4096, "num_layers": 28, "num_attention_heads": 32,
    "inner_hidden_size": 16384, "vocab_size": 130528, "max_sequence_length": 2048, "position_encoding_2d": True}
GLM4_9B_CHAT = dict(CHATGLM3_6B, num_layers=40, padded_vocab_size=151552, seq_length=131072)  # THUDM/glm-4-9b-chat
LLAMA2_7B = {  # meta-llama/Llama-2-7b-hf
    "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 32000, "max_position_embeddings": 4096,
    "hidden_act": "silu", "tie_word_embeddings": False}
LLAMA3_8B = dict(LLAMA2_7B, num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                 max_position_embeddings=8192)  # meta-llama/Meta-Llama-3-8B
GLM4_HF = {  # THUDM/glm-4-9b-hf (transformers GlmConfig)
    "model_type": "glm", "hidden_size": 4096, "num_hidden_layers": 40, "num_attention_heads": 32,
    "num_key_value_heads": 2, "intermediate_size": 13696, "vocab_size": 151552, "max_position_embeddings": 131072,
    "head_dim": 128, "attention_bias": True, "hidden_act": "silu"}
GLM4_0414 = dict(GLM4_HF, model_type="glm4", num_hidden_layers=40, intermediate_size=13696)  # THUDM/GLM-4-9B-0414
GLM_10B = {  # THUDM/glm-10b
    "model_type": "glm", "hidden_size": 4096, "num_layers": 48, "num_attention_heads": 64, "vocab_size": 50304,
    "max_sequence_length": 1024}
PYTHIA_1B = {  # EleutherAI/pythia-1b
    "model_type": "gpt_neox", "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 8,
    "intermediate_size": 8192, "vocab_size": 50304, "max_position_embeddings": 2048, "tie_word_embeddings": False}
GPT2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None, "vocab_size": 50257,
        "n_positions": 1024}  # openai-community/gpt2
BLOOM_560M = {"model_type": "bloom", "hidden_size": 1024, "n_layer": 24, "n_head": 16, "vocab_size": 250880}


def test_chatglm3_matches_the_preset():
    spec = spec_from_hf(CHATGLM3_6B, name="chatglm3-6b")
    preset = PRESETS["chatglm3-6b"]
    for f in ("hidden", "layers", "heads", "kv_heads", "ffn_hidden", "activation", "vocab", "max_seq", "norm",
              "qkv_bias", "linear_bias", "params"):
        assert getattr(spec, f) == getattr(preset, f), f


def test_chatglm_first_generation_and_glm4_chat():
    assert spec_from_hf(CHATGLM_6B).params == PRESETS["chatglm-6b"].params
    assert spec_from_hf(GLM4_9B_CHAT).params == PRESETS["glm-4-9b"].params


def test_glm_both_dialects():
    assert spec_from_hf(GLM_10B).params == PRESETS["glm-10b"].params
    hf = spec_from_hf(GLM4_HF)
    assert (hf.kv_heads, hf.activation, hf.norm, hf.qkv_bias) == (2, "swiglu", "rmsnorm", True)
    assert hf.params == PRESETS["glm-4-9b"].params
    assert spec_from_hf(GLM4_0414).params == PRESETS["glm-4-9b"].params


def test_llama_parameter_counts():
    # Llama-2-7B has 6,738,415,616 parameters (the model card's "7B"; sum of its tensors)
    assert spec_from_hf(LLAMA2_7B).params == 6_738_415_616
    # Llama-3-8B: 8,030,261,248
    assert spec_from_hf(LLAMA3_8B).params == 8_030_261_248


def test_gpt_families():
    assert spec_from_hf(GPT2).params == 124_439_808           # GPT-2 small, tied embeddings
    neox = spec_from_hf(PYTHIA_1B)
    assert neox.params == 1_011_781_632                        # pythia-1b
    bloom = spec_from_hf(BLOOM_560M)
    assert (bloom.position, bloom.ffn_hidden, bloom.max_seq) == ("alibi", 4096, 2048)
    # bloom-560m has 559,214,592; ModelSpec has no slot for BLOOM's embedding LayerNorm (2h)
    assert bloom.params == 559_214_592 - 2 * 1024


def test_load_file_and_name(tmp_path):
    d = tmp_path / "my-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA2_7B))
    assert load_hf_config(d / "config.json").name == "my-model"
    assert load_hf_config(d).name == "my-model"


@pytest.mark.parametrize("data,field", [
    ({"model_type": "mamba"}, "model_type"),
    ({"hidden_size": 1}, "model_type"),
    (dict(LLAMA2_7B, hidden_size="4096"), "hidden_size"),
    (dict(LLAMA2_7B, num_attention_heads={"a": 1}), "num_attention_heads"),
    (dict(LLAMA2_7B, tie_word_embeddings="yes"), "tie_word_embeddings"),
    ({k: v for k, v in LLAMA2_7B.items() if k != "vocab_size"}, "vocab_size"),
    ([1, 2], "config.json"),
])
def test_bad_configs_are_one_line(data, field):
    with pytest.raises(SpecError) as err:
        spec_from_hf(data)
    line = err.value.line()
    assert field in line and "\n" not in line


def test_unknown_type_lists_the_supported_ones():
    with pytest.raises(SpecError) as err:
        spec_from_hf({"model_type": "t5"})
    assert all(f in err.value.line() for f in FAMILIES)


@pytest.mark.parametrize("text", ['{"model_type": "llama", "hidden_size": 40', "", "\xff\xfe", "[" * 100000])
def test_malformed_files(tmp_path, text):
    p = tmp_path / "config.json"
    p.write_text(text, encoding="latin-1")
    with pytest.raises(SpecError) as err:
        load_hf_config(p)
    assert "\n" not in err.value.line()


def test_norm_eps_and_rotary_convention_per_family():
    """What the executor needs to compute what transformers / THUDM's code compute."""
    llama = spec_from_hf(dict(LLAMA3_8B, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                              rms_norm_eps=1e-5))
    assert (llama.rope_theta, llama.rotary_fraction, llama.rope_interleaved, llama.norm_eps) == (5e5, 1.0, False, 1e-5)
    old_style = spec_from_hf(dict(LLAMA2_7B, rope_theta=10000.0))  # pre-5.0 configs: top-level keys
    assert (old_style.rope_theta, old_style.norm_eps) == (1e4, 1e-6)
    glm = spec_from_hf(dict(GLM4_HF, partial_rotary_factor=0.5, rope_theta=10000.0, rms_norm_eps=1.5625e-07))
    assert (glm.rope_theta, glm.rotary_fraction, glm.rope_interleaved, glm.norm_eps) == (1e4, 0.5, True, 1.5625e-7)
    chat = spec_from_hf(dict(GLM4_9B_CHAT, rope_ratio=500, layernorm_epsilon=1.5625e-07))  # THUDM/glm-4-9b-chat
    assert (chat.rope_theta, chat.rotary_fraction, chat.rope_interleaved, chat.norm_eps) == (5e6, 0.5, True, 1.5625e-7)
    assert spec_from_hf(CHATGLM3_6B).rope_theta == 10000.0 and spec_from_hf(CHATGLM3_6B).norm_eps == 1e-5
    with pytest.raises(SpecError, match="rope_theta"):
        spec_from_hf(dict(LLAMA2_7B, rope_theta=-1))


def test_qwen3_and_mistral_configs_are_llama_style():
    # Qwen3-8B's config.json (published parameter count 8.2B) and Mistral-7B-v0.3's (7.25B)
    q3 = {"model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
          "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936,
          "max_position_embeddings": 40960, "rope_theta": 1000000, "tie_word_embeddings": False,
          "hidden_act": "silu", "rms_norm_eps": 1e-6}
    m = spec_from_hf(q3, "qwen3-8b")
    assert m.params == 8_190_726_144 and not m.qkv_bias and m.kv_heads == 8 and m.max_seq == 40960
    mi = {"model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
          "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32768,
          "max_position_embeddings": 32768, "hidden_act": "silu"}
    assert spec_from_hf(mi, "mistral-7b").params == 7_248_023_552
    assert spec_from_hf({**q3, "model_type": "qwen2"}, "q2").qkv_bias  # Qwen2's q/k/v carry a bias
