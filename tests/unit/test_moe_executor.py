"""The executor's mixture-of-experts and Ulysses parts in one process (planner/model/moe.py,
block.py), and `planner run` refusing the MoE / context-parallel plans it cannot run in one line
(exit 2). The distributed behaviour (EP, EP x DP, EP x TP, Ulysses SP, SP x DP against the
single-process model) is tests/integration/test_parity.py's."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from planner.cli import main  # noqa: E402
from planner.errors import SpecError  # noqa: E402
from planner.model.block import head_group  # noqa: E402
from planner.model.glm import GLMModel  # noqa: E402
from planner.model.moe import Expert, MoEFFN, Router, capacity  # noqa: E402
from planner.model.parallel.groups import SINGLE, TPGroup  # noqa: E402
from planner.specs import Plan, preset, scale  # noqa: E402
from planner.specs.moe import MoESpec  # noqa: E402
from planner.specs.validate import executor_problems  # noqa: E402
from planner.specs import parse_cluster  # noqa: E402

MOE = scale(preset("glm-4.5-air"), "tiny")  # 4 experts, top-2, sigmoid router, 1 shared expert, block 0 dense


def _spec(router: str = "sigmoid", shared: int = 1, cf: float = 0.0):
    return dataclasses.replace(MOE, moe=dataclasses.replace(MOE.moe, router=router, shared_experts=shared,
                                                            capacity_factor=cf))


# --- routing and capacity, hand-computed --------------------------------------------------------

def test_sigmoid_router_chooses_by_score_plus_bias_and_weights_by_score() -> None:
    r = Router(_spec("sigmoid"), 1, SINGLE, 0)
    with torch.no_grad():
        r.weight.zero_()
        r.weight[:, 0] = torch.tensor([0.0, 1.0, 2.0, 3.0])  # logit of expert e = e * x0
        r.e_score_correction_bias.copy_(torch.tensor([10.0, 0.0, 0.0, 0.0]))  # bias makes expert 0 a choice
    x = torch.zeros(1, MOE.hidden)
    x[0, 0] = 1.0
    idx, w = r.route(x)
    assert sorted(idx[0].tolist()) == [0, 3]
    s0, s3 = torch.sigmoid(torch.tensor(0.0)), torch.sigmoid(torch.tensor(3.0))
    # weights are the chosen scores (not score + bias), normalised to sum 1
    want = {0: float(s0 / (s0 + s3)), 3: float(s3 / (s0 + s3))}
    w = w.detach()
    assert {int(i): float(v) for i, v in zip(idx[0], w[0])} == pytest.approx(want, rel=1e-6)


def test_softmax_router_weights_are_the_top_k_probabilities_normalised() -> None:
    r = Router(_spec("softmax"), 1, SINGLE, 0)
    with torch.no_grad():
        r.weight.zero_()
        r.weight[:, 0] = torch.tensor([0.0, 1.0, 2.0, 3.0])
    x = torch.zeros(1, MOE.hidden)
    x[0, 0] = 1.0
    idx, w = r.route(x)
    w = w.detach()
    assert idx[0].tolist() == [3, 2]
    e2, e3 = torch.exp(torch.tensor(2.0)), torch.exp(torch.tensor(3.0))
    assert w[0].tolist() == pytest.approx([float(e3 / (e2 + e3)), float(e2 / (e2 + e3))], rel=1e-6)


def test_capacity() -> None:
    counts = torch.tensor([3, 7, 1, 5])
    assert capacity(counts, 16, 4, 2, 0.0, 1) == 7          # dropless: the busiest expert
    assert capacity(counts, 16, 4, 2, 0.0, 2) == 8          # rounded up to a multiple of TP
    assert capacity(counts, 16, 4, 2, 1.25, 1) == 10        # ceil(1.25 x 2 x 16 / 4)
    assert capacity(counts, 3, 4, 1, 1.0, 1) == 1           # ceil(0.75)


def test_capacity_factor_drops_routes_past_the_slots_in_token_order() -> None:
    spec = _spec("softmax", cf=1.0)
    spec = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, top_k=1))
    r = Router(spec, 1, SINGLE, 0)
    with torch.no_grad():
        r.weight.zero_()
        r.weight[0, 0] = 1.0  # every token with x0 > 0 goes to expert 0
    x = torch.zeros(8, MOE.hidden)
    x[:, 0] = 1.0
    _, cap, e, indices, locations, gates, counts = r(x)
    assert cap == 2 and e == 4  # ceil(1.0 x 1 x 8 / 4)
    assert indices[0].tolist() == [0, 0, -1, -1, -1, -1, -1, -1]
    assert locations[0, :2].tolist() == [0, 1] and counts.tolist() == [8, 0, 0, 0]
    assert float(gates[0, 2:].abs().sum()) == 0.0


# --- the MoE FFN against a plain loop over tokens -----------------------------------------------

def _by_hand(ffn: MoEFFN, x: torch.Tensor) -> torch.Tensor:
    """sum over each token's k routed experts of weight x expert(token), plus the shared FFN."""
    flat = x.reshape(-1, x.shape[-1])
    idx, w = ffn.moe.deepspeed_moe.gate.route(flat)
    experts = ffn.moe.deepspeed_moe.experts.deepspeed_experts
    out = torch.stack([sum(w[t, j] * experts[int(idx[t, j])](flat[t:t + 1])[0] for j in range(idx.shape[1]))
                       for t in range(flat.shape[0])])
    out = out.reshape(x.shape)
    return out if ffn.shared is None else out + ffn.shared(x)


