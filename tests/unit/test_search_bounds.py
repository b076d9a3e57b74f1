"""The pruned exhaustive sweep (planner.search.exhaustive.pruned_sweep) and its bounds
(planner.search.bounds): the same top plans in the same order as estimating every plan, and
bounds that are bounds on every point of small spaces covering ZeRO variants and selective
recompute, context parallelism, expert parallelism and fp8, on each runtime."""
from __future__ import annotations

import dataclasses
from functools import lru_cache

import pytest

from planner.cost import estimate, layer_costs
from planner.search import Evaluator, Space, rank
from planner.search.bounds import Bounds
from planner.search.evaluate import best_of
from planner.search.exhaustive import PRUNED, pruned_sweep
from planner.specs import TrainSpec, parse_cluster, preset, scale

SPACES = {
    # GLM-10B small, eager attention: ZeRO 0-3 with their variants, selective recompute
    "variants": (scale(preset("glm-10b"), "small"), "4x8xA100", TrainSpec(global_batch=32, seq_len=1024,
                                                                           attention="eager"), "deepspeed"),
    # GLM-4-9B at 64k tokens on one node: Ulysses and ring context parallelism
    "cp-deepspeed": (preset("glm-4-9b"), "8xA100-80GB", TrainSpec(global_batch=16, seq_len=65536), "deepspeed"),
    "cp-megatron": (preset("glm-4-9b"), "8xA100-80GB", TrainSpec(global_batch=16, seq_len=65536), "megatron-core"),
    "cp-fsdp": (preset("glm-4-9b"), "8xA100-80GB", TrainSpec(global_batch=16, seq_len=65536), "fsdp"),
    # GLM-4.5-Air on 4x8xH100: expert parallelism and fp8 beside bf16
    "moe-fp8": (preset("glm-4.5-air"), "4x8xH100", TrainSpec(global_batch=64, seq_len=4096), "megatron-core"),
}


def space_of(name: str) -> tuple[Space, Evaluator]:
    model, gpus, train, runtime = SPACES[name]
    cluster = parse_cluster(gpus)
    space = Space(model=model, cluster=cluster, train=train, runtime=runtime,
                  megatron_features=runtime == "megatron-core", max_interleave=2)
    return space, Evaluator(model, cluster, train, runtime=runtime)


@lru_cache(maxsize=None)
def every(name: str) -> list:
    """Every (point, precision) of the space estimated: (outer, precision, trial)."""
    space, ev = space_of(name)
    return [(o, p, ev.evaluate_in(o, p, "exhaustive")) for o in space.points() for p in ev.precisions]


@lru_cache(maxsize=None)
def full_rank(name: str) -> list:
    """rank(exhaustive(...)): each point's trial is the best of its precisions (Evaluator)."""
    rows = every(name)
    n = len(space_of(name)[1].precisions)
    return rank([best_of([t for _, _, t in rows[i:i + n]]) for i in range(0, len(rows), n)])


@lru_cache(maxsize=None)
def sweep_of(name: str, top: int):
    space, ev = space_of(name)
    return pruned_sweep(space, ev, top=top)


@pytest.mark.parametrize("name", sorted(SPACES))
@pytest.mark.parametrize("top", [1, 5])
def test_pruned_sweep_returns_the_same_top_plans_in_the_same_order(name, top):
    space, ev = space_of(name)
    full = full_rank(name)
    sweep = sweep_of(name, top)
    got = rank(sweep.trials)
    assert full, name
    assert [(t.plan, t.tokens_per_s, t.needs_bytes) for t in got[:top]] == \
        [(t.plan, t.tokens_per_s, t.needs_bytes) for t in full[:top]]
    # it did prune, and every pair is either estimated or pruned for one reason
    assert sweep.estimated <= sweep.candidates // 2  # cp-fsdp under link classes: exactly half (34 of 68)
    assert sweep.estimated + sum(sweep.pruned.values()) == sweep.candidates == sweep.points * len(ev.precisions)
    assert set(sweep.pruned) == set(PRUNED)


def test_each_bound_prunes_somewhere():
    seen = {k: 0 for k in PRUNED}
    for name in SPACES:
        for k, n in sweep_of(name, 5).pruned.items():
            seen[k] += n
    assert all(seen.values()), seen


@pytest.mark.parametrize("name", sorted(SPACES))
def test_the_bounds_are_bounds(name):
    """Never above the estimate's step time or below its memory, on every point: so a plan the
    throughput bound discards cannot beat the plan it is compared with, and one the memory
    bound discards cannot fit."""
    space, ev = space_of(name)
    bounds = Bounds(space.model, space.cluster, space.train, ev.runtime)
    checked = 0
    for outer, precision, trial in every(name):
        if trial.estimate is not None:
            assert trial.estimate.step_time_s >= bounds.step_lower(outer, precision) * (1 - 1e-12), (outer, precision)
            assert bounds.tokens_upper(outer, precision) >= trial.estimate.tokens_per_s * (1 - 1e-12)
            checked += 1
        # the memory the estimate needs, or the least any split needs (solver's NoFit)
        assert trial.needs_bytes >= bounds.memory_lower(outer, precision) * (1 - 1e-12), (outer, precision)
    assert checked


@pytest.mark.parametrize("name", sorted(SPACES))
def test_every_plan_at_least_as_fast_as_the_top_th_is_estimated(name):
    """The throughput bound never prunes a plan that beats (or ties) the top-th best."""
    top = 5
    sweep = sweep_of(name, top)
    full = full_rank(name)
    bar = full[min(top, len(full)) - 1].tokens_per_s
    estimated = {t.plan for t in sweep.trials}
    assert all(t.plan in estimated for t in full if t.tokens_per_s >= bar)


