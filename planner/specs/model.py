"""ModelSpec: the shape of a GLM-family (or other decoder) transformer (presets: planner/specs/presets.py).

Parameter counts are computed from the real GEMM shapes (query/key/value projections with
grouped KV heads, two- or three-matrix FFNs), so that GLU and multi-query variants are
counted exactly. For the plain GPT shape this reduces to Megatron-LM eq. 2
(Narayanan et al. 2021, arXiv 2104.04473): P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from planner.errors import SpecError
from planner.specs.strict import check_fields
from planner.specs.moe import MoESpec

NORMS = ("layernorm", "rmsnorm")
NORM_POSITIONS = ("pre", "post", "deepnorm")
ACTIVATIONS = ("gelu", "swiglu", "geglu")
POSITIONS = ("rotary", "learned", "alibi")
ATTENTION_KINDS = ("softmax", "linear")
FFN_ALIGN = 8
"""A pruned FFN keeps a multiple of this many columns, so every TP degree the planner
considers (1, 2, 4, 8: TP stays in a node of 8) divides it."""
SPARSE_GEMM_EFFICIENCY = 1.0
"""Default ModelSpec.sparse_gemm_efficiency. Structured pruning (whole FFN rows/columns
removed) leaves dense, smaller matrices: the GEMM runs at the dense kernel's efficiency for
its size (the profile's gemm_efficiency curve already lowers it for smaller GEMMs), so no
extra penalty (1.0). For semi-structured 2:4 sparsity on Ampere/Hopper sparse tensor cores,
Mishra et al. 2021 ("Accelerating Sparse Deep Neural Networks", arXiv 2104.08378, sec. 4)
measure 1.3-1.6x GEMM speedups where 2x is ideal at F = 0.5: an efficiency of 0.65-0.8
(pass `sparse-gemm-efficiency=0.7` to model that kernel)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer, as the cost model and the executor see it."""

    name: str
    """Preset or config name; used in reports only."""
    hidden: int
    """Hidden size h."""
    layers: int
    """Number of transformer blocks L."""
    heads: int
    """Attention (query) heads a."""
    kv_groups: int | None = None
    """KV heads for grouped/multi-query attention (ChatGLM2+: 2). None: multi-head (= heads)."""
    ffn_hidden: int
    """FFN inner size (per matrix; a GLU FFN has two input matrices of this size)."""
    activation: str = "gelu"
    """gelu (two matrices), swiglu or geglu (GLU: three matrices)."""
    vocab: int
    """Vocabulary size V (padded size as trained)."""
    max_seq: int
    """Longest sequence the model supports."""
    norm: str = "layernorm"
    """layernorm or rmsnorm."""
    norm_position: str = "pre"
    """pre (pre-LN), post (post-LN) or deepnorm (post-LN with DeepNorm scaling, GLM-130B)."""
    position: str = "rotary"
    """rotary, learned (absolute embeddings of max_seq rows) or alibi."""
    qkv_bias: bool = True
    """Bias on the query/key/value projection."""
    linear_bias: bool = True
    """Bias on the attention output and FFN matrices."""
    tied_embeddings: bool = False
    """Output layer shares the input embedding matrix."""
    head_dim: int | None = None
    """Per-head size; None means hidden // heads."""
    model_type: str = "glm"
    """Family the spec came from (preset family or Hugging Face model_type)."""
    hidden_dropout: float = 0.0
    """Dropout probability after the attention output and after the FFN (GLM-10B and GLM-130B
    trained with 0.1, ChatGLM and GLM-4 with 0). The executor runs it; activations count its
    1-byte masks only where it is > 0 (Korthikanti et al. 2022, Table 2)."""
    attention_dropout: float = 0.0
    """Dropout probability on the attention probabilities (GLM-10B, GLM-130B: 0.1)."""
    norm_eps: float = 1e-5
    """Epsilon of every norm (ChatGLM2/3 layernorm_epsilon 1e-5; llama rms_norm_eps 1e-6;
    transformers' GlmConfig 1.5625e-7). The executor uses it; the cost model does not."""
    rope_theta: float = 10000.0
    """Rotary base (llama, GLM: rope_theta; ChatGLM: 10000 x rope_ratio)."""
    rotary_fraction: float = 0.5
    """Share of each head's dims the rotary embedding rotates, the first ones (ChatGLM and GLM:
    half; llama: all)."""
    rope_interleaved: bool = True
    """Rotated pairs: (2i, 2i+1) (ChatGLM, transformers' GlmForCausalLM) or, False, (i, i + r/2)
    (llama's rotate_half)."""
    qk_norm: bool = False
    """RMSNorm over each head's query and key (head_dim weights each, shared by the heads),
    before rotary (GLM-4.5: use_qk_norm; transformers' Glm4MoeAttention q_norm / k_norm)."""
    # --- model-variant what-ifs (docs/variants.md); the defaults are the model as published ---
    attention_kind: str = "softmax"
    """softmax, or linear: causal linear attention with the elu(x) + 1 feature map (Katharopoulos
    et al. 2020, "Transformers are RNNs", arXiv 2006.16236): no s x s scores, a d x d state per
    KV head instead of a KV cache."""
    ffn_sparsity: float = 0.0
    """Share F of the FFN's inner columns pruned (structured: whole rows/columns removed, so
    the matrices are smaller): ffn_size = ffn_hidden x (1 - F), rounded to FFN_ALIGN."""
    share_layers: int = 1
    """K consecutive blocks share one set of parameters (ALBERT-style cross-layer sharing, Lan
    et al. 2019, arXiv 1909.11942): parameters, gradients and optimizer states of layers / K
    blocks; compute and activations of all layers."""
    sparse_gemm_efficiency: float = SPARSE_GEMM_EFFICIENCY
    """Divides the FFN GEMM time of a pruned FFN (ffn_sparsity > 0): see SPARSE_GEMM_EFFICIENCY."""
    moe: MoESpec | None = None
    """Mixture-of-experts FFNs after the first moe.first_dense blocks (planner/specs/moe.py,
    docs/moe.md); None: every block has the dense FFN of ffn_hidden."""

    def __post_init__(self) -> None:
        for field in ("hidden", "layers", "heads", "ffn_hidden", "vocab", "max_seq"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise SpecError(f"model.{field}", f"must be a positive integer, got {value!r}",
                                f"set {field} to a positive integer")
        if self.kv_groups is not None:
            if not isinstance(self.kv_groups, int) or isinstance(self.kv_groups, bool) or self.kv_groups <= 0:
                raise SpecError("model.kv_groups", f"must be a positive integer, got {self.kv_groups!r}",
                                "omit it for multi-head attention")
            if self.heads % self.kv_groups:
                raise SpecError("model.kv_groups", f"{self.kv_groups} does not divide heads={self.heads}",
                                "use a KV group count that divides the head count")
        if self.head_dim is None and self.hidden % self.heads:
            raise SpecError("model.heads", f"{self.heads} does not divide hidden={self.hidden}",
                            "set head_dim or a head count that divides hidden")
        if self.head_dim is not None and (not isinstance(self.head_dim, int) or self.head_dim <= 0):
            raise SpecError("model.head_dim", f"must be a positive integer, got {self.head_dim!r}", "omit it")
        for field in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise SpecError(f"model.{field}", f"must be a probability in [0, 1), got {value!r}",
                                f"set {field} to e.g. 0.1, or 0 for none")
        for field in ("norm_eps", "rope_theta"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise SpecError(f"model.{field}", f"must be a positive number, got {value!r}", "fix the model")
        if (isinstance(self.rotary_fraction, bool) or not isinstance(self.rotary_fraction, (int, float))
                or not 0.0 < self.rotary_fraction <= 1.0):
            raise SpecError("model.rotary_fraction", f"must be in (0, 1], got {self.rotary_fraction!r}",
                            "use 0.5 (ChatGLM, GLM) or 1 (llama)")
        if not isinstance(self.qk_norm, bool):
            raise SpecError("model.qk_norm", f"must be true or false, got {self.qk_norm!r}",
                            "use true (GLM-4.5) or false")
        if not isinstance(self.rope_interleaved, bool):
            raise SpecError("model.rope_interleaved", f"must be true or false, got {self.rope_interleaved!r}",
                            "use true (ChatGLM, GLM) or false (llama)")
        for field, allowed in (("activation", ACTIVATIONS), ("norm", NORMS),
                               ("norm_position", NORM_POSITIONS), ("position", POSITIONS),
                               ("attention_kind", ATTENTION_KINDS)):
            if getattr(self, field) not in allowed:
                raise SpecError(f"model.{field}", f"unknown value {getattr(self, field)!r}",
                                f"use one of {', '.join(allowed)}")
        self._check_variants()
        self._check_moe()

    def _check_moe(self) -> None:
        if self.moe is None:
            return
        if not isinstance(self.moe, MoESpec):
            raise SpecError("model.moe", f"must be a MoESpec, got {type(self.moe).__name__}", "use MoESpec.from_dict")
        if self.moe.first_dense > self.layers:
            raise SpecError("model.moe.first_dense", f"{self.moe.first_dense} exceeds the {self.layers} layers",
                            f"use at most {self.layers} dense layers")
        if self.share_layers > 1 or self.ffn_sparsity:
            raise SpecError("--variant", "share-layers and ffn-sparsity are not modelled for MoE models",
                            "drop the variant for a mixture-of-experts model")

    def _check_variants(self) -> None:
        f, k, g = self.ffn_sparsity, self.share_layers, self.sparse_gemm_efficiency
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f < 1.0:
            raise SpecError("--variant ffn-sparsity", f"must be in (0, 1), got {f!r}",
                            "e.g. --variant ffn-sparsity=0.5 (half the FFN columns pruned)")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1 or self.layers % k:
            raise SpecError("--variant share-layers", f"{k!r} does not divide the {self.layers} layers",
                            f"use a divisor of {self.layers}, e.g. share-layers=2")
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0.0 < g <= 1.0:
            raise SpecError("--variant sparse-gemm-efficiency", f"must be in (0, 1], got {g!r}",
                            "1 for structured pruning (dense smaller GEMMs), ~0.7 for 2:4 sparse kernels")
        if self.attention_kind == "linear" and self.position == "alibi":
            raise SpecError("--variant linear-attention", f"{self.name} uses ALiBi, a bias on the s x s scores "
                            "that linear attention never forms", "use it with a rotary or learned-position model")

    # --- variants ---------------------------------------------------------------------
    @property
    def linear_attention(self) -> bool:
        return self.attention_kind == "linear"

    @property
    def ffn_size(self) -> int:
        """FFN inner size per matrix as built: ffn_hidden, or after pruning ffn_sparsity of it,
        ffn_hidden x (1 - F) rounded to a multiple of FFN_ALIGN (at least FFN_ALIGN)."""
        if not self.ffn_sparsity:
            return self.ffn_hidden
        return max(FFN_ALIGN, int(round(self.ffn_hidden * (1.0 - self.ffn_sparsity) / FFN_ALIGN)) * FFN_ALIGN)

    @property
    def unique_layers(self) -> int:
        """Blocks with parameters of their own: layers / share_layers."""
        return self.layers // self.share_layers

    @property
    def variant_label(self) -> str:
        """'' for the model as published, else e.g. 'linattn+ffn0.5+share2' (reports, names)."""
        parts = []
        if self.linear_attention:
            parts.append("linattn")
        if self.ffn_sparsity:
            parts.append(f"ffn{self.ffn_sparsity:g}")
            if self.sparse_gemm_efficiency != SPARSE_GEMM_EFFICIENCY:
                parts.append(f"sgemm{self.sparse_gemm_efficiency:g}")
        if self.share_layers > 1:
            parts.append(f"share{self.share_layers}")
        return "+".join(parts)

    def base(self) -> "ModelSpec":
        """The same model without variants (the --variant comparison's base column)."""
        label = self.variant_label
        name = self.name[:-len(label) - 1] if label and self.name.endswith("+" + label) else self.name
        return dataclasses.replace(self, name=name, attention_kind="softmax", ffn_sparsity=0.0, share_layers=1,
                                   sparse_gemm_efficiency=SPARSE_GEMM_EFFICIENCY)

    def describe(self) -> str:
        """One line: name, shape and the variant, if any."""
        text = f"{self.name}: {self.layers} x h {self.hidden}, {self.heads} heads, FFN {self.ffn_size}"
        return text + (f" (variant {self.variant_label})" if self.variant_label else "")

    # --- derived shapes -------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.kv_groups if self.kv_groups is not None else self.heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden // self.heads

    @property
    def q_size(self) -> int:
        """Output width of the query projection (heads x head_dim)."""
        return self.heads * self.dim_per_head

    @property
    def kv_size(self) -> int:
        """Output width of each of the key and value projections."""
        return self.kv_heads * self.dim_per_head

    @property
    def glu(self) -> bool:
        return self.activation in ("swiglu", "geglu")

    @property
    def ffn_in_matrices(self) -> int:
        """Number of h x ffn input matrices in the FFN (2 for GLU: gate and up)."""
        return 2 if self.glu else 1

    def padded_vocab(self, tp: int = 1) -> int:
        """The vocabulary rounded up to a multiple of the TP degree, so that each TP rank holds
        an equal slice of the embedding and output layer (Megatron pads the same way). The
        padded rows are never looked up and their logits are excluded from the loss, so every
        TP degree trains the same model; their memory and FLOPs are real and counted."""
        return -(-self.vocab // tp) * tp

    # --- parameter counts -----------------------------------------------------------
    @property
    def attention_params(self) -> int:
        h = self.hidden
        weights = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        biases = (self.q_size + 2 * self.kv_size if self.qkv_bias else 0) + (h if self.linear_bias else 0)
        return weights + biases + (2 * self.dim_per_head if self.qk_norm else 0)  # QK-norm: q and k weights

    @property
    def ffn_params(self) -> int:
        h, f, k = self.hidden, self.ffn_size, self.ffn_in_matrices
        weights = k * h * f + f * h
        biases = (k * f + h) if self.linear_bias else 0
        return weights + biases

    @property
    def norm_params(self) -> int:
        """Parameters of one norm (LayerNorm: weight and bias; RMSNorm: weight)."""
        return 2 * self.hidden if self.norm == "layernorm" else self.hidden

    @property
    def layer_params(self) -> int:
        """One transformer block: attention, FFN and two norms."""
        return self.attention_params + self.ffn_params + 2 * self.norm_params

    @property
    def embedding_params(self) -> int:
        """Input embedding (+ learned positions)."""
        pos = self.max_seq * self.hidden if self.position == "learned" else 0
        return self.vocab * self.hidden + pos

    @property
    def output_params(self) -> int:
        """Final norm and (untied) output projection."""
        return self.norm_params + (0 if self.tied_embeddings else self.vocab * self.hidden)

    # --- mixture of experts (planner/specs/moe.py) -------------------------------------
    @property
    def moe_layers(self) -> int:
        """Blocks whose FFN is a MoE layer (0 for a dense model)."""
        return self.layers - self.moe.first_dense if self.moe else 0

    def _ffn_of(self, f: int) -> int:
        """One FFN of inner size f with the model's activation and biases."""
        h, k = self.hidden, self.ffn_in_matrices
        return k * h * f + f * h + ((k * f + h) if self.linear_bias else 0)

    @property
    def expert_params(self) -> int:
        """One routed expert's FFN."""
        return self._ffn_of(self.moe.expert_ffn) if self.moe else 0

    @property
    def moe_dense_params(self) -> int:
        """The parts of one MoE block every rank holds (not sharded over expert parallelism):
        attention, two norms, the router (h x E; a sigmoid router's E-wide balancing bias is a
        buffer, not a parameter) and the shared experts."""
        m = self.moe
        return (self.attention_params + 2 * self.norm_params + self.hidden * m.experts
                + m.shared_experts * self._ffn_of(m.shared_size))

    @property
    def active_params(self) -> int:
        """Parameters one token runs through (routed experts: top_k of them)."""
        if not self.moe:
            return self.params
        dense = self.moe.first_dense * self.layer_params + self.embedding_params + self.output_params
        return dense + self.moe_layers * (self.moe_dense_params + self.moe.top_k * self.expert_params)

    @property
    def params(self) -> int:
        """Total parameters Psi (shared blocks counted once: unique_layers; MoE blocks with
        every routed expert)."""
        if self.moe:
            moe = self.moe_layers * (self.moe_dense_params + self.moe.experts * self.expert_params)
            return self.moe.first_dense * self.layer_params + moe + self.embedding_params + self.output_params
        return self.unique_layers * self.layer_params + self.embedding_params + self.output_params

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # moe: a nested dict (or None)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelSpec":
        check_fields(cls, data, "model", "pass the model section of a plan.json")
        kw = dict(data)
        if kw.get("moe") is not None:
            kw["moe"] = MoESpec.from_dict(kw["moe"])
        try:
            return cls(**kw)
        except TypeError as exc:
            raise SpecError("model", str(exc), "give every required field") from None
