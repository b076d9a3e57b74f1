"""Hugging Face config.json -> ModelSpec for the dense families (planner/specs/hf.py reads the
file and picks the family; the mixture-of-experts families are hf_moe.py).

Each supported `model_type` names its fields differently; one small mapping per family turns
them into the planner's vocabulary. Field names follow the families' public configuration
classes (transformers' LlamaConfig, GPTNeoXConfig, GPT2Config, BloomConfig, GlmConfig,
Glm4Config; THUDM's remote-code ChatGLMConfig and GLMConfig). Any problem is one SpecError
line naming the field and the fix; nothing here raises anything else for bad input.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from planner.errors import SpecError
from planner.specs.model import ModelSpec

_UNSET = object()


class _Config:
    """Typed access to one parsed config.json, with errors that name the file and field."""

    def __init__(self, data: Mapping[str, Any], where: str) -> None:
        self.data = data
        self.where = where

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def int(self, *keys: str, default: Any = _UNSET) -> int:
        """First present key among `keys`, as a positive integer."""
        for key in keys:
            value = self.data.get(key)
            if value is None:
                continue
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise SpecError(f"{self.where}: {key}", f"must be a positive integer, got {value!r}",
                                "fix the config.json")
            return value
        if default is _UNSET:
            raise SpecError(f"{self.where}: {keys[0]}", "missing",
                            f"add {' or '.join(keys)} to the config.json")
        return default

    def bool(self, key: str, default: bool) -> bool:
        value = self.data.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise SpecError(f"{self.where}: {key}", f"must be true or false, got {value!r}", "fix the config.json")
        return value

    def prob(self, *keys: str, default: float = 0.0) -> float:
        """First present key among `keys`, as a dropout probability in [0, 1)."""
        for key in keys:
            value = self.data.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise SpecError(f"{self.where}: {key}", f"must be a probability in [0, 1), got {value!r}",
                                "fix the config.json")
            return float(value)
        return default

    def dropout(self, hidden: tuple[str, ...], attention: tuple[str, ...]) -> dict[str, float]:
        """hidden_dropout / attention_dropout keyword arguments for ModelSpec."""
        return {"hidden_dropout": self.prob(*hidden), "attention_dropout": self.prob(*attention)}

    def float(self, *keys: str, default: float) -> float:
        """First present key among `keys` (a dotted key reads a nested object), as a positive number."""
        for key in keys:
            value: Any = self.data
            for part in key.split("."):
                value = value.get(part) if isinstance(value, Mapping) else None
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise SpecError(f"{self.where}: {key}", f"must be a positive number, got {value!r}",
                                "fix the config.json")
            return float(value)
        return default

    def str(self, key: str, default: str) -> str:
        value = self.data.get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise SpecError(f"{self.where}: {key}", f"must be a string, got {value!r}", "fix the config.json")
        return value


def _activation(cfg: _Config, key: str, default: str, glu: str | None) -> str:
    """Map an HF activation name to gelu / swiglu / geglu. `glu`: the family's gated form."""
    act = cfg.str(key, default).lower()
    if glu is None:
        return "gelu"          # two-matrix MLP: the nonlinearity itself does not change the cost
    if act in ("silu", "swish"):
        return "swiglu"
    if act.startswith("gelu"):
        return "geglu"
    return glu


def _kv(cfg: _Config, heads: int, key: str) -> int | None:
    kv = cfg.int(key, default=heads)
    return None if kv == heads else kv