@pytest.mark.parametrize("router, shared", [("sigmoid", 1), ("softmax", 0)])
def test_moe_ffn_is_the_weighted_sum_of_the_chosen_experts(router, shared) -> None:
    from planner.model.block import MLP
    spec = _spec(router, shared)
    sh = MLP(spec, 1, SINGLE, 7, ffn=spec.moe.shared_size, name="shared_experts") if shared else None
    ffn = MoEFFN(spec, 1, SINGLE, SINGLE, 7, sh)
    x = torch.randn(2, 5, spec.hidden, generator=torch.Generator().manual_seed(0))
    got, want = ffn(x), _by_hand(ffn, x)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert len(list(ffn.moe.deepspeed_moe.experts.deepspeed_experts)) == 4


def test_experts_are_seeded_by_global_index_and_marked_for_deepspeed() -> None:
    """EP 2, rank 1 holds experts 2 and 3, identical to the single-process model's, with
    DeepSpeed-MoE's markers (allreduce False: reduced over the expert-data-parallel group)."""
    whole = MoEFFN(MOE, 1, SINGLE, SINGLE, 3)
    half = MoEFFN(MOE, 1, SINGLE, TPGroup(rank=1, size=2), 3)
    mine = half.moe.deepspeed_moe.experts.deepspeed_experts
    ref = whole.moe.deepspeed_moe.experts.deepspeed_experts
    assert len(mine) == 2
    for j, e in enumerate(mine):
        assert torch.equal(e.dense_h_to_4h, ref[2 + j].dense_h_to_4h)
        assert torch.equal(e.dense_4h_to_h, ref[2 + j].dense_4h_to_h)
        assert e.dense_h_to_4h.canonical == f"layers.1.mlp.experts.{2 + j}.dense_h_to_4h.weight"
        assert all(p.allreduce is False and p.group_name == "ep_size_2" for p in e.parameters())
    assert torch.equal(half.moe.deepspeed_moe.gate.weight, whole.moe.deepspeed_moe.gate.weight)


def test_expert_shape() -> None:
    e = Expert(MOE, 1, 0, SINGLE, 0)
    f = MOE.moe.expert_ffn
    assert tuple(e.dense_h_to_4h.shape) == (2 * f, MOE.hidden) and tuple(e.dense_4h_to_h.shape) == (MOE.hidden, f)


def test_dense_blocks_first_then_moe_blocks() -> None:
    m = GLMModel(MOE, [False] * MOE.layers, False)
    kinds = [type(b.mlp).__name__ for b in m.layers]
    assert kinds == ["MLP"] + ["MoEFFN"] * (MOE.layers - 1)
    # one MoE block's parameters: attention + norms + router + 4 experts + shared expert
    blk = sum(p.numel() for p in m.layers[1].parameters())
    assert blk == MOE.moe_dense_params + MOE.moe.experts * MOE.expert_params


