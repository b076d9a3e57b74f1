"""Hugging Face checkpoints <-> the executor's model (planner/hf/weights.py), one process.

The references are transformers' own models (LlamaForCausalLM, GlmForCausalLM) built from
seeded random weights: the executor loaded from their saved checkpoint must give their logits.
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

from planner.hf import weights as W  # noqa: E402
from planner.model.glm import GLMModel  # noqa: E402
from hf_logits import assert_transformers_logits, batch as _batch  # noqa: E402
from planner.model.parallel.groups import TPGroup  # noqa: E402

SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=96, vocab_size=256, max_position_embeddings=64, pad_token_id=None)


def _hf_model(kind: str, **kw):
    torch.manual_seed(7)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**{**SHAPE, "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
                                          "rms_norm_eps": 1e-5, **kw})
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.GlmConfig(**{**SHAPE, **kw})
        model = transformers.GlmForCausalLM(cfg)
    with torch.no_grad():  # norms and biases away from their 1 / 0 init, so a mix-up shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for kind in ("llama", "glm"):
        model = _hf_model(kind)
        model.save_pretrained(root / kind)
        out[kind] = (root / kind, model)
    return out


def _named(module) -> dict:
    return {p.canonical: p for p in module.parameters()}


def _executor(path: Path, tp: TPGroup = TPGroup()):
    spec = load_hf_config(path)
    model = GLMModel(spec, [False] * spec.layers, False, tp=tp)
    W.load_hf_weights(model, path, spec)
    return spec, model.eval()


@pytest.mark.parametrize("kind", ["llama", "glm"])
def test_loaded_model_gives_transformers_logits(kind, checkpoints):
    path, ref = checkpoints[kind]
    spec, model = _executor(path)
    want = assert_transformers_logits(model, ref)
    ids, pos, seg = _batch()
    # and the convention matters: the other rotary style gives different logits
    other = dataclasses.replace(spec, rope_interleaved=not spec.rope_interleaved)
    wrong = GLMModel(other, [False] * spec.layers, False)
    wrong.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert float((wrong(ids, pos, seg) - want).abs().max()) > 1e-3


def test_tp_slices_reassemble_the_fused_tensors(checkpoints):
    """Rank t holds 1/T of q, of k and of v (and of gate and of up), vocabulary rows t*V/T on."""
    path, ref = checkpoints["glm"]
    full = {k: v for k, v in ref.state_dict().items()}
    spec = load_hf_config(path)
    ranks = [_executor(path, TPGroup(rank=r, size=2))[1] for r in range(2)]
    qkv = [_named(m)["layers.1.self_attention.query_key_value.weight"] for m in ranks]
    q, k, v = (full[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(qkv[1][:32], q[32:]) and torch.equal(qkv[1][32:48], k[16:]) and torch.equal(qkv[1][48:], v[16:])
    gate_up = full["model.layers.0.mlp.gate_up_proj.weight"]
    h4 = _named(ranks[1])["layers.0.mlp.dense_h_to_4h.weight"]
    assert torch.equal(h4[:48], gate_up[48:96]) and torch.equal(h4[48:], gate_up[144:])
    dense = _named(ranks[1])["layers.0.self_attention.dense.weight"]
    assert torch.equal(dense, full["model.layers.0.self_attn.o_proj.weight"][:, 32:])
    emb = _named(ranks[1])["embedding.word_embeddings.weight"]
    assert torch.equal(emb, full["model.embed_tokens.weight"][128:])
    assert spec.padded_vocab(2) == 256


def test_padded_vocabulary_rows_are_zero(tmp_path):
    model = _hf_model("llama", vocab_size=255)
    model.save_pretrained(tmp_path)
    _, rank1 = _executor(tmp_path, TPGroup(rank=1, size=2))
    out = _named(rank1)["head.output_layer.weight"]
    assert out.shape == (128, 64)
    assert torch.equal(out[:127], model.state_dict()["lm_head.weight"][128:])
    assert float(out[127].detach().abs().max()) == 0.0


def _save(module, spec, path, source=None):
    plan = SimpleNamespace(zero=0, pp=1)
    W.save_hf_weights(SimpleNamespace(module=module), path, spec, plan, None, source=source)


def test_save_writes_the_source_layout_and_reloads(checkpoints, tmp_path):
    path, ref = checkpoints["glm"]
    spec, model = _executor(path)
    _save(model, spec, tmp_path / "out", source=path)
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors"]
    back = transformers.GlmForCausalLM.from_pretrained(tmp_path / "out")
    for k, v in ref.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    assert not list(tmp_path.glob(".out*"))  # no temporary left


def test_chatglm_layout_round_trip_and_same_logits_as_glm(checkpoints, tmp_path):
    """GlmForCausalLM's math is ChatGLM2/3's: the same weights under ChatGLM names give the
    same executor logits; ChatGLM save -> load -> save gives identical tensors."""
    path, _ = checkpoints["glm"]
    spec, model = _executor(path)
    chat_spec = dataclasses.replace(spec, model_type="chatglm")
    _save(model, chat_spec, tmp_path / "chat")  # no source: a generated ChatGLM config
    cfg = json.loads((tmp_path / "chat" / "config.json").read_text())
    assert cfg["model_type"] == "chatglm" and cfg["multi_query_group_num"] == 2
    from safetensors.torch import load_file
    first = load_file(tmp_path / "chat" / "model.safetensors")
    assert "transformer.encoder.layers.1.self_attention.query_key_value.bias" in first
    assert first["transformer.encoder.layers.1.mlp.dense_h_to_4h.weight"].shape == (192, 64)
    assert "transformer.output_layer.weight" in first and "transformer.encoder.final_layernorm.weight" in first
    spec2, model2 = _executor(tmp_path / "chat")
    for f in W.COMPARED:
        assert getattr(spec2, f) == getattr(spec, f), f
    ids, pos, seg = _batch()
    with torch.no_grad():
        assert torch.equal(model2(ids, pos, seg), model(ids, pos, seg))
    _save(model2, spec2, tmp_path / "chat2", source=tmp_path / "chat")
    second = load_file(tmp_path / "chat2" / "model.safetensors")
    assert set(first) == set(second) and all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize("layout", ["llama", "glm"])
def test_generated_config_reads_back_as_the_same_model(checkpoints, layout):
    spec = load_hf_config(checkpoints[layout][0])
    back = spec_from_hf(W.hf_config(spec, layout))
    assert {f: getattr(back, f) for f in W.COMPARED} == {f: getattr(spec, f) for f in W.COMPARED}


# --- bad input: one SpecError on --init-hf naming the problem ------------------------------------


def _error(path, spec) -> SpecError:
    model = GLMModel(spec, [False] * spec.layers, False)
    with pytest.raises(SpecError) as exc:
        W.load_hf_weights(model, path, spec)
    assert exc.value.field == "--init-hf"
    return exc.value


def test_bad_checkpoints(checkpoints, tmp_path):
    path, ref = checkpoints["llama"]
    spec = load_hf_config(path)
    assert "is not a directory" in str(_error(tmp_path / "nope", spec))
    (tmp_path / "empty").mkdir()
    assert "no config.json" in str(_error(tmp_path / "empty", spec))
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text((path / "config.json").read_text())
    assert "no *.safetensors" in str(_error(tmp_path / "cfg", spec))
    # the plan's model differs from the checkpoint's config: the field is named
    wider = dataclasses.replace(spec, ffn_hidden=128)
    msg = str(_error(path, wider))
    assert "ffn_hidden = 96" in msg and "has 128" in msg
    # a tensor of the wrong shape, a missing tensor
    from safetensors.torch import load_file, save_file
    sd = load_file(path / "model.safetensors")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((path / "config.json").read_text())
    save_file({**sd, "model.layers.1.self_attn.k_proj.weight": torch.zeros(16, 64)}, bad / "model.safetensors")
    msg = str(_error(bad, spec))
    assert "model.layers.1.self_attn.k_proj.weight has shape [16, 64], the model needs [32, 64]" in msg
    save_file({k: v for k, v in sd.items() if k != "model.norm.weight"}, bad / "model.safetensors")
    assert "no tensor model.norm.weight" in str(_error(bad, spec))


def test_sharded_checkpoint_with_index(checkpoints, tmp_path):
    path, ref = checkpoints["llama"]
    ref.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 1
    _, a = _executor(tmp_path)
    _, b = _executor(path)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_glm4_and_unmapped_families_are_refused(tmp_path):
    with pytest.raises(SpecError, match="post-attention and post-MLP norms"):
        W.layout_for("glm4")
    with pytest.raises(SpecError, match="no weight mapping for model_type 'gpt2'"):
        W.layout_for("gpt2")