def _llama_like(cfg: _Config, name: str, family: str) -> ModelSpec:
    """llama, mistral, qwen2, qwen3 (transformers' LlamaConfig keys), glm (GlmForCausalLM) and
    glm4 (Glm4ForCausalLM): SwiGLU, RMSNorm, rotary, GQA."""
    heads = cfg.int("num_attention_heads")
    llama = family in LLAMA_STYLE
    # a QKV bias: GLM-4 (GlmConfig default True) and Qwen2 (Qwen2Attention's q/k/v have bias=True);
    # llama, mistral and qwen3 have none (Qwen3Config attention_bias default False)
    bias = cfg.bool("attention_bias", family in ("glm", "glm4", "qwen2"))
    # rotary: transformers 5 nests rope_theta / partial_rotary_factor in rope_parameters, older
    # configs keep them at the top level; GLM rotates half of each head in interleaved pairs
    # (GlmConfig default partial_rotary_factor 0.5), llama the whole head with rotate_half
    rope = {"rope_theta": cfg.float("rope_parameters.rope_theta", "rope_theta", default=10000.0),
            "rotary_fraction": min(1.0, cfg.float("rope_parameters.partial_rotary_factor",
                                                  "partial_rotary_factor", default=1.0 if llama else 0.5)),
            "rope_interleaved": not llama,
            "norm_eps": cfg.float("rms_norm_eps", default=1e-6 if llama else 1.5625e-07)}
    return ModelSpec(
        name=name, model_type=family, hidden=cfg.int("hidden_size"), layers=cfg.int("num_hidden_layers"),
        heads=heads, kv_groups=_kv(cfg, heads, "num_key_value_heads"), ffn_hidden=cfg.int("intermediate_size"),
        activation=_activation(cfg, "hidden_act", "silu", "swiglu"), vocab=cfg.int("vocab_size"),
        max_seq=cfg.int("max_position_embeddings", default=4096 if llama else 131072),
        norm="rmsnorm", norm_position="pre", position="rotary", qkv_bias=bias,
        linear_bias=cfg.bool("mlp_bias", False), tied_embeddings=cfg.bool("tie_word_embeddings", False),
        head_dim=cfg.int("head_dim", default=None), **cfg.dropout((), ("attention_dropout",)), **rope)


def _chatglm(cfg: _Config, name: str, family: str) -> ModelSpec:
    """THUDM ChatGLM-6B (GLU-free, post-LN with DeepNorm-style residual scaling) and
    ChatGLM2/3-6B and GLM-4-9B-chat (SwiGLU, RMSNorm, multi-query groups)."""
    heads = cfg.int("num_attention_heads")
    hidden = cfg.int("hidden_size")
    if cfg.has("ffn_hidden_size") or cfg.has("multi_query_attention") or cfg.has("padded_vocab_size"):
        groups = cfg.int("multi_query_group_num") if cfg.bool("multi_query_attention", False) else heads
        return ModelSpec(
            name=name, model_type=family, hidden=hidden, layers=cfg.int("num_layers", "num_hidden_layers"),
            heads=heads, kv_groups=None if groups == heads else groups,
            ffn_hidden=cfg.int("ffn_hidden_size"), activation="swiglu",
            vocab=cfg.int("padded_vocab_size", "vocab_size"), max_seq=cfg.int("seq_length", "max_sequence_length"),
            norm="rmsnorm" if cfg.bool("rmsnorm", True) else "layernorm",
            norm_position="post" if cfg.bool("apply_residual_connection_post_layernorm", False) else "pre",
            position="rotary", qkv_bias=cfg.bool("add_qkv_bias", False), linear_bias=cfg.bool("add_bias_linear", False),
            tied_embeddings=False, head_dim=cfg.int("kv_channels", default=None),
            norm_eps=cfg.float("layernorm_epsilon", default=1e-5),
            rope_theta=10000.0 * cfg.float("rope_ratio", default=1.0),  # modeling_chatglm.py: base * rope_ratio
            **cfg.dropout(("hidden_dropout",), ("attention_dropout",)))
    # ChatGLM-6B (first generation)
    return ModelSpec(
        name=name, model_type=family, hidden=hidden, layers=cfg.int("num_layers"), heads=heads,
        ffn_hidden=cfg.int("inner_hidden_size", default=4 * hidden), activation="gelu",
        vocab=cfg.int("vocab_size"), max_seq=cfg.int("max_sequence_length", "seq_length"),
        norm="layernorm", norm_position="deepnorm", position="rotary", qkv_bias=True, linear_bias=True,
        tied_embeddings=False, **cfg.dropout(("hidden_dropout",), ("attention_dropout",)))


