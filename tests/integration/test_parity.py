"""Parity: every parallel layout reproduces the single-process fp32 run of the same model.

For a fixed seed and data, each layout (DP, TP, PP and their products; ZeRO 0-3; sequence
parallelism) must give, against one single-process reference run per model:
- the per-step loss over the first 3 steps (5 for GLM-4.5 tiny: STEPS_OF) within 1e-4 relative
  (step 1 the initial model, steps 2 and 3 after Adam's first and second updates, moments carried over);
- the first step's gradients (written by each rank just before the optimizer step, averaged
  over DP as the optimizer sees them, reassembled across TP into full tensors) within 1e-4
  relative (norm of the difference over norm of the reference), tensor by tensor; the padded
  vocabulary rows' gradients exactly zero;
- the global gradient norm DeepSpeed computed for clipping within 1e-4 relative (each
  parameter counted once: TP slices once per slice, replicated and tied parameters once).
Some layouts' ranks are also checked to hold what the plan lays out (LAYOUT_CHECKS: TP slices,
the pipeline's partial checkpointing, eight processes' coordinates).

Models: ChatGLM3 tiny (grouped-query attention, SwiGLU, RMSNorm, rotary), GLM-10B tiny (GELU,
multi-head attention, LayerNorm, learned positions, tied embeddings; dropout set to 0 so
the runs are deterministic) and GLM-10B tiny with a 1023-token vocabulary (padded to 1024
under TP 2); for DeepSpeed-MoE, GLM-4.5-Air tiny and GLM-4.5 tiny (MOE, GLM45). Run alone (2 cores): `flock /tmp/planner-cpu.lock .venv/bin/pytest -q -s
tests/integration/test_parity.py` (-s prints one line per layout).
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from planner import dsconfig
from planner.runtime.train import launch
from planner.rundir import atomic_write_json, plan_document
from planner.specs import Plan, TrainSpec, parse_cluster, preset, scale

pytestmark = pytest.mark.integration
os.environ.setdefault("DS_ACCELERATOR", "cpu")
torch = pytest.importorskip("torch")

SEQ, STEPS, GLOBAL_BATCH, MICRO = 32, 3, 4, 2
TOL = 1e-4
CHATGLM = scale(preset("chatglm3-6b"), "tiny")
GLM10B = dataclasses.replace(scale(preset("glm-10b"), "tiny"), hidden_dropout=0.0, attention_dropout=0.0)
PADDED = dataclasses.replace(GLM10B, name="glm-10b-tiny-v1023", vocab=1023)
DROPOUT = dataclasses.replace(GLM10B, name="glm-10b-tiny-dropout", hidden_dropout=0.1, attention_dropout=0.1)
MOE = scale(preset("glm-4.5-air"), "tiny")
"""GLM-4.5-Air tiny: 4 routed experts (top-2, sigmoid router), one shared expert, block 0 dense."""
GLM45 = scale(preset("glm-4.5"), "tiny")
"""GLM-4.5 tiny: Air's MoE shape plus QK-norm (one RMSNorm weight over head_dim shared by the heads,
norms.HeadRMSNorm: under TP each rank normalises its own heads, the weight's gradient is summed
over TP) and routed scaling 2.5."""
MODELS = {"chatglm3": CHATGLM, "glm10b": GLM10B, "glm10b-v1023": PADDED, "glm10b-dropout": DROPOUT, "moe": MOE,
          "glm45": GLM45}

MICRO_OF = {"moe": 1, "glm45": 1}
"""Micro-batch per model where 2 does not fit: EP2xDP2 has 4 data-parallel ranks."""
STEPS_OF = {"glm45": 5}
"""Steps per model where the loss is compared over more than STEPS (issue 22: 5 steps)."""

# (id, model, plan fields, attention); global batch 4 everywhere, micro-batch 2. A layout whose
# mechanism a larger case here already runs is left out (each launch costs ~10 s of CI): DP2 ZeRO-3
# (TP2xDP2 ZeRO-3 and the tied DP2 ZeRO-3), PP2 tied (TP2xPP2 SP tied), TP2 padded vocab (TP2xPP2 padded),
# TP2 ZeRO-0 (TP on the plain engine: TP2 SP ZeRO-1, TP2xDP2 eager and the tied TP2; ZeRO-0: PP2, TP2xPP2,
# SP2, EP2; its slice check runs on TP2 SP ZeRO-1, whose ranks hold the same slices), DP2xPP2 ZeRO-1
# (TP2xPP2xDP2 ZeRO-1 runs DP over pipeline stages at the same ZeRO stage; its coordinate check runs
# there, on all three axes), GLM-4.5-Air EP2xTP2 ZeRO-1 (GLM-4.5's EP2xTP2 runs the same EP x TP
# mechanism, with QK-norm)
CASES = [
    ("DP2 ZeRO-2", "chatglm3", dict(dp=2, zero=2), "flash"),
    ("PP2 ZeRO-0 partial recompute", "chatglm3", dict(pp=2, zero=0, stage_layers=(3, 1), recompute="full",
                                                     recompute_layers=(2, 0)), "flash"),
    ("TP2xPP2 ZeRO-0 full recompute", "chatglm3", dict(tp=2, pp=2, zero=0, recompute="full"), "flash"),
    ("TP2xDP2 ZeRO-1 eager", "chatglm3", dict(tp=2, dp=2, zero=1), "eager"),
    ("TP2xDP2 ZeRO-3", "chatglm3", dict(tp=2, dp=2, zero=3), "flash"),
    ("TP2xPP2xDP2 ZeRO-1", "chatglm3", dict(tp=2, pp=2, dp=2, zero=1), "flash"),
    ("TP2 SP ZeRO-1", "chatglm3", dict(tp=2, zero=1, sequence_parallel=True), "flash"),
    ("TP2 ZeRO-1 tied selective", "glm10b", dict(tp=2, zero=1, recompute="selective"), "flash"),
    ("TP2xPP2 SP ZeRO-1 tied", "glm10b", dict(tp=2, pp=2, zero=1, sequence_parallel=True), "eager"),
    ("DP2 ZeRO-3 tied", "glm10b", dict(dp=2, zero=3), "flash"),
    ("TP2xPP2 ZeRO-1 padded vocab", "glm10b-v1023", dict(tp=2, pp=2, zero=1), "flash"),
    # DeepSpeed-MoE (planner/model/moe.py) against the single-process MoE model, and
    # DeepSpeed-Ulysses (cp: block.py SelfAttention) against the single-process dense one
    ("EP2 ZeRO-0", "moe", dict(dp=2, ep=2, zero=0), "flash"),
    ("EP2xDP2 ZeRO-2", "moe", dict(dp=4, ep=2, zero=2), "flash"),
    ("EP2xTP2 ZeRO-1 QK-norm", "glm45", dict(dp=2, ep=2, tp=2, zero=1), "flash"),
    ("SP2 ZeRO-0", "chatglm3", dict(cp=2, zero=0), "flash"),
    ("SP2xDP2 ZeRO-2", "chatglm3", dict(cp=2, dp=2, zero=2), "flash"),
]


def _run(root: Path, name: str, model_key: str, attention: str = "flash", **plan_kw) -> dict:
    """Launch one plan for STEPS steps with gradient dumping; return its losses, gradients and norm."""
    micro, steps = MICRO_OF.get(model_key, MICRO), STEPS_OF.get(model_key, STEPS)
    plan = Plan(micro_batch=micro, grad_accum=GLOBAL_BATCH // (micro * plan_kw.get("dp", 1)), precision="fp32",
                bucket_elements=2_000_000, **plan_kw)
    model = MODELS[model_key]
    cluster = parse_cluster(f"{plan.world_size}xcpu")
    train = TrainSpec(global_batch=plan.global_batch, seq_len=SEQ, precision="fp32", attention=attention)
    d = root / name
    atomic_write_json(d / "plan.json", plan_document(plan, model, cluster, train, scale="tiny", model_arg=model_key))
    atomic_write_json(d / "ds_config.json", dsconfig.ds_config(plan, model, train, cluster))
    os.environ["PLANNER_DUMP_GRADS"] = str(d / "grads")
    try:
        metrics = launch.run_plan(d, steps=steps, warmup=1, timeout=300)
    finally:
        del os.environ["PLANNER_DUMP_GRADS"]
    assert metrics["status"] == "ok" and len(metrics["loss"]) == steps
    grads, norms = assemble(sorted((d / "grads").glob("rank*.pt")), plan.tp)
    shapes = json.loads((d / ".ranks" / "result.json").read_text())["ranks"]
    return {"loss": metrics["loss"], "grads": grads, "norms": norms, "ranks": shapes}


def assemble(files: list[Path], tp: int) -> tuple[dict[str, "torch.Tensor"], list[float]]:
    """Full gradients from every rank's dump: TP slices concatenated part by part along the
    split dimension; copies (DP ranks, the pipeline's tied copy) must agree."""
    pieces: dict[str, dict[int, "torch.Tensor"]] = {}
    splits: dict[str, tuple | None] = {}
    norms = []
    for f in files:
        dump = torch.load(f, weights_only=False)
        norms.append(dump["grad_norm"])
        t = dump["coords"][2]
        for g in dump["grads"]:
            seen = pieces.setdefault(g["name"], {})
            splits[g["name"]] = g["split"]
            if t in seen:  # a DP peer or the tied copy: the same averaged gradient
                assert _rel(g["grad"], seen[t]) < 1e-6, (g["name"], f.name)
            else:
                seen[t] = g["grad"]
    full = {}
    for name, by_rank in pieces.items():
        assert sorted(by_rank) == (list(range(tp)) if splits[name] else sorted(by_rank)), name
        if splits[name] is None:
            full[name] = by_rank[min(by_rank)]
            assert all(_rel(g, full[name]) < 1e-6 for g in by_rank.values()), name  # replicated over TP
            continue
        dim, parts = splits[name]
        chunks = [by_rank[r].split([p // tp for p in parts], dim) for r in range(tp)]
        full[name] = torch.cat([torch.cat([chunks[r][i] for r in range(tp)], dim) for i in range(len(parts))], dim)
    return full, norms


def _rel(a: "torch.Tensor", ref: "torch.Tensor") -> float:
    return float((a - ref).norm() / ref.norm().clamp(min=1e-30))


def _tp2_slices(ranks: list[dict]) -> None:
    """TP 2 with the executor's Megatron-style layers (no AutoTP): each rank holds half the
    heads and KV groups, half the FFN, half the padded vocabulary; norms are replicated."""
    h, q, kv, f, v = 128, 128, 64, 432, 1024  # chatglm3-6b tiny: 4 heads x 32, 2 KV groups, SwiGLU, vocab 1024
    # per rank: embedding V/2 x h; per block QKV (q + 2kv)/2 x h + bias, dense h x q/2, gate|up 2 (f/2) x h,
    # down h x f/2, two RMSNorm weights; final norm; output layer V/2 x h (no linear biases in ChatGLM3)
    block = (q + 2 * kv) // 2 * h + (q + 2 * kv) // 2 + h * q // 2 + 2 * (f // 2) * h + h * f // 2 + 2 * h
    per_rank = v // 2 * h + 4 * block + h + v // 2 * h
    assert per_rank == 562_816
    for r in ranks:
        shapes = r["param_shapes"]
        assert shapes["layers.0.self_attention.query_key_value.weight"] == [(q + 2 * kv) // 2, h]
        assert shapes["layers.0.mlp.dense_h_to_4h.weight"] == [f, h] and shapes["layers.0.mlp.dense_4h_to_h.weight"] == [h, f // 2]
        assert shapes["embedding.word_embeddings.weight"] == [v // 2, h]
        assert shapes["head.output_layer.weight"] == [v // 2, h]
        assert shapes["layers.0.input_layernorm.weight"] == [h]
        assert r["local_params"] == per_rank


def _pp2_partial_recompute(ranks: list[dict]) -> None:
    """Stages of 3 and 1 blocks, the first two blocks of stage 0 checkpointed, as planned."""
    assert [r["checkpointed_blocks"] for r in ranks] == [[True, True, False], [False]]
    assert ranks[0]["local_params"] != ranks[1]["local_params"]


def _tp2_pp2_dp2_coords(ranks: list[dict]) -> None:
    """Eight processes: rank -> (pp, dp, tp) as the plan lays them out, TP fastest, then DP, then
    the stage (rank = 4 pp + 2 dp + tp)."""
    assert [r["coords"] for r in ranks] == [[0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 1, 1],
                                            [1, 0, 0], [1, 0, 1], [1, 1, 0], [1, 1, 1]]


# what a case's ranks hold besides the parity (result.json's per-rank records, in rank order)
LAYOUT_CHECKS = {"TP2 SP ZeRO-1": _tp2_slices, "PP2 ZeRO-0 partial recompute": _pp2_partial_recompute,
                 "TP2xPP2xDP2 ZeRO-1": _tp2_pp2_dp2_coords}


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("parity")
    cache: dict[str, dict] = {}

    def get(model_key: str) -> dict:
        if model_key not in cache:
            cache[model_key] = _run(root, f"ref-{model_key}", model_key)
        return cache[model_key]
    return root, get


@pytest.mark.parametrize("case", CASES, ids=[c[0].replace(" ", "_") for c in CASES])
def test_layout_reproduces_single_process(case, references) -> None:
    name, model_key, plan_kw, attention = case
    root, reference = references
    ref = reference(model_key)
    model = MODELS[model_key]
    got = _run(root, name.replace(" ", "_"), model_key, attention, **plan_kw)
    LAYOUT_CHECKS.get(name, lambda ranks: None)(sorted(got["ranks"], key=lambda r: r["rank"]))
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(got["loss"], ref["loss"]))
    grad_err = {}
    for key, want in ref["grads"].items():
        have = got["grads"][key]
        if have.shape != want.shape:  # padded vocabulary: the padded rows get no gradient
            assert have.shape[1:] == want.shape[1:] and have.shape[0] == model.padded_vocab(plan_kw.get("tp", 1))
            assert float(have[want.shape[0]:].abs().max()) == 0.0, key
            have = have[:want.shape[0]]
        grad_err[key] = _rel(have, want)
    assert set(got["grads"]) == set(ref["grads"])
    norm_err = max(abs(n - ref["norms"][0]) / ref["norms"][0] for n in got["norms"])
    worst = max(grad_err, key=grad_err.get)
    print(f"\nPARITY | {name} | {model.name} | loss {loss_err:.1e} | grad {grad_err[worst]:.1e} ({worst}) | "
          f"grad norm {norm_err:.1e}")
    assert loss_err < TOL, (got["loss"], ref["loss"])
    assert grad_err[worst] < TOL, (worst, grad_err[worst])
    assert norm_err < TOL, (got["norms"], ref["norms"])


@pytest.mark.parametrize("sp", [False, True], ids=["TP2", "TP2_SP"])
def test_dropout_keeps_the_tp_ranks_in_step(sp: bool, tmp_path: Path) -> None:
    """With dropout (GLM-10B's 0.1) a TP run has no single-process twin, but its TP ranks must
    agree: hidden dropout on replicated activations draws the same mask on every TP rank (the
    default generator), attention dropout on head slices and, under SP, hidden dropout on
    sequence shards draw per-rank masks (the tracker). Replicated parameters' gradients then
    agree across TP ranks, which `assemble` asserts."""
    got = _run(tmp_path, "dropout", "glm10b-dropout", tp=2, zero=1, sequence_parallel=sp)
    assert all(x == x for x in got["loss"]) and "layers.0.input_layernorm.weight" in got["grads"]
