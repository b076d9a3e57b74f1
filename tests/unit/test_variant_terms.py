"""Model-variant what-ifs (docs/variants.md): every term pinned to a value computed by hand.

The model is chatglm3-6b at --scale tiny: h 128, 4 layers, 4 heads, 2 KV groups, d 32,
SwiGLU FFN of 432 (round(128 x 13696/4096 / 8) x 8), RMSNorm, QKV bias, no linear bias,
V 1024, untied. One block: attention 128 x 256 + 128 x 128 + 256 bias = 49,408; FFN
3 x 128 x 432 = 165,888; norms 256: 215,552. Embedding 131,072, output 131,072 + 128.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from planner.cli import main
from planner.cli.common import apply_variants
from planner.cost import compute, memory, params
from planner.cost.attention import attention_kernel, recomputes_scores, stores_scores
from planner.errors import SpecError
from planner.serve.memory import (cache_read_bytes, kv_bytes_per_token, serve_memory, state_bytes_per_sequence,
                                  weight_bytes, weight_read_bytes)
from planner.serve.spec import Deployment, Workload
from planner.specs import Plan, TrainSpec, parse_cluster, preset, scale
from planner.specs.validate import plan_problems

TINY = scale(preset("chatglm3-6b"), "tiny")
BASE_BLOCK, EMB_OUT = 215_552, 131_072 + 131_200


def v(*variants: str):
    return apply_variants(TINY, variants)


# --- ModelSpec and parameters ------------------------------------------------------------------
def test_defaults_change_nothing():
    assert TINY.ffn_size == TINY.ffn_hidden == 432 and TINY.unique_layers == 4 and TINY.variant_label == ""
    assert TINY.layer_params == BASE_BLOCK and TINY.params == 4 * BASE_BLOCK + EMB_OUT == 1_124_480


def test_ffn_sparsity_shrinks_the_ffn():
    m = v("ffn-sparsity=0.5")
    assert m.ffn_size == 216                              # 432 x 0.5 = 216 (a multiple of 8)
    assert m.layer_params == 49_408 + 3 * 128 * 216 + 256 == 132_608
    assert v("ffn-sparsity=0.3").ffn_size == 304          # 432 x 0.7 = 302.4 -> 38 x 8
    assert m.name == "chatglm3-6b-tiny+ffn0.5" and "FFN 216" in m.describe()
    # per TP rank: FFN in 128 x 2 x 216 / 2, out 216 x 128 / 2
    assert params.block_tensors(m, 2).numels[-2:] == (27_648, 13_824)


def test_share_layers_counts_one_set_per_k_blocks():
    m = v("share-layers=2")
    assert m.params == 2 * BASE_BLOCK + EMB_OUT == 693_376
    assert params.stage_params(m, Plan()) == (693_376,)
    assert v("share-layers=2", "ffn-sparsity=0.5").params == 2 * 132_608 + EMB_OUT == 527_488
    assert m.base() == TINY


@pytest.mark.parametrize("variant,match", [
    ("share-layers=3", "does not divide the 4 layers"), ("ffn-sparsity=1.5", r"in \(0, 1\)"),
    ("ffn-sparsity=0", r"in \(0, 1\)"), ("ffn-sparsity=x", "not a number"), ("sparse-attention", "unknown variant"),
    ("linear-attention=1", "takes no value")])
def test_bad_variants_are_refused(variant, match):
    with pytest.raises(SpecError, match=match):
        v(variant)


def test_linear_attention_refuses_alibi():
    alibi = dataclasses.replace(TINY, position="alibi")
    with pytest.raises(SpecError, match="ALiBi"):
        apply_variants(alibi, ["linear-attention"])


def test_share_layers_refused_under_pp():
    m = v("share-layers=2")
    plan = Plan(pp=2, grad_accum=8)
    problems = plan_problems(m, parse_cluster("2xcpu"), TrainSpec(global_batch=8, seq_len=64, precision="bf16"), plan)
    assert any("share-layers 2 with pp 2" in p.line and p.field == "plan.pp" for p in problems)


# --- training compute and memory ---------------------------------------------------------------
def test_linear_attention_flops_have_no_s_squared():
    m = v("linear-attention")
    # 2 b s d (2 C n + (n + g) d) = 2 x 256 x 32 x (2 x 64 x 4 + 6 x 32)
    assert compute.block_gemms(m, 256, 1, 1)[1] == 11_534_336
    assert compute.block_gemms(TINY, 256, 1, 1)[1] == 4 * 256 * 256 * 128 == 33_554_432
    # doubling s doubles the linear core (C fixed at 64), quadruples softmax's
    assert compute.block_gemms(m, 512, 1, 1)[1] == 2 * 11_534_336
    assert compute.flash_recompute_flops(m, 256, 1) == 11_534_336   # the backward re-runs the forward
    # b = 3 sequences on TP 2 (n = 2 query heads, g = 1 KV head per rank):
    # 2 x 3 x 256 x 32 x (2 x 64 x 2 + 3 x 32) = 49,152 x 352
    assert compute.block_gemms(m, 256, 3, 2)[1] == 17_301_504
    cpu = TrainSpec(global_batch=8, seq_len=256, precision="bf16", attention="eager")
    assert attention_kernel(m, cpu, "cpu") == "linear"
    assert recomputes_scores("linear") and not stores_scores("linear")


def test_ffn_sparsity_halves_ffn_flops_and_sparse_gemm_efficiency_divides_time():
    base, half = compute.block_gemms(TINY, 256, 1, 1)[0], compute.block_gemms(v("ffn-sparsity=0.5"), 256, 1, 1)[0]
    assert base[2] == 2 * 256 * 128 * 432 * 2 == 56_623_104 and half[2] == 28_311_552
    assert half[3] == base[3] / 2 and half[:2] == base[:2]
    assert compute.ffn_time_divisors(v("ffn-sparsity=0.5", "sparse-gemm-efficiency=0.7")) == (1.0, 1.0, 0.7, 0.7)
    assert compute.ffn_time_divisors(v("ffn-sparsity=0.5")) == (1.0, 1.0, 1.0, 1.0)
    # an efficiency without pruning (the CLI refuses it; a ModelSpec may carry it) divides nothing
    dense = dataclasses.replace(TINY, sparse_gemm_efficiency=0.7)
    assert compute.ffn_time_divisors(dense) == (1.0, 1.0, 1.0, 1.0)


def test_linear_attention_activations():
    kw = dict(sequence_parallel=False, recompute="none", act_bytes=2.0)
    # 4 e b s h + 2 rstd (4 b s) = 262,144 + 2,048; FFN e b s f x 4 = 884,736
    # linear core: q, k, v e b s (n + 2g) d = 131,072 and the output e b s n d = 65,536
    assert memory.block_activation_bytes(v("linear-attention"), 256, 1, 1, kernel="linear", **kw) == 1_345_536
    # flash keeps the fp32 logsumexp too (4 b n s = 4,096); eager the b n s^2 softmax (524,288)
    assert memory.block_activation_bytes(TINY, 256, 1, 1, kernel="flash", **kw) == 1_349_632
    assert memory.block_activation_bytes(TINY, 256, 1, 1, kernel="eager", **kw) == 1_869_824
    assert memory.mask_bytes(v("linear-attention"), 256, 1, 1, 2.0) == 0
    assert memory.mask_bytes(TINY, 256, 1, 1, 2.0) == 2 * 256 * 256


# --- serving ----------------------------------------------------------------------------------
DEP = Deployment(max_batch=8)


def test_linear_attention_state_replaces_the_kv_cache():
    m = v("linear-attention")
    assert kv_bytes_per_token(TINY, DEP) == 2 * 4 * 2 * 32 * 2 == 1024 and kv_bytes_per_token(m, DEP) == 0
    assert state_bytes_per_sequence(m, DEP) == 4 * 2 * (32 * 32 + 32) * 2 == 16_896
    assert state_bytes_per_sequence(TINY, DEP) == 0
    # decode reads (and writes back) each sequence's state, not the context's KV
    assert cache_read_bytes(m, DEP, 3, 3000) == 2 * 3 * 16_896
    assert cache_read_bytes(TINY, DEP, 3, 3000) == 3000 * 1024
    full = apply_variants(preset("chatglm3-6b"), ["linear-attention"])
    assert state_bytes_per_sequence(full, DEP) == 28 * 2 * (128 * 128 + 128) * 2 == 1_849_344


def test_linear_attention_batch_limit_is_states_that_fit():
    m = v("linear-attention")
    cluster = parse_cluster("1xA100")
    mem = serve_memory(m, cluster, Deployment(max_batch=256), Workload(prompt_len=200, output_len=50))
    assert mem["batch_limit"] == 256 and mem["fits"]      # 256 states of 16.9 kB: nothing
    assert mem["kv_blocks"] == 256 * 16                   # 250 tokens = 16 blocks of 16 each


def test_share_layers_shrinks_footprint_not_reads():
    m = v("share-layers=2")
    assert weight_bytes(TINY, DEP) == 2 * 1_124_480 and weight_bytes(m, DEP) == 2 * 693_376
    assert weight_read_bytes(m, DEP) == weight_read_bytes(TINY, DEP) == 2 * (1_124_480 - 131_072)


def test_ffn_sparsity_shrinks_weights():
    assert weight_bytes(v("ffn-sparsity=0.5"), DEP) == 2 * (4 * 132_608 + EMB_OUT)


# --- CLI --------------------------------------------------------------------------------------
def test_estimate_prints_base_and_variant(capsys):
    rc = main(["estimate", "--model", "chatglm3-6b", "--scale", "tiny", "--gpus", "2xcpu", "--variant",
               "share-layers=2", "--variant", "ffn-sparsity=0.5", "--json"])
    out = capsys.readouterr().out
    assert rc in (0, None)
    import json
    doc = json.loads(out)
    rows = {r["figure"]: r for r in doc["variant_comparison"]["rows"]}
    assert rows["parameters"]["base"] == "1,124,480" and rows["parameters"]["variant"] == "527,488"
    assert doc["variant_comparison"]["variant"] == "chatglm3-6b-tiny+ffn0.5+share2"


def test_bad_variant_exits_2(capsys):
    rc = main(["estimate", "--model", "chatglm3-6b", "--scale", "tiny", "--gpus", "2xcpu", "--variant",
               "share-layers=3"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and "share-layers" in err


def test_executor_builds_each_variant():
    from planner.model.glm import GLMModel
    for m, n in ((v("share-layers=2"), 693_376), (v("ffn-sparsity=0.5"), 4 * 132_608 + EMB_OUT),
                 (v("linear-attention"), 1_124_480)):
        model = GLMModel(m, [False] * 4, False)
        assert sum(p.numel() for p in model.parameters()) == n
        ids = torch.randint(0, 1024, (1, 80))
        pos = torch.arange(80)[None]
        seg = torch.zeros(1, 80, dtype=torch.long)
        assert model(ids, pos, seg).shape == (1, 80, 1024)
    shared = GLMModel(v("share-layers=2"), [False] * 4, False)
    assert shared.layers[1].mlp is shared.layers[0].mlp and shared.layers[2].mlp is not shared.layers[0].mlp


def test_linear_attention_matches_the_quadratic_form_within_documents():
    """The chunked kernel equals phi(Q) phi(K)^T masked (causal, same document) @ V / row sums,
    across chunk boundaries and document starts inside and at the edge of chunks."""
    from planner.model.attention import _LinearAttention, linear_attention
    torch.manual_seed(0)
    b, n, g, s, d = 2, 4, 2, 150, 8
    seg = torch.zeros(b, s, dtype=torch.long)
    seg[0, 40:], seg[0, 130:], seg[1, 64:] = 1, 2, 5
    q, k, vv = torch.randn(b, n, s, d), torch.randn(b, g, s, d), torch.randn(b, g, s, d)
    phi = lambda x: torch.nn.functional.elu(x) + 1  # noqa: E731
    a = phi(q) @ phi(k.repeat_interleave(2, 1)).transpose(-1, -2)
    a = a * ((seg[:, :, None] == seg[:, None, :]) & torch.ones(s, s, dtype=torch.bool).tril())[:, None]
    ref = (a @ vv.repeat_interleave(2, 1)) / a.sum(-1, keepdim=True)
    assert torch.allclose(linear_attention(q, k, vv, seg, chunk=32), ref, atol=1e-5)
    # the recomputing autograd function gives autograd's gradients
    x1 = [t.clone().requires_grad_() for t in (q, k, vv)]
    x2 = [t.clone().requires_grad_() for t in (q, k, vv)]
    w = torch.randn(b, n, s, d)
    (linear_attention(*x1, seg) * w).sum().backward()
    (_LinearAttention.apply(*x2, seg) * w).sum().backward()
    assert all(torch.allclose(a1.grad, a2.grad) for a1, a2 in zip(x1, x2))


def test_zero1_owned_gradients_count_shared_tensors_once() -> None:
    """ZeRO-1 flattens the module's parameters, so a block shared K times is one set of tensors
    in the partitioned group: tiny chatglm3-6b (4 blocks of 215,552 elements, 1,124,480 in all)
    with share-layers=2 has 693,376 parameters; one DP rank owns them all, and on DP 2 the
    worst rank owns half of them (346,688) plus the tensor spilling over its slice's end."""
    from planner.cost.model import layer_costs
    model = apply_variants(TINY, ["share-layers=2"])
    cluster, train = parse_cluster("2xcpu"), TrainSpec(global_batch=8, seq_len=64)
    owned = [layer_costs(model, cluster, train, Plan(dp=dp, zero=1, micro_batch=2, grad_accum=4 // dp))
             .stage_owned(0, 1, model.layers, dp) for dp in (1, 2)]
    assert model.params == 693_376 and owned == [693_376, 346_752]


def test_search_run_directory_holds_base_beside_variant(tmp_path, capsys):
    """search --variant: estimate.json carries the picked plan for the base model and the variant
    side by side, and report.html shows it ("Variant against base"); without --variant neither."""
    import json
    argv = ["search", "--model", "chatglm3-6b", "--scale", "tiny", "--gpus", "2xcpu", "--trials", "8",
            "--out-dir", str(tmp_path)]
    assert main([*argv, "--name", "v", "--variant", "share-layers=2"]) in (0, None)
    doc = json.loads((tmp_path / "v" / "estimate.json").read_text())["variant_comparison"]
    rows = {r["figure"]: r for r in doc["rows"]}
    assert doc["base"] == "chatglm3-6b-tiny" and doc["variant"] == "chatglm3-6b-tiny+share2"
    assert rows["parameters"]["base"] == "1,124,480" and rows["parameters"]["variant"] == "693,376"
    assert rows["parameters"]["ratio"] == "0.62x"
    html = (tmp_path / "v" / "report.html").read_text()
    assert 'id="variant-table"' in html and "1,124,480" in html and "693,376" in html
    assert main([*argv, "--name", "b"]) in (0, None)
    assert "variant_comparison" not in json.loads((tmp_path / "b" / "estimate.json").read_text())
    assert 'id="variant-table"' not in (tmp_path / "b" / "report.html").read_text()