def test_head_group_of_ulysses_ranks() -> None:
    """TP rank t, cp rank c of cp 2: heads slice 2t + c of tp x cp (ALiBi's slopes)."""
    g = head_group(TPGroup(rank=1, size=2), TPGroup(rank=1, size=2))
    assert (g.rank, g.size) == (3, 4)
    assert head_group(TPGroup(rank=1, size=2), SINGLE) == TPGroup(rank=1, size=2)


# --- what `planner run` runs and refuses ----------------------------------------------------------

def test_executor_runs_moe_and_ulysses_with_pp_1_only() -> None:
    c = parse_cluster("4xcpu")
    assert executor_problems(MOE, c, Plan(dp=4, ep=2)) == []
    assert executor_problems(scale(preset("chatglm3-6b"), "tiny"), c, Plan(dp=2, cp=2)) == []
    p = executor_problems(MOE, c, Plan(dp=2, pp=2, ep=2))
    assert [x.code for x in p] == ["executor-layers"] and p[0].field == "plan.pp"


def test_search_rules_keep_pipelined_moe_and_ulysses_out() -> None:
    """The same rule is a DeepSpeed runtime rule when the search passes the model (launch.sh
    starts the same executor): a MoE model at pp 2 (even with ep 1), cp 2 at pp 2; not a dense
    pp 2 plan, nor MoE / cp at pp 1; without the model (preflight, exports) nothing changes."""
    from planner.specs.validate import runtime_problems
    glm = scale(preset("chatglm3-6b"), "tiny")
    for model, plan in ((MOE, Plan(dp=2, pp=2, ep=2)), (MOE, Plan(dp=2, pp=2)), (glm, Plan(dp=1, pp=2, cp=2))):
        assert [x.code for x in runtime_problems(plan, model)] == ["executor-layers"], plan.describe()
        assert runtime_problems(plan) == []
    for model, plan in ((glm, Plan(dp=2, pp=2)), (MOE, Plan(dp=4, ep=2)), (glm, Plan(dp=2, cp=2))):
        assert runtime_problems(plan, model) == [], plan.describe()


def _moe_run(d: Path, plan: Plan, model: str = "glm-4.5-air", gpus: str = "4xcpu") -> Path:
    """A run directory as `planner search` writes it (tests/unit/test_run_guard.py write_run)."""
    from planner import dsconfig
    from planner.rundir import atomic_write_json, plan_document
    from planner.specs import TrainSpec
    spec, cluster = scale(preset(model), "tiny"), parse_cluster(gpus)
    train = TrainSpec(global_batch=plan.global_batch, seq_len=128, precision="bf16")
    atomic_write_json(d / "plan.json", plan_document(plan, spec, cluster, train, scale="tiny", model_arg=model,
                                                     command="test"))
    atomic_write_json(d / "ds_config.json", dsconfig.ds_config(plan, spec, train, cluster))
    return d