def _glm(cfg: _Config, name: str, family: str) -> ModelSpec:
    """model_type "glm": transformers' GlmForCausalLM (llama-style keys, glm-4-9b-hf) or the
    original THUDM GLM-10B remote-code config (num_layers, max_sequence_length, 4h GELU MLP)."""
    if cfg.has("num_hidden_layers"):
        return _llama_like(cfg, name, family)
    hidden = cfg.int("hidden_size")
    return ModelSpec(
        name=name, model_type=family, hidden=hidden, layers=cfg.int("num_layers"),
        heads=cfg.int("num_attention_heads"), ffn_hidden=cfg.int("intermediate_size", default=4 * hidden),
        activation="gelu", vocab=cfg.int("vocab_size"), max_seq=cfg.int("max_sequence_length"),
        norm="layernorm", norm_position="pre", position="learned", tied_embeddings=True,
        **cfg.dropout(("output_dropout_prob", "hidden_dropout"), ("attention_dropout_prob", "attention_dropout")))


def _gpt_neox(cfg: _Config, name: str, family: str) -> ModelSpec:
    hidden = cfg.int("hidden_size")
    return ModelSpec(
        name=name, model_type=family, hidden=hidden, layers=cfg.int("num_hidden_layers"),
        heads=cfg.int("num_attention_heads"), ffn_hidden=cfg.int("intermediate_size", default=4 * hidden),
        activation="gelu", vocab=cfg.int("vocab_size"), max_seq=cfg.int("max_position_embeddings", default=2048),
        norm="layernorm", norm_position="pre", position="rotary",
        qkv_bias=cfg.bool("attention_bias", True), linear_bias=True,
        tied_embeddings=cfg.bool("tie_word_embeddings", False),
        **cfg.dropout(("hidden_dropout",), ("attention_dropout",)))


def _gpt2(cfg: _Config, name: str, family: str) -> ModelSpec:
    hidden = cfg.int("n_embd", "hidden_size")
    return ModelSpec(
        name=name, model_type=family, hidden=hidden, layers=cfg.int("n_layer", "num_hidden_layers"),
        heads=cfg.int("n_head", "num_attention_heads"), ffn_hidden=cfg.int("n_inner", default=4 * hidden),
        activation="gelu", vocab=cfg.int("vocab_size"), max_seq=cfg.int("n_positions", "n_ctx", default=1024),
        norm="layernorm", norm_position="pre", position="learned",
        tied_embeddings=cfg.bool("tie_word_embeddings", True), **cfg.dropout(("resid_pdrop",), ("attn_pdrop",)))


def _bloom(cfg: _Config, name: str, family: str) -> ModelSpec:
    hidden = cfg.int("hidden_size", "n_embed")
    # ALiBi has no position table; BLOOM trained at sequence length 2048 (Le Scao et al. 2022,
    # arXiv 2211.05100, Table 3), used when the config names none.
    return ModelSpec(
        name=name, model_type=family, hidden=hidden, layers=cfg.int("n_layer", "num_hidden_layers"),
        heads=cfg.int("n_head", "num_attention_heads"), ffn_hidden=4 * hidden, activation="gelu",
        vocab=cfg.int("vocab_size"), max_seq=cfg.int("seq_length", default=2048), norm="layernorm",
        norm_position="pre", position="alibi", tied_embeddings=cfg.bool("tie_word_embeddings", True),
        **cfg.dropout(("hidden_dropout",), ("attention_dropout",)))


LLAMA_STYLE = ("llama", "mistral", "qwen2", "qwen3")
"""Families with llama's layout and rotary convention (whole head, rotate_half)."""
FAMILIES: dict[str, Callable[[_Config, str, str], ModelSpec]] = {
    "chatglm": _chatglm, "glm": _glm, "glm4": _llama_like, "llama": _llama_like, "mistral": _llama_like,
    "qwen2": _llama_like, "qwen3": _llama_like,
    "gpt_neox": _gpt_neox, "gpt2": _gpt2, "bloom": _bloom,
}
