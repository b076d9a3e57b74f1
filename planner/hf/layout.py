"""Hugging Face checkpoint layouts <-> the executor's parameter names, shapes and configs.

Layouts (parameter names of the families' public modeling code):
- llama (transformers' LlamaForCausalLM): model.embed_tokens, model.layers.N.self_attn.{q,k,v,o}_proj,
  model.layers.N.mlp.{gate,up,down}_proj, model.layers.N.{input,post_attention}_layernorm,
  model.norm, lm_head (absent when tie_word_embeddings);
- glm (transformers' GlmForCausalLM, THUDM/glm-4-9b-hf): as llama, but the MLP's gate and up
  are one fused mlp.gate_up_proj ([gate | up], like ChatGLM's dense_h_to_4h);
- chatglm (THUDM's remote-code ChatGLM2/3 and GLM-4-9B-chat, modeling_chatglm.py):
  transformer.embedding.word_embeddings, transformer.encoder.layers.N.self_attention.
  {query_key_value, dense}, .mlp.{dense_h_to_4h, dense_4h_to_h}, .{input,post_attention}_layernorm,
  transformer.encoder.final_layernorm, transformer.output_layer. These are the executor's own
  names (`p.canonical`), so the mapping is a prefix;
- glm4_moe (transformers' Glm4MoeForCausalLM: GLM-4.5-Air, zai-org checkpoints): as llama for
  attention, norms and the dense first blocks (first_k_dense_replace); a MoE block's router is
  model.layers.N.mlp.gate.weight [E, h] with its balancing bias mlp.gate.e_score_correction_bias
  [E] (a buffer: read and written, never trained), each routed expert
  mlp.experts.E.{gate,up,down}_proj.weight (the per-expert names the published checkpoints use
  and transformers 5.24 converts on load to its stacked experts.gate_up_proj / down_proj:
  conversion_mapping.py "qwen2_moe"), the shared experts mlp.shared_experts.{gate,up,down}_proj
  (n_shared_experts x moe_intermediate_size columns). The executor's names: layers.N.mlp.router,
  layers.N.mlp.experts.E.dense_{h_to_4h,4h_to_h}, layers.N.mlp.shared_experts.dense_*.
  GLM-4.5's QK-norm (use_qk_norm) is model.layers.N.self_attn.{q,k}_norm.weight [head_dim]
  (the executor's layers.N.self_attention.{q,k}_norm.weight) and its routed_scaling_factor is
  MoESpec.routed_scale. Glm4Moe's routing options the executor's router does not have are
  refused on load (moe_config_problem): n_group > 1, norm_topk_prob false.

The executor fuses [q | k | v] and [gate | up] along the output rows, and the query heads of
one KV group are consecutive (head i reads KV group i // (heads / kv), as transformers'
repeat_kv and ChatGLM's expand do), so the fused tensor is the plain concatenation
cat(q_proj, k_proj, v_proj) and cat(gate_proj, up_proj): no row permutation. The rotary
conventions differ between families (llama: rotate_half over the whole head; GLM and
ChatGLM: interleaved pairs over the first half) and are carried by the ModelSpec
(rotary_fraction, rope_interleaved, rope_theta), which is read from the same config.json.

Also here: the checkpoint directory (config.json and safetensors headers; tensors read lazily,
slice by slice), its header-only check against the plan's model, the layout a save writes and
the config.json it generates. Moving the values in and out of the sharded model (slices on
load; ZeRO-3, TP and PP gathers and the atomic write on save) is planner/hf/weights.py.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from planner.errors import SpecError
from planner.specs.hf import spec_from_hf
from planner.specs.model import ModelSpec

LAYOUTS = ("llama", "glm", "chatglm", "glm4_moe")
FIELD = "--init-hf"
INDEX = "model.safetensors.index.json"
COMPARED = ("hidden", "layers", "heads", "kv_heads", "dim_per_head", "ffn_hidden", "activation", "vocab", "norm",
            "norm_position", "position", "qkv_bias", "linear_bias", "tied_embeddings", "norm_eps", "rope_theta",
            "rotary_fraction", "rope_interleaved", "qk_norm")
"""ModelSpec fields a checkpoint's config.json must agree on with the plan's model (shape and math)."""


# --- names ----------------------------------------------------------------------------------------


def layout_for(model_type: str, where: str = FIELD) -> str:
    """The checkpoint layout of a config's model_type."""
    if model_type in LAYOUTS:
        return model_type
    if model_type == "glm4":
        raise SpecError(where, "model_type glm4 (Glm4ForCausalLM) adds post-attention and post-MLP norms the "
                        "executor does not build", "use a llama, glm (GlmForCausalLM) or chatglm checkpoint")
    raise SpecError(where, f"no weight mapping for model_type {model_type!r}",
                    f"use a checkpoint of type {', '.join(LAYOUTS)}")


