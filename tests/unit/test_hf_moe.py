"""Hugging Face glm4_moe checkpoints (GLM-4.5-Air's layout) <-> the executor's MoE model
(planner/hf/layout.py, weights.py), one process.

The reference is transformers' own Glm4MoeForCausalLM built from seeded random weights (norms,
biases and the routers' balancing bias moved away from their init, so a mix-up shows): the
executor loaded from its saved checkpoint must give its logits, and the executor's save must
read back into it tensor for tensor. Tiny shape: 2 layers (the first dense), 4 experts top-2,
one shared expert, GQA 4 heads / 2 KV groups, rotary on half of each head, QKV bias.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from planner.errors import SpecError
from planner.specs.hf import load_hf_config, spec_from_hf

os.environ.setdefault("DS_ACCELERATOR", "cpu")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Glm4MoeForCausalLM"):
    pytest.skip("this transformers has no Glm4MoeForCausalLM", allow_module_level=True)

from planner.hf import weights as W  # noqa: E402
from planner.model.glm import GLMModel  # noqa: E402
from hf_logits import assert_transformers_logits, batch as _batch  # noqa: E402

SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
             n_shared_experts=1, first_k_dense_replace=1, vocab_size=256, max_position_embeddings=64,
             attention_bias=True, pad_token_id=None, num_nextn_predict_layers=0,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})


def _hf_model(**kw):
    torch.manual_seed(7)
    model = transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(**{**SHAPE, **kw}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
        for layer in model.model.layers[SHAPE["first_k_dense_replace"]:]:
            # a bias large enough to change which experts are chosen (it chooses, never weights)
            layer.mlp.gate.e_score_correction_bias.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))
    return model.eval()


FLAVOURS = {"air": {}, "glm-4.5": dict(use_qk_norm=True, routed_scaling_factor=2.5)}
"""GLM-4.5-Air's options (no QK-norm, routed_scaling_factor 1.0) and GLM-4.5's (QK-norm, 2.5)."""


@pytest.fixture(scope="module", params=sorted(FLAVOURS))
def checkpoint(tmp_path_factory, request):
    path = tmp_path_factory.mktemp("hf") / f"glm4_moe-{request.param}"
    model = _hf_model(**FLAVOURS[request.param])
    model.save_pretrained(path)
    return path, model


def _executor(path: Path, seed: int = 0):
    spec = load_hf_config(path)
    model = GLMModel(spec, [False] * spec.layers, False, seed=seed)
    W.load_hf_weights(model, path, spec)
    return spec, model.eval()


def _save(module, spec, path, source=None):
    W.save_hf_weights(SimpleNamespace(module=module), path, spec, SimpleNamespace(zero=0, pp=1), None, source=source)


def test_checkpoint_names_are_the_published_per_expert_ones(checkpoint):
    """transformers 5.24 saves the stacked experts back per expert (the published layout);
    expected_tensors names exactly the checkpoint's tensors."""
    path, _ = checkpoint
    spec = load_hf_config(path)
    ckpt = W.Checkpoint(path)
    want = W.expected_tensors(spec, "glm4_moe")
    assert set(want) == set(ckpt.where)
    assert want["model.layers.1.mlp.experts.3.gate_proj.weight"] == (32, 64)
    assert want["model.layers.1.mlp.experts.3.down_proj.weight"] == (64, 32)
    assert want["model.layers.1.mlp.gate.weight"] == (4, 64)
    assert want["model.layers.1.mlp.gate.e_score_correction_bias"] == (4,)
    assert want["model.layers.1.mlp.shared_experts.up_proj.weight"] == (32, 64)
    assert want["model.layers.0.mlp.gate_proj.weight"] == (96, 64)  # the dense first block
    assert all(ckpt.shape(k) == v for k, v in want.items())


def test_loaded_model_gives_transformers_logits(checkpoint):
    path, ref = checkpoint
    spec, model = _executor(path)
    assert spec.moe is not None and spec.moe.router == "sigmoid" and not spec.rope_interleaved
    want = assert_transformers_logits(model, ref)
    ids, pos, seg = _batch()
    # the balancing bias was loaded and matters: without it other experts are chosen
    router = model.layers[1].mlp.moe.deepspeed_moe.gate
    assert torch.equal(router.e_score_correction_bias, torch.tensor([0.3, -0.2, 0.1, 0.0]))
    router.e_score_correction_bias.zero_()
    with torch.no_grad():
        assert float((model(ids, pos, seg) - want).abs().max()) > 1e-4


def test_save_init_round_trip_gives_identical_logits_and_loss(checkpoint, tmp_path):
    """save -> init: the same tensors, the same logits and loss; and the executor's save reads
    back into transformers' Glm4MoeForCausalLM tensor for tensor."""
    path, ref = checkpoint
    spec, model = _executor(path)
    _save(model, spec, tmp_path / "out")  # no source: a generated Glm4MoeConfig
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["model_type"] == "glm4_moe" and cfg["n_routed_experts"] == 4 and cfg["first_k_dense_replace"] == 1
    spec2, model2 = _executor(tmp_path / "out", seed=5)  # another init seed: everything must come from the file
    for f in W.COMPARED:
        assert getattr(spec2, f) == getattr(spec, f), f
    assert spec2.moe == spec.moe
    ids, pos, seg = _batch()
    with torch.no_grad():
        a, b = model(ids, pos, seg), model2(ids, pos, seg)
    assert torch.equal(a, b)
    loss = [torch.nn.functional.cross_entropy(x[:, :-1].flatten(0, 1), ids[:, 1:].flatten()) for x in (a, b)]
    assert torch.equal(loss[0], loss[1])
    back = transformers.Glm4MoeForCausalLM.from_pretrained(tmp_path / "out")
    for k, v in ref.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_generated_config_reads_back_as_the_same_model(checkpoint):
    spec = load_hf_config(checkpoint[0])
    back = spec_from_hf(W.hf_config(spec, "glm4_moe"))
    assert {f: getattr(back, f) for f in W.COMPARED} == {f: getattr(spec, f) for f in W.COMPARED}
    assert back.moe == spec.moe