def _one_stage_plan():
    model, gpus, train, _ = SPACES["variants"]
    cluster = parse_cluster(gpus)
    space = Space(model=model, cluster=cluster, train=train, max_interleave=1)
    outer = next(o for o in space.points() if o.pp == 1 and o.tp == 2 and o.zero == 1 and o.recompute == "none"
                 and o.variant is None and o.micro_batch == 2)
    return model, cluster, train, outer


def test_step_bound_by_hand_on_one_stage():
    """One stage (pp 1, no recompute): the estimate's step less the terms the bound drops (DP
    sync, ZeRO-3 gathers, the optimizer, point-to-point) is exactly m x (L block_time + first
    + last + micro-batch overhead) + step overhead, the bound."""
    model, cluster, train, outer = _one_stage_plan()
    plan = outer.plan("bf16", stage_layers=(model.layers,))
    est = estimate(model, cluster, train, plan)
    lc = layer_costs(model, cluster, train, plan)
    b = Bounds(model, cluster, train, "deepspeed")
    by_hand = plan.grad_accum * (model.layers * lc.block_time + lc.first_stage_time + lc.last_stage_time
                                 + b.mb_overhead) + b.step_overhead
    t = est.time
    assert b.step_lower(outer, "bf16") == pytest.approx(by_hand, rel=1e-12)
    assert b.step_lower(outer, "bf16") == pytest.approx(
        est.step_time_s - t.dp_sync - t.zero_gather - t.optimizer - t.pp_comm - t.bubble, rel=1e-9)
    assert t.dp_sync + t.optimizer > 0


def test_memory_bound_by_hand_on_one_stage():
    """One stage: the bound is the stage's parameters + gradients + optimizer states + the
    fixed allowance of the estimate's own breakdown."""
    model, cluster, train, outer = _one_stage_plan()
    est = estimate(model, cluster, train, outer.plan("bf16", stage_layers=(model.layers,)))
    m = est.stage_memory[0]
    lc = layer_costs(model, cluster, train, outer.plan("bf16"))
    b = Bounds(model, cluster, train, "deepspeed")
    assert b.memory_lower(outer, "bf16") == pytest.approx(m.params + m.grads + m.optimizer + lc.fixed_bytes, rel=1e-12)
    assert m.params > 0 and m.grads > 0 and m.optimizer > 0


def test_pipeline_bounds_take_the_slowest_stage_and_the_fill():
    """pp > 1: at least the slowest stage's m micro-batches plus the fill and drain of the
    others, and the memory of the stage with the most blocks' states."""
    model, gpus, train, _ = SPACES["variants"]
    cluster = parse_cluster(gpus)
    space = Space(model=model, cluster=cluster, train=train, max_interleave=1)
    outer = next(o for o in space.points() if o.pp == 2 and o.tp == 1 and o.zero == 0 and o.recompute == "none"
                 and o.micro_batch == 1)
    b = Bounds(model, cluster, train, "deepspeed")
    lc = layer_costs(model, cluster, train, outer.plan("bf16"))
    L, mbo = model.layers, b.mb_overhead
    total = L * lc.block_time + lc.first_stage_time + lc.last_stage_time + 2 * mbo
    slowest = max(total / 2, -(-L // 2) * lc.block_time + mbo, lc.block_time + lc.first_stage_time + mbo,
                  lc.block_time + lc.last_stage_time + mbo)
    assert b.step_lower(outer, "bf16") == pytest.approx(outer.grad_accum * slowest + (total - slowest)
                                                        + b.step_overhead, rel=1e-12)
    interleaved = dataclasses.replace(outer, interleave=2)
    assert b.step_lower(interleaved, "bf16") == pytest.approx(outer.grad_accum * slowest + (total - slowest) / 2
                                                              + b.step_overhead, rel=1e-12)


@pytest.mark.parametrize("name", ["variants", "moe-fp8"])
def test_the_reference_is_the_every_plan_sweep(name):
    """full_rank (each precision estimated, the best kept) is rank(exhaustive(...)) itself."""
    from planner.search.exhaustive import exhaustive
    space, ev = space_of(name)
    assert [(t.plan, t.tokens_per_s) for t in rank(exhaustive(space, ev))] == \
        [(t.plan, t.tokens_per_s) for t in full_rank(name)]


# --- planner search --exhaustive --prune K ----------------------------------------------------
def test_cli_prune_keeps_the_top_plans(tmp_path):
    import json
    from planner.cli import main
    common = ["search", "--model", "glm-10b", "--scale", "small", "--gpus", "4x8xA100", "--global-batch", "32",
              "--seq-len", "1024", "--out-dir", str(tmp_path), "--exhaustive", "--top", "3"]
    assert main(common + ["--name", "every"]) == 0
    assert main(common + ["--name", "pruned", "--prune", "3"]) == 0
    every = json.loads((tmp_path / "every" / "estimate.json").read_text())
    pruned = json.loads((tmp_path / "pruned" / "estimate.json").read_text())
    assert [t["plan"] for t in pruned["top"]] == [t["plan"] for t in every["top"]]
    assert "pruned" not in every["search"] and sum(pruned["search"]["pruned"].values()) > 0
    assert pruned["search"]["rows"] < every["search"]["rows"] == every["search"]["space_size"]


@pytest.mark.parametrize("extra, words", [([], "--prune: prunes the exhaustive sweep"),
                                          (["--exhaustive", "--objective", "cost"], "not the cheapest")])
def test_cli_prune_refusals(tmp_path, capsys, extra, words):
    from planner.cli import main
    rc = main(["search", "--model", "glm-10b", "--scale", "small", "--gpus", "4x8xA100", "--out-dir", str(tmp_path),
               "--prune", "3"] + extra)
    assert rc == 2
    assert words in capsys.readouterr().err