def check_supported(spec: ModelSpec, layout: str, where: str = FIELD) -> None:
    """The executor's block must be the family's block for the weights to mean the same."""
    if (spec.norm, spec.norm_position, spec.position, spec.activation) != ("rmsnorm", "pre", "rotary", "swiglu"):
        raise SpecError(where, f"{spec.name}: {layout} weights need a pre-RMSNorm, rotary, SwiGLU model; this one is "
                        f"{spec.norm_position}-{spec.norm}, {spec.position}, {spec.activation}",
                        "use a llama, GLM-4 or ChatGLM2/3 model")
    if (layout == "glm4_moe") != (spec.moe is not None):
        raise SpecError(where, f"{spec.name} is {'a mixture-of-experts' if spec.moe else 'a dense'} model, "
                        f"the {layout} layout is {'MoE' if layout == 'glm4_moe' else 'dense'}",
                        "use a glm4_moe checkpoint for a MoE model" if spec.moe else
                        "use a llama, glm or chatglm checkpoint for a dense model")
    if spec.qk_norm and layout != "glm4_moe":
        raise SpecError(where, f"{spec.name} has QK-norm, which the {layout} layout has no tensors for",
                        "use a glm4_moe checkpoint (GLM-4.5) or a model without QK-norm")
    if layout == "llama" and spec.qkv_bias != spec.linear_bias:
        raise SpecError(where, "llama with attention_bias != mlp_bias: the executor's attention output bias follows "
                        "the MLP's", "use a checkpoint with both biases or neither")
    if layout == "glm" and spec.linear_bias:
        raise SpecError(where, "GlmForCausalLM has no o_proj or MLP bias, the model has linear_bias",
                        "re-plan with the checkpoint's config.json")
    if layout == "glm4_moe" and (spec.moe.router != "sigmoid" or spec.linear_bias):
        raise SpecError(where, f"{spec.name}: Glm4MoeForCausalLM has a sigmoid router and no o_proj or MLP bias; "
                        f"this model has a {spec.moe.router} router{' and linear_bias' if spec.linear_bias else ''}",
                        "re-plan with the checkpoint's config.json")


MOE_COMPARED = ("experts", "top_k", "expert_ffn", "shared_experts", "shared_size", "first_dense", "router",
                "routed_scale")
"""MoESpec fields a glm4_moe checkpoint's config.json must agree on with the plan's model."""


def moe_config_problem(config: dict[str, Any]) -> tuple[str, str, str] | None:
    """(key, what is wrong, fix) for a Glm4MoeConfig option the executor's block does not compute
    (planner/model/moe.py Router: top-k of sigmoid + bias over all experts, weights normalised
    then scaled by routed_scaling_factor), else None. Defaults are transformers 5.24's
    Glm4MoeConfig."""
    checks = (("n_group", 1, "group-limited routing is not built by the executor's router"),
              ("norm_topk_prob", True, "the executor's router always normalises the top-k weights"))
    for key, want, why in checks:
        got = config.get(key, want)
        if got != want and not (key == "n_group" and got is None):
            return key, f"{key} = {got!r}: {why}", f"use a checkpoint with {key} {json.dumps(want)} (GLM-4.5-Air's)"
    return None