def test_expert_parallel_rank_reads_its_own_experts(checkpoint):
    """EP rank r of 2 builds experts 2r and 2r+1 and reads exactly those."""
    from planner.model.parallel.groups import TPGroup
    path, ref = checkpoint
    spec = load_hf_config(path)
    model = GLMModel(spec, [False] * spec.layers, False, ep=TPGroup(rank=1, size=2))
    W.load_hf_weights(model, path, spec)
    got = {p.canonical: p for p in model.parameters() if ".experts." in p.canonical}
    assert sorted(got) == [f"layers.1.mlp.experts.{e}.{m}.weight" for e in (2, 3)
                           for m in ("dense_4h_to_h", "dense_h_to_4h")]
    stacked = ref.state_dict()["model.layers.1.mlp.experts.gate_up_proj"]  # [E, 2f, h]: gate then up
    assert torch.equal(got["layers.1.mlp.experts.3.dense_h_to_4h.weight"], stacked[3])


# --- bad input: one SpecError naming the problem ---------------------------------------------------


def _error(path, spec, field="--init-hf") -> SpecError:
    model = GLMModel(spec, [False] * spec.layers, False)
    with pytest.raises(SpecError) as exc:
        W.load_hf_weights(model, path, spec)
    assert exc.value.field == field
    return exc.value


@pytest.mark.parametrize("key, value, words", [
    ("n_group", 4, "group-limited routing"),
    ("norm_topk_prob", False, "always normalises"),
])
def test_routing_options_the_executor_lacks_are_refused(checkpoint, tmp_path, key, value, words):
    path, _ = checkpoint
    spec = load_hf_config(path)
    cfg = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, key: value}))
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    err = _error(tmp_path, spec)
    assert words in str(err) and key in str(err) and "\n" not in str(err)


def test_moe_shape_mismatch_and_dense_layouts_are_refused(checkpoint):
    path, _ = checkpoint
    spec = load_hf_config(path)
    msg = str(_error(path, dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, experts=8))))
    assert "moe.experts = 4" in msg and "has 8" in msg
    with pytest.raises(SpecError, match="a mixture-of-experts model, the llama layout is dense"):
        W.check_supported(spec, "llama")
    with pytest.raises(SpecError, match="a dense model, the glm4_moe layout is MoE"):
        W.check_supported(dataclasses.replace(spec, moe=None), "glm4_moe")


# --- GLM-4.5: QK-norm and routed_scaling_factor -----------------------------------------------------


def test_glm45_options_are_read_and_matter(checkpoint):
    """GLM-4.5's use_qk_norm and routed_scaling_factor 2.5 load into the spec and the model
    (q_norm / k_norm read from the file, the router scaling its weights); each one, undone,
    moves the logits away from transformers' (so the parity above depends on both)."""
    path, ref = checkpoint
    cfg = json.loads((path / "config.json").read_text())
    spec, model = _executor(path)
    assert spec.qk_norm == bool(cfg.get("use_qk_norm")) and spec.moe.routed_scale == cfg["routed_scaling_factor"]
    if not spec.qk_norm:
        assert spec.moe.routed_scale == 1.0 and model.layers[0].self_attention.q_norm is None
        return
    attn = model.layers[1].self_attention
    assert torch.equal(attn.q_norm.weight, ref.model.layers[1].self_attn.q_norm.weight)
    assert torch.equal(attn.k_norm.weight, ref.model.layers[1].self_attn.k_norm.weight)
    assert W.expected_tensors(spec, "glm4_moe")["model.layers.1.self_attn.q_norm.weight"] == (16,)
    ids, pos, seg = _batch()
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        assert float((model(ids, pos, seg) - want).abs().max()) < 1e-5
        unscaled = _executor_with(path, dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, routed_scale=1.0)))
        assert float((unscaled(ids, pos, seg) - want).abs().max()) > 1e-3
        for layer in model.layers:
            layer.self_attention.q_norm.weight.fill_(1.0)
        assert float((model(ids, pos, seg) - want).abs().max()) > 1e-3


def _executor_with(path: Path, spec):
    """The executor built for `spec` (here: routed_scale 1) with the file's weights (loaded
    against the file's own MoE fields, so the config comparison passes)."""
    model = GLMModel(spec, [False] * spec.layers, False)
    W.load_hf_weights(model, path, dataclasses.replace(spec, moe=load_hf_config(path).moe))
    return model.eval()


def test_qk_norm_params_are_counted(checkpoint):
    """ModelSpec counts QK-norm's two head_dim weights per block, as the executor holds them."""
    path, _ = checkpoint
    spec, model = _executor(path)
    held = sum(p.numel() for p in model.parameters())
    assert held == spec.params
    plain = dataclasses.replace(spec, qk_norm=False)
    assert spec.params - plain.params == (2 * 16 * spec.layers if spec.qk_norm else 0)