@pytest.mark.parametrize("plan, gpus, edit, says", [
    # EP not dividing the data-parallel ranks (Plan refuses it when plan.json is read)
    (Plan(dp=4, ep=2, micro_batch=1, grad_accum=2), "4xcpu", lambda p: p.update(ep=3),
     "error: plan.ep: 3 does not divide the data-parallel size 4 (fix: use an expert-parallel size dividing 4)"),
    # EP not dividing the 4 experts
    (Plan(dp=3, ep=3, micro_batch=1, grad_accum=2), "3xcpu", lambda p: None,
     "error: plan.json plan.ep: plan.ep 3 does not divide the 4 experts"),
    # Ulysses SP not dividing the heads / KV groups
    (Plan(dp=4, ep=2, micro_batch=1, grad_accum=2), "4xcpu", lambda p: p.update(dp=1, ep=1, cp=4, grad_accum=8),
     "error: plan.json plan.cp: Ulysses cp 4 x tp 1 does not divide the 2 KV groups"),
])
def test_planner_run_refuses_bad_moe_and_cp_plans_in_one_line(tmp_path, capsys, monkeypatch, plan, gpus, edit,
                                                              says) -> None:
    from planner.runtime.train import launch

    def popen(*a, **k):
        raise AssertionError("a rank was started")
    monkeypatch.setattr(launch.subprocess, "Popen", popen)
    d = _moe_run(tmp_path, plan, gpus=gpus)
    doc = json.loads((d / "plan.json").read_text())
    edit(doc["plan"])
    (d / "plan.json").write_text(json.dumps(doc))
    assert main(["run", str(d)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(says) and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (d / ".ranks").exists()


def test_ep_not_dividing_the_experts_is_refused_in_one_line(tmp_path, capsys, monkeypatch) -> None:
    spec = dataclasses.replace(MOE, moe=dataclasses.replace(MOE.moe, experts=6))
    from planner.specs.validate import moe_problems
    p = moe_problems(spec, Plan(dp=4, ep=4))
    assert p[0].field == "plan.ep" and "does not divide the 6 experts" in p[0].message
    with pytest.raises(SpecError):
        Plan(dp=4, ep=3)


# --- the model states the executor counts, predicted (planner/cost/states.py) -------------------

def _states(model, plan: Plan, rank: int, world: str) -> dict[str, float]:
    from planner.cost.states import rank_states
    from planner.specs import TrainSpec
    train = TrainSpec(global_batch=plan.global_batch, seq_len=32, precision="fp32")
    return rank_states(model, parse_cluster(world), train, plan, rank)["device"]


def test_expert_states_are_experts_over_ep_hand_computed() -> None:
    """GLM-4.5-Air tiny, fp32: 871,040 parameters; a MoE block's 4 experts are 4 x 18,432
    (SwiGLU 2 x 48 x 128 + 128 x 48) in 3 MoE blocks. EP 2, ZeRO-0: each rank holds half the
    experts whole (measured by tests/integration/test_parity.py EP2 ZeRO-0: 3,041,792 B)."""
    expert = 2 * 48 * 128 + 128 * 48
    assert MOE.expert_params == expert and MOE.moe_layers == 3
    psi = 871_040 - 3 * 2 * expert
    got = _states(MOE, Plan(dp=2, ep=2, micro_batch=1, grad_accum=2, precision="fp32"), 1, "2xcpu")
    assert got["params"] == got["grads"] == 4 * psi == 3_041_792
    assert got["optimizer"] == 8 * psi                     # two fp32 Adam moments


def test_expert_states_partition_over_expert_data_parallel_ranks() -> None:
    """EP 2 x DP 4, ZeRO-2 fp32: the dense group partitions over 4 ranks, the experts over the
    dp / ep = 2 ranks that hold the same experts (DeepSpeed's MoE parameter group)."""
    dense = 871_040 - 3 * 4 * MOE.expert_params
    experts = 3 * 2 * MOE.expert_params                    # this rank's: 2 of 4 per MoE block
    got = _states(MOE, Plan(dp=4, ep=2, zero=2, micro_batch=1, grad_accum=1, precision="fp32"), 0, "4xcpu")
    # fp32 ZeRO-2: master weights + two moments (12 B) of the rank's partition of each group
    assert got["optimizer"] == 12 * (dense / 4 + experts / 2)


def test_context_parallel_ranks_partition_like_data_parallel_ones() -> None:
    """Ulysses SP 2 x DP 2, ZeRO-2 fp32, chatglm3 tiny (1,124,480 parameters): ZeRO partitions
    over the 4 sequence-data-parallel ranks (measured: optimizer 3,373,448 B per rank, of which
    8 B are Adam's step counter)."""
    tiny = scale(preset("chatglm3-6b"), "tiny")
    got = _states(tiny, Plan(dp=2, cp=2, zero=2, micro_batch=1, grad_accum=2, precision="fp32"), 3, "4xcpu")
    assert got["optimizer"] == 12 * 1_124_480 / 4 == 3_373_440


def test_search_offers_ulysses_at_short_sequences_when_asked() -> None:
    """search(context_parallel="on") reaches the Space (benchmarks/plans_start.py
    --context-parallel on sweeps the tiny Ulysses plans with it); "auto" offers cp only from
    16,384 tokens."""
    from planner.search.driver import search
    from planner.specs import TrainSpec
    tiny = scale(preset("chatglm3-6b"), "tiny")
    cluster, train = parse_cluster("2xcpu"), TrainSpec(global_batch=8, seq_len=128)
    on = search(tiny, cluster, train, exhaustive=True, context_parallel="on")
    auto = search(tiny, cluster, train, exhaustive=True)
    assert any(t.plan.cp == 2 for t in on.ranked) and not any(t.plan.cp > 1 for t in auto.ranked)