def sources(canonical: str, spec: ModelSpec, layout: str) -> list[tuple[str, int]]:
    """The Hugging Face tensors whose concatenation along dim 0 is the executor's unsplit
    parameter `canonical`: [(name, rows)]."""
    q, kv, f, h = spec.q_size, spec.kv_size, spec.ffn_hidden, spec.hidden
    parts = canonical.split(".")
    if ".mlp.router." in canonical:  # glm4_moe (check_supported refuses MoE in the other layouts)
        return [(f"model.layers.{parts[1]}.mlp.gate.{parts[-1]}", spec.moe.experts)]
    if ".mlp.experts." in canonical or ".mlp.shared_experts." in canonical:
        pre = "model." + ".".join(parts[:-2])  # model.layers.N.mlp.experts.E / model.layers.N.mlp.shared_experts
        rows = full_shape(canonical, spec)[0]
        if parts[-2] == "dense_h_to_4h":
            return [(f"{pre}.gate_proj.{parts[-1]}", rows // 2), (f"{pre}.up_proj.{parts[-1]}", rows // 2)]
        return [(f"{pre}.down_proj.{parts[-1]}", rows)]
    if ".self_attention.q_norm." in canonical or ".self_attention.k_norm." in canonical:  # QK-norm (glm4_moe)
        return [(f"model.layers.{parts[1]}.self_attn.{parts[-2]}.{parts[-1]}", spec.dim_per_head)]
    if layout == "chatglm":
        if parts[0] == "layers":
            name = "transformer.encoder." + canonical
        elif canonical.startswith("head.final_layernorm"):
            name = "transformer.encoder." + canonical[len("head."):]
        elif canonical.startswith("head."):
            name = "transformer." + canonical[len("head."):]
        else:
            name = "transformer." + canonical
        return [(name, full_shape(canonical, spec)[0])]
    if canonical == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", spec.vocab)]
    if canonical == "head.final_layernorm.weight":
        return [("model.norm.weight", h)]
    if canonical == "head.output_layer.weight":
        return [("lm_head.weight", spec.vocab)]
    i, module, leaf = parts[1], ".".join(parts[2:-1]), parts[-1]
    pre = f"model.layers.{i}."
    if module == "self_attention.query_key_value":
        return [(f"{pre}self_attn.{p}_proj.{leaf}", n) for p, n in (("q", q), ("k", kv), ("v", kv))]
    if module == "self_attention.dense":
        return [(f"{pre}self_attn.o_proj.{leaf}", h)]
    if module == "mlp.dense_h_to_4h":
        if layout == "glm":
            return [(f"{pre}mlp.gate_up_proj.{leaf}", 2 * f)]
        return [(f"{pre}mlp.gate_proj.{leaf}", f), (f"{pre}mlp.up_proj.{leaf}", f)]
    if module == "mlp.dense_4h_to_h":
        return [(f"{pre}mlp.down_proj.{leaf}", h)]
    if module in ("input_layernorm", "post_attention_layernorm"):
        return [(f"{pre}{module}.{leaf}", h)]
    raise ValueError(f"no {layout} name for {canonical}")


def full_shape(canonical: str, spec: ModelSpec) -> tuple[int, ...]:
    """Shape of the executor's unsplit parameter, with the real (unpadded) vocabulary."""
    q, kv, f, h = spec.q_size, spec.kv_size, spec.ffn_hidden, spec.hidden
    if canonical in ("embedding.word_embeddings.weight", "head.output_layer.weight"):
        return spec.vocab, h
    if ".mlp.router." in canonical:
        return (spec.moe.experts,) + ((h,) if canonical.endswith(".weight") else ())
    if canonical.split(".")[-2] in ("q_norm", "k_norm"):
        return (spec.dim_per_head,)
    if ".mlp.experts." in canonical:
        f = spec.moe.expert_ffn
    elif ".mlp.shared_experts." in canonical:
        f = spec.moe.shared_experts * spec.moe.shared_size
    leaf = canonical.rsplit(".", 1)[1]
    rows = {"query_key_value": q + 2 * kv, "dense": h, "dense_h_to_4h": spec.ffn_in_matrices * f,
            "dense_4h_to_h": h}.get(canonical.split(".")[-2], h)
    if leaf == "bias" or canonical.split(".")[-2].endswith("layernorm"):
        return (rows,)
    cols = {"dense": q, "dense_4h_to_h": f}.get(canonical.split(".")[-2], h)
    return rows, cols


def canonical_names(spec: ModelSpec) -> list[str]:
    """Every parameter of the whole model, in model order (the executor's names); for a MoE
    model also the routers' balancing bias (a buffer, BUFFERS)."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(spec.layers):
        p = f"layers.{i}."
        names += [p + "input_layernorm.weight", p + "self_attention.query_key_value.weight"]
        names += [p + "self_attention.query_key_value.bias"] if spec.qkv_bias else []
        names += [p + "self_attention.q_norm.weight", p + "self_attention.k_norm.weight"] if spec.qk_norm else []
        names += [p + "self_attention.dense.weight"] + ([p + "self_attention.dense.bias"] if spec.linear_bias else [])
        names.append(p + "post_attention_layernorm.weight")
        ffns = [p + "mlp."]
        if spec.moe is not None and i >= spec.moe.first_dense:  # planner/model/moe.py's names
            names += [p + "mlp.router.weight", p + "mlp.router.e_score_correction_bias"]
            ffns = [f"{p}mlp.experts.{e}." for e in range(spec.moe.experts)]
            ffns += [p + "mlp.shared_experts."] if spec.moe.shared_experts else []
        for m in ffns:
            names += [m + "dense_h_to_4h.weight"] + ([m + "dense_h_to_4h.bias"] if spec.linear_bias else [])
            names += [m + "dense_4h_to_h.weight"] + ([m + "dense_4h_to_h.bias"] if spec.linear_bias else [])
    names.append("head.final_layernorm.weight")
    if not spec.tied_embeddings:
        names.append("head.output_layer.weight")
    return names


def expected_tensors(spec: ModelSpec, layout: str) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensors and their shapes, in model order."""
    out: dict[str, tuple[int, ...]] = {}
    for c in canonical_names(spec):
        shape = full_shape(c, spec)
        for name, rows in sources(c, spec, layout):
            out[name] = (rows,) + shape[1:]
    return out


# --- the checkpoint directory ---------------------------------------------------------------------


class Checkpoint:
    """A Hugging Face checkpoint directory: config.json and safetensors (one file, several, or
    sharded with model.safetensors.index.json). Tensors are read lazily, slice by slice."""

    def __init__(self, path: str | Path, field: str = FIELD) -> None:
        self.path, self.field = Path(path), field
        if not self.path.is_dir():
            raise SpecError(field, f"{self.path} is not a directory",
                            "give a Hugging Face checkpoint directory (config.json + *.safetensors)")
        cfg = self.path / "config.json"
        try:
            self.config = json.loads(cfg.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise SpecError(field, f"{self.path} has no config.json",
                            "give a Hugging Face checkpoint directory (config.json + *.safetensors)") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SpecError(field, f"cannot read {cfg}: {exc}", "repair or re-download the config.json") from None
        if not isinstance(self.config, dict):
            raise SpecError(field, f"{cfg} is not a JSON object", "give a Hugging Face config.json")
        self.where = self._weight_map()
        self._open: dict[str, Any] = {}

    def _weight_map(self) -> dict[str, str]:
        from safetensors import safe_open
        index = self.path / INDEX
        if index.is_file():
            try:
                wmap = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise SpecError(self.field, f"cannot read {index}: {exc}", "repair or re-download the index") from None
            missing = sorted({f for f in wmap.values() if not (self.path / f).is_file()})
            if missing:
                raise SpecError(self.field, f"{index} names {missing[0]}, which is not in {self.path}",
                                "download every shard the index names")
            return dict(wmap)
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise SpecError(self.field, f"{self.path} holds no *.safetensors file",
                            "save the checkpoint with safetensors (save_pretrained's default)")
        wmap = {}
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as h:
                    wmap.update({k: f.name for k in h.keys()})
            except Exception as exc:  # safetensors raises its own SafetensorError for a corrupt header
                raise SpecError(self.field, f"cannot read {f}: {exc}", "re-download the file") from None
        return wmap

    def _handle(self, name: str):
        from safetensors import safe_open
        file = self.where[name]
        if file not in self._open:
            self._open[file] = safe_open(str(self.path / file), framework="pt")
        return self._open[file]

    def shape(self, name: str) -> tuple[int, ...] | None:
        if name not in self.where:
            return None
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Tensor `name`, or its [lo, hi) along `dim` (0 or 1) only."""
        sl = self._handle(name).get_slice(name)
        if dim is None:
            return sl[:]
        return sl[lo:hi] if dim == 0 else sl[:, lo:hi]

    def close(self) -> None:
        self._open.clear()


def check_checkpoint(ckpt: Checkpoint, spec: ModelSpec) -> str:
    """The config agrees with the plan's model and every tensor is there with its shape; returns the layout."""
    model_type = ckpt.config.get("model_type")
    layout = layout_for(model_type if isinstance(model_type, str) else "?", ckpt.field)
    rope = ckpt.config.get("rope_parameters") or ckpt.config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if kind not in (None, "default"):
        raise SpecError(ckpt.field, f"{ckpt.path / 'config.json'}: rope type {kind!r} is not implemented by the "
                        "executor",
                        "use a checkpoint with default rotary embeddings")
    theirs = spec_from_hf(ckpt.config, where=str(ckpt.path / "config.json"))
    for field in COMPARED:
        a, b = getattr(theirs, field), getattr(spec, field)
        same = math.isclose(a, b, rel_tol=1e-9) if isinstance(a, float) or isinstance(b, float) else a == b
        if not same:
            raise SpecError(ckpt.field, f"{ckpt.path / 'config.json'} has {field} = {a!r}, the plan's model "
                            f"{spec.name} has {b!r}",
                            "give the checkpoint the plan was made for, or re-plan with --model DIR/config.json")
    if layout == "glm4_moe":
        for field in MOE_COMPARED:
            a, b = getattr(theirs.moe, field), getattr(spec.moe, field) if spec.moe else None
            if a != b:
                raise SpecError(ckpt.field, f"{ckpt.path / 'config.json'} has moe.{field} = {a!r}, the plan's model "
                                f"{spec.name} has {b!r}",
                                "give the checkpoint the plan was made for, or re-plan with --model DIR/config.json")
        bad = moe_config_problem(ckpt.config)
        if bad:
            raise SpecError(ckpt.field, f"{ckpt.path / 'config.json'}: {bad[1]}", bad[2])
    check_supported(spec, layout, ckpt.field)
    for name, want in expected_tensors(spec, layout).items():
        got = ckpt.shape(name)
        if got is None:
            raise SpecError(ckpt.field, f"{ckpt.path} has no tensor {name}", "give a complete checkpoint")
        if got != want:
            raise SpecError(ckpt.field, f"tensor {name} has shape {list(got)}, the model needs {list(want)}",
                            "give the checkpoint the plan was made for")
    return layout


# --- saving: the layout and its config -------------------------------------------------------------


def save_layout(spec: ModelSpec, source: str | Path | None = None) -> str:
    """The layout save_hf_weights will write: the source's, else the model's family. Call it
    before training to refuse early."""
    if source is not None:
        ckpt = Checkpoint(source, "--save-hf")
        model_type = ckpt.config.get("model_type")
        layout = layout_for(model_type if isinstance(model_type, str) else "?", "--save-hf")
    else:
        layout = layout_for(spec.model_type, "--save-hf")
    check_supported(spec, layout, "--save-hf")
    return layout


def hf_config(spec: ModelSpec, layout: str) -> dict[str, Any]:
    """A config.json for `spec` in `layout` (transformers' own config classes for llama and glm)."""
    check_supported(spec, layout, "--save-hf")
    common = dict(hidden_size=spec.hidden, num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                  num_key_value_heads=spec.kv_heads, head_dim=spec.dim_per_head, intermediate_size=spec.ffn_hidden,
                  vocab_size=spec.vocab, max_position_embeddings=spec.max_seq, rms_norm_eps=spec.norm_eps,
                  tie_word_embeddings=spec.tied_embeddings, attention_bias=spec.qkv_bias,
                  attention_dropout=spec.attention_dropout, pad_token_id=None, dtype="float32")
    if layout == "llama":
        import transformers
        cfg = transformers.LlamaConfig(**common, mlp_bias=spec.linear_bias, architectures=["LlamaForCausalLM"],
                                       rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta})
        return cfg.to_dict()
    if layout == "glm4_moe":
        import transformers
        m = spec.moe
        common.update(attention_bias=spec.qkv_bias)
        cfg = transformers.Glm4MoeConfig(
            **common, architectures=["Glm4MoeForCausalLM"], moe_intermediate_size=m.expert_ffn,
            n_routed_experts=m.experts, num_experts_per_tok=m.top_k, n_shared_experts=m.shared_experts,
            first_k_dense_replace=m.first_dense, routed_scaling_factor=m.routed_scale, n_group=1, topk_group=1,
            norm_topk_prob=True, use_qk_norm=spec.qk_norm, num_nextn_predict_layers=0,
            rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta,
                             "partial_rotary_factor": spec.rotary_fraction})
        return cfg.to_dict()
    if layout == "glm":
        import transformers
        cfg = transformers.GlmConfig(**common, architectures=["GlmForCausalLM"],
                                     rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta,
                                                      "partial_rotary_factor": spec.rotary_fraction})
        return cfg.to_dict()
    # THUDM ChatGLMConfig (configuration_chatglm.py of chatglm3-6b)
    return {"model_type": "chatglm", "architectures": ["ChatGLMModel"], "num_layers": spec.layers,
            "padded_vocab_size": spec.vocab, "hidden_size": spec.hidden, "ffn_hidden_size": spec.ffn_hidden,
            "kv_channels": spec.dim_per_head, "num_attention_heads": spec.heads, "seq_length": spec.max_seq,
            "hidden_dropout": spec.hidden_dropout, "attention_dropout": spec.attention_dropout,
            "layernorm_epsilon": spec.norm_eps, "rmsnorm": True, "apply_residual_connection_post_layernorm": False,
            "post_layer_norm": True, "add_bias_linear": spec.linear_bias, "add_qkv_bias": spec.qkv_bias,
            "bias_dropout_fusion": True, "multi_query_attention": spec.kv_heads != spec.heads,
            "multi_query_group_num": spec.kv_heads, "rope_ratio": spec.rope_theta / 10000.0,
            "original_rope": True, "torch_dtype": "float32", "tie_word_embeddings": False}


def to_hf(full: dict[str, torch.Tensor], spec: ModelSpec, layout: str) -> dict[str, torch.Tensor]:
    """Canonical unsplit parameters -> the layout's tensors (fused parts split back)."""
    out: dict[str, torch.Tensor] = {}
    for c in canonical_names(spec):
        srcs = sources(c, spec, layout)
        for (name, _), t in zip(srcs, full[c].split([r for _, r in srcs], 0)):
            out[name] = t.contiguous()
    return out
