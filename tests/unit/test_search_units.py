"""The search's parts one at a time: the baseline's branches, the evaluator's cache and labels,
the exact solvers' edge cases, the space's rules, the heuristic start and Optuna's bookkeeping."""
from __future__ import annotations

import dataclasses

import optuna
import pytest

from planner.cost import estimate, layer_costs
from planner.errors import SpecError
from planner.search import Evaluator, Space, conventional_baseline, pareto_front, rank
from planner.search.baseline import baseline_note
from planner.search.checkpoint import StageModel
from planner.search.exhaustive import exhaustive
from planner.search.heuristic import heuristic
from planner.search.optuna_search import (evaluate_shape, neighbours, optuna_search, params_of, shape_from_params,
                                          study_name)
from planner.search.partition import NoFit, Partition, least_bytes, solve
from planner.search.space import Outer, Shape, divisors
from planner.specs import Plan, TrainSpec, parse_cluster, preset, scale

A100_40GB = 40448 * 2.0 ** 20
"""An A100 40GB's capacity: the CUDA driver's total, 40,448 MiB (profiles/A100-40GB.json memory_total_mib)."""


def small_space(**kw) -> Space:
    """GLM-10B at small scale on 4x8xA100: 45 shapes, a few hundred plans."""
    m, c = scale(preset("glm-10b"), "small"), parse_cluster("4x8xA100")
    t = TrainSpec(global_batch=32, seq_len=1024, attention="eager")
    return Space(model=m, cluster=c, train=t, max_interleave=1, **kw)


# --- baseline ------------------------------------------------------------------------------
def test_baseline_when_the_batch_does_not_split_over_every_device():
    m, c = preset("chatglm3-6b"), parse_cluster("8xA100")
    t = TrainSpec(global_batch=20, seq_len=128)
    plan, est = conventional_baseline(m, c, t, precision="fp32")
    # 20 does not split over 8 ranks: plain DP trains the next multiple, 24 = 8 x 1 x 3 (a legal plan)
    assert plan == Plan(dp=8, micro_batch=1, grad_accum=3, precision="fp32")
    assert not est.feasible and not any("global batch" in r for r in est.reasons)
    assert "GB >" in est.reasons[0]                                           # 6B in fp32 + Adam: no fit
    assert baseline_note(plan, t).startswith("the baseline trains a global batch of 24 sequences: 20 does not")
    assert est.stage_memory[0].params == 2 * est.stage_memory[0].optimizer / 4     # fp32: 4 vs 8 bytes


def test_baseline_when_nothing_fits_returns_the_leanest_attempt():
    m, c = preset("glm-130b"), parse_cluster("8xA100-40GB")
    plan, est = conventional_baseline(m, c, TrainSpec(global_batch=64, seq_len=2048))
    assert (plan.dp, plan.micro_batch, plan.grad_accum) == (8, 1, 8)
    assert not est.feasible and est.peak_memory_bytes > 40e9
    assert est.peak_memory_bytes == estimate(m, c, TrainSpec(global_batch=64, seq_len=2048), plan).peak_memory_bytes


def test_baseline_in_another_precision_is_estimated_in_it():
    m, c = scale(preset("chatglm3-6b"), "small"), parse_cluster("8xA100-40GB")
    t = TrainSpec(global_batch=64, seq_len=1024)
    plan, est = conventional_baseline(m, c, t, precision="fp32")
    psi = est.stage_memory[0].params / 4                      # fp32 weights, bare AdamW
    assert plan.precision == "fp32" and est.stage_memory[0].optimizer == 8 * psi
    same, _ = conventional_baseline(m, c, t, precision="bf16")
    assert same == conventional_baseline(m, c, t)[0]


# --- evaluator -----------------------------------------------------------------------------
def test_evaluator_caches_and_relabels():
    space = small_space()
    ev = Evaluator(space.model, space.cluster, space.train)
    outer = next(iter(space.points()))
    first = ev(outer, "exhaustive")
    assert first.source == "exhaustive" and ev(outer, "exhaustive") is first
    again = ev(outer, "optuna")
    assert again.source == "optuna" and again.plan == first.plan and ev.cache[outer] is first


def test_full_recompute_records_the_checkpointed_blocks_or_drops_to_none():
    m, c = preset("glm-10b"), parse_cluster("8xA100-40GB")
    t = TrainSpec(global_batch=64, seq_len=768)
    ev = Evaluator(m, c, t)
    needs = ev(Outer(tp=1, pp=2, dp=4, zero=1, micro_batch=1, grad_accum=16, recompute="full",
                     sequence_parallel=False, interleave=1), "exhaustive")
    assert needs.feasible and needs.plan.recompute == "full"
    assert needs.plan.stage_layers and sum(needs.plan.stage_layers) == 48
    assert 0 < sum(needs.plan.recompute_layers) < 48
    easy = ev(Outer(tp=8, pp=1, dp=1, zero=1, micro_batch=1, grad_accum=64, recompute="full",
                    sequence_parallel=False, interleave=1), "exhaustive")
    assert easy.feasible and easy.plan.recompute == "none" and easy.plan.recompute_layers == ()


def test_a_shape_no_split_can_fit_is_a_value_with_the_memory_it_needs():
    m, c = preset("glm-130b"), parse_cluster("8xA100-40GB")
    t = TrainSpec(global_batch=8, seq_len=2048)
    outer = Outer(tp=1, pp=2, dp=4, zero=1, micro_batch=1, grad_accum=2, recompute="none", sequence_parallel=False,
                  interleave=1)
    trial = Evaluator(m, c, t)(outer, "optuna")
    assert not trial.feasible and trial.estimate is None and trial.source == "optuna" and trial.outer == outer
    assert trial.needs_bytes > trial.capacity_bytes == A100_40GB and "even with the best stage split" in trial.reason
    assert trial.plan == outer.plan("bf16") and trial.tokens_per_s == 0
    inter = dataclasses.replace(outer, interleave=2)
    assert "Megatron-LM only" in Evaluator(m, c, t)(inter, "exhaustive").reason
    assert "Megatron-LM only" not in Evaluator(m, c, t, megatron_features=True)(inter, "exhaustive").reason
    sp = dataclasses.replace(outer, tp=2, dp=2, sequence_parallel=True)  # the executor runs SP
    assert "Megatron-LM only" not in Evaluator(m, c, t)(sp, "exhaustive").reason


def test_rank_and_pareto_front():
    space = small_space()
    trials = exhaustive(space, Evaluator(space.model, space.cluster, space.train))
    ranked = rank(trials)
    assert len({t.plan for t in ranked}) == len(ranked) == len({t.plan for t in trials if t.feasible})
    assert [t.tokens_per_s for t in ranked] == sorted((t.tokens_per_s for t in ranked), reverse=True)
    front = pareto_front(trials)
    assert front[0] is ranked[0]
    for a, b in zip(front, front[1:]):
        assert a.tokens_per_s >= b.tokens_per_s and a.needs_bytes > b.needs_bytes
    # nothing outside the front beats a front member on both axes
    for t in ranked:
        assert any(f.tokens_per_s >= t.tokens_per_s and f.needs_bytes <= t.needs_bytes for f in front)


def test_exhaustive_reports_progress_every_256_plans_and_at_the_end():
    space = small_space()
    calls = []
    trials = exhaustive(space, Evaluator(space.model, space.cluster, space.train), lambda i, n: calls.append((i, n)))
    n = len(trials)
    assert n > 512 and {t.source for t in trials} == {"exhaustive"}
    assert calls == [(k, n) for k in range(256, n, 256)] + [(n, n)]


# --- exact solvers -------------------------------------------------------------------------
def _stage_model(m, c, t, outer):
    plan = outer.plan(t.precision)
    return StageModel(c, plan, layer_costs(m, c, t, plan))


def test_checkpointing_what_fits_and_what_does_not():
    m, c = preset("glm-10b"), parse_cluster("8xA100-40GB")
    t = TrainSpec(global_batch=64, seq_len=1024, attention="eager")
    sm = _stage_model(m, c, t, Outer(tp=1, pp=2, dp=4, zero=1, micro_batch=2, grad_accum=8, recompute="full",
                                     sequence_parallel=False, interleave=1))
    assert sm.fewest_checkpointed(0, 1, True) == 0                 # one block fits as it is
    assert sm.fewest_checkpointed(0, 12, allow=False) is None       # too big without checkpointing
    k = sm.fewest_checkpointed(0, 12, True)
    assert 0 < k < 12 and sm.bytes(0, 12, k) <= sm.capacity < sm.bytes(0, 12, k - 1)
    assert sm.fewest_checkpointed(0, 30, True) is None                    # not even with every block checkpointed
    assert sm.bytes(0, 12, k) - sm.bytes(0, 12, k + 1) == pytest.approx(sm.saving[0], rel=1e-12, abs=0)


def test_the_stage_time_adds_its_blocks_embedding_and_head():
    m, c = preset("glm-10b"), parse_cluster("8xA100")
    t = TrainSpec(global_batch=64, seq_len=1024)
    outer = Outer(tp=1, pp=4, dp=2, zero=1, micro_batch=1, grad_accum=32, recompute="full",
                  sequence_parallel=False, interleave=1)
    plan = outer.plan("bf16")
    lc = layer_costs(m, c, t, plan)
    sm = StageModel(c, plan, lc)
    blocks = 3 * lc.block_time + 2 * lc.block_time_full_recompute
    assert sm.time(0, 5, 2) == pytest.approx(blocks + lc.first_stage_time, rel=1e-12, abs=0)
    assert sm.time(1, 5, 2) == pytest.approx(blocks, rel=1e-12, abs=0)
    assert sm.time(3, 5, 2) == pytest.approx(blocks + lc.last_stage_time, rel=1e-12, abs=0)


def test_no_fit_names_the_tightest_stage_and_its_least_memory():
    """The least any split needs, by brute force over every split of 12 blocks into 3 stages."""
    m, c = dataclasses.replace(preset("glm-130b"), layers=12), parse_cluster("8xA100-40GB")
    t = TrainSpec(global_batch=8, seq_len=2048)
    for ckpt in (False, True):
        outer = Outer(tp=1, pp=3, dp=1, zero=1, micro_batch=1, grad_accum=8, recompute="full" if ckpt else "none",
                      sequence_parallel=False, interleave=1)
        sm = _stage_model(m, c, t, outer)
        nofit = solve(sm, 12, ckpt)
        assert isinstance(nofit, NoFit) and nofit == least_bytes(sm, 12, ckpt)
        k = (lambda n: n) if ckpt else (lambda n: 0)
        splits = [(a, b, 12 - a - b) for a in range(1, 11) for b in range(1, 12 - a)]
        best = min(splits, key=lambda sp: max(sm.bytes(i, n, k(n)) for i, n in enumerate(sp)))
        per = [sm.bytes(i, n, k(n)) for i, n in enumerate(best)]
        assert nofit.needs_bytes == pytest.approx(max(per), rel=1e-12, abs=0)
        assert nofit.stage == per.index(max(per)) and nofit.capacity_bytes == A100_40GB
    one = _stage_model(m, c, t, dataclasses.replace(outer, pp=1, dp=3))
    assert least_bytes(one, 12, True) == NoFit(stage=0, needs_bytes=one.bytes(0, 12, 12), capacity_bytes=A100_40GB)
    assert least_bytes(one, 12, False).needs_bytes == one.bytes(0, 12, 0)


def test_one_stage_partition_carries_its_time_and_memory():
    m, c = preset("glm-10b"), parse_cluster("8xA100")
    t = TrainSpec(global_batch=64, seq_len=1024)
    sm = _stage_model(m, c, t, Outer(tp=8, pp=1, dp=1, zero=1, micro_batch=1, grad_accum=64, recompute="none",
                                     sequence_parallel=False, interleave=1))
    got = solve(sm, 48, False)
    assert got == Partition(stage_layers=(48,), checkpointed=(0,), stage_times=(sm.time(0, 48, 0),),
                            stage_bytes=(sm.bytes(0, 48, 0),))


def test_partition_stage_memory_and_checkpoints_come_with_the_split():
    # sequence 1024: the split needs checkpoints on both stages (16 and 8 of 24 blocks in 40,448 MiB;
    # at 512 only the first stage needs any)
    m, c = preset("glm-10b"), parse_cluster("8xA100-40GB")
    t = TrainSpec(global_batch=64, seq_len=1024)
    sm = _stage_model(m, c, t, Outer(tp=1, pp=2, dp=4, zero=1, micro_batch=1, grad_accum=16, recompute="full",
                                     sequence_parallel=False, interleave=1))
    got = solve(sm, 48, True)
    assert isinstance(got, Partition) and sum(got.stage_layers) == 48 and all(got.checkpointed)
    assert got.checkpointed == tuple(sm.fewest_checkpointed(i, n, True) for i, n in enumerate(got.stage_layers))
    assert got.stage_bytes == tuple(sm.bytes(i, n, k) for i, (n, k) in enumerate(zip(got.stage_layers,
                                                                                       got.checkpointed)))
    assert got.stage_times == tuple(sm.time(i, n, k) for i, (n, k) in enumerate(zip(got.stage_layers,
                                                                                      got.checkpointed)))


# --- the space -----------------------------------------------------------------------------
def test_divisors():
    assert divisors(1) == [1] and divisors(12) == [1, 2, 3, 4, 6, 12] and divisors(49) == [1, 7, 49]


def test_outer_points_become_plans():
    o = Outer(tp=2, pp=2, dp=2, zero=1, micro_batch=2, grad_accum=4, recompute="full", sequence_parallel=True,
              interleave=2)
    assert o.plan("fp32", stage_layers=(3, 1), recompute_layers=(1, 0)) == Plan(
        dp=2, tp=2, pp=2, zero=1, micro_batch=2, grad_accum=4, recompute="full", sequence_parallel=True,
        schedule="interleaved", interleave=2, precision="fp32", stage_layers=(3, 1), recompute_layers=(1, 0))
    assert Shape(tp=2, pp=1, dp=4, recompute="none").outer(2, 8) == Outer(
        tp=2, pp=1, dp=4, zero=0, micro_batch=2, grad_accum=8, recompute="none", sequence_parallel=False, interleave=1)


def test_space_rules_for_zero_interleaving_and_sequence_parallelism():
    m, c = preset("glm-10b"), parse_cluster("2x8xA100")
    space = Space(model=m, cluster=c, train=TrainSpec(global_batch=64, seq_len=1000), max_interleave=3)
    assert space.zero_stages(1) == (0, 1, 2, 3) and space.zero_stages(2) == (0, 1)
    assert space.interleaves(1, 16) == [1]
    assert space.interleaves(4, 4) == [1, 2, 3]           # 16 micro-batches per rank divide by pp 4
    assert space.interleaves(16, 1) == [1, 2, 3]          # at most 48 / 16 = 3 chunks
    assert space.interleaves(32, 1) == [1]                 # 64 % 32 == 0 but 48 // 32 = 1 chunk
    assert space.interleaves(3, 1) == [1]                  # 64 micro-batches do not divide by 3
    assert space.sequence_parallel(1) == (False,) and space.sequence_parallel(8) == (False, True)
    assert space.sequence_parallel(16) == (False,)        # 1000 % 16 != 0
    rows = space.outers(Shape(tp=1, pp=4, dp=4, recompute="none"))
    assert len(rows) == len(space.zero_options(4, 4)) * 3
    assert all(o.grad_accum % 4 == 0 for row in rows for o in row if o.interleave > 1)
    assert space.size() == sum(1 for _ in space.points())


def test_no_legal_plan_names_the_rule():
    m = preset("chatglm3-6b")
    with pytest.raises(SpecError) as err:
        Space(model=m, cluster=parse_cluster("8xV100"), train=TrainSpec(global_batch=8, seq_len=128)).require_nonempty()
    assert err.value.field == "plan space" and "bf16" in err.value.line() and "change the inputs" in err.value.line()


# --- heuristic and Optuna ------------------------------------------------------------------
def test_heuristic_starts_at_the_largest_tp_and_the_smallest_pp_that_fits():
    space = small_space()
    ev = Evaluator(space.model, space.cluster, space.train)
    shape = heuristic(space, ev)
    tp = max(t for t, _, _ in space.layouts())
    assert shape.tp == tp and shape.recompute == "selective"           # eager attention: selective pays off
    tried = [x for x in ev.cache.values() if x.source == "heuristic"]
    assert tried and all(x.outer.tp == tp and x.outer.micro_batch == 1 for x in tried)
    assert all(x.outer.zero == (1 if x.outer.dp > 1 else 0) for x in tried)
    assert tried[-1].feasible and tried[-1].outer.pp == shape.pp
    assert all(not x.feasible for x in tried[:-1]) and [x.outer.pp for x in tried] == sorted(x.outer.pp for x in tried)
    flash = dataclasses.replace(space, train=dataclasses.replace(space.train, attention="flash"))
    assert heuristic(flash, Evaluator(flash.model, flash.cluster, flash.train)).recompute == "none"


def test_heuristic_falls_back_to_the_first_shape_when_nothing_fits():
    m, c = preset("glm-130b"), parse_cluster("8xA100-40GB")
    space = Space(model=m, cluster=c, train=TrainSpec(global_batch=8, seq_len=2048))
    shape = heuristic(space, Evaluator(m, c, space.train))
    smallest_pp = min(p for t, p, _ in space.layouts() if t == 8)
    assert shape == Shape(tp=8, pp=smallest_pp, dp=8 // (8 * smallest_pp), recompute="none")


def test_optuna_labels_its_trials_records_why_and_resumes():
    space = small_space()
    ev = Evaluator(space.model, space.cluster, space.train)
    start = heuristic(space, ev)
    calls = []
    storage = optuna.storages.InMemoryStorage()
    trials, study = optuna_search(space, ev, start, n_trials=6, seed=0, storage=storage,
                                  progress=lambda i, n: calls.append((i, n)))
    assert study.study_name == study_name(space) and study.direction == optuna.study.StudyDirection.MAXIMIZE
    assert {x.source for x in trials} == {"heuristic", "optuna"}
    assert all((x.source == "heuristic") == (x.outer.shape == start) for x in trials)
    assert calls and calls[0] == (1, 6) and all(i <= n == 6 for i, n in calls)
    for ft in study.trials:
        best = ft.user_attrs["best"]
        assert set(best) == {"micro_batch", "feasible", "peak_memory_gb", "reason"}
        excess = ft.system_attrs["constraints:memory_excess_gb"]
        assert (excess == 0.0) == best["feasible"] and (excess > 0 or best["feasible"])
        assert ft.value == (0.0 if not best["feasible"] else ft.value) and (ft.value > 0) == best["feasible"]
    n = len(study.trials)
    again, study2 = optuna_search(space, Evaluator(space.model, space.cluster, space.train), start, n_trials=6,
                                  seed=0, storage=storage)
    assert len(study2.trials) == n and {x.plan for x in rank(again)} == {x.plan for x in rank(trials)}


def test_optuna_parameters_round_trip_and_neighbours_are_legal():
    space = small_space()
    layouts = space.layouts()
    for shape in space.shapes():
        assert shape_from_params(params_of(shape, space), space) == shape
    shape = Shape(tp=2, pp=2, dp=8, recompute="none")
    near = neighbours(shape, layouts, space)
    legal = {(t, p) for t, p, _ in layouts}
    assert all((n.tp, n.pp) in legal and n.dp * n.tp * n.pp == 32 for n in near)
    assert {(n.tp, n.pp) for n in near} >= {(2, p) for t, p in legal if t == 2} | (
        {(1, 2), (4, 2), (1, 4), (4, 1)} & legal)                     # same PP, or same DP
    assert {(4, 1), (1, 4)} <= legal
    assert {n.recompute for n in near} == set(space.recompute_modes())


def test_neighbours_are_every_pp_at_the_same_tp_and_tp_halved_or_doubled():
    space = small_space()
    layouts = [(1, 1, 8), (1, 2, 4), (1, 4, 2), (2, 1, 4), (2, 2, 2), (4, 1, 2)]
    near = neighbours(Shape(tp=1, pp=1, dp=8, recompute="none"), layouts, space)
    # same TP: PP 2 and 4; TP doubled at the same PP: (2, 1); TP halved: none
    assert {(n.tp, n.pp, n.dp) for n in near} == {(1, 1, 8), (1, 2, 4), (1, 4, 2), (2, 1, 4)}
    near = neighbours(Shape(tp=2, pp=2, dp=2, recompute="none"), layouts, space)
    # same TP: PP 1; TP halved: (1, 2) same PP, (1, 4) same DP; doubled: (4, 2) illegal, (4, 1) same DP
    assert {(n.tp, n.pp, n.dp) for n in near} == {(2, 2, 2), (2, 1, 4), (1, 2, 4), (1, 4, 2), (4, 1, 2)}
    assert len(near) == 5 * len(space.recompute_modes())


def test_evaluate_shape_stops_at_the_first_micro_batch_that_cannot_fit():
    m, c = preset("glm-10b"), parse_cluster("8xA100-40GB")
    space = Space(model=m, cluster=c, train=TrainSpec(global_batch=256, seq_len=1024), max_interleave=1)
    ev = Evaluator(m, c, space.train)
    shape = Shape(tp=1, pp=2, dp=4, recompute="none")
    got = evaluate_shape(space, ev, shape, "optuna")
    assert {x.source for x in got} == {"optuna"}
    for row in space.outers(shape):
        seen = [x for x in got if x.outer in row]
        cut = next((i for i, x in enumerate(seen) if x.estimate is None), None)
        assert cut is None or cut == len(seen) - 1
        assert len(seen) < len(row) or cut is None


def test_stage_model_matches_the_estimate_where_the_optimizer_step_sets_the_peak():
    """Short sequences: the engines' step-only copies outweigh the activations; every engine,
    every stage, a per-micro-batch overhead in the profile."""
    from planner.cost.factors import device_factors
    from planner.cost.stage import stage_bytes, stage_times
    from planner.cost import engines
    m = scale(preset("glm-10b"), "small")
    base = parse_cluster("8xA100")
    dev = dataclasses.replace(base.device, factors={**base.device.factors, "microbatch_overhead_s": 0.003})
    c = dataclasses.replace(base, device=dev)
    t = TrainSpec(global_batch=16, seq_len=8)
    plans = [Plan(dp=8, zero=0, precision="bf16", micro_batch=1, grad_accum=2),
             Plan(dp=8, zero=3, precision="bf16", micro_batch=1, grad_accum=2, bucket_elements=10_000_000),
             Plan(dp=2, pp=4, zero=0, precision="fp32", micro_batch=1, grad_accum=8),
             Plan(dp=4, pp=2, zero=0, precision="bf16", micro_batch=2, grad_accum=2, recompute="selective"),
             Plan(dp=4, pp=2, zero=1, precision="bf16", micro_batch=1, grad_accum=4, recompute="full")]
    cpu = parse_cluster("8xcpu")
    z2 = Plan(dp=8, zero=2, precision="bf16", micro_batch=1, grad_accum=2)   # buckets of 5e7 > psi
    for plan, cl in [(x, c) for x in plans] + [(x, cpu) for x in plans[:2] + [z2]]:
        lc = layer_costs(m, cl, t, plan)
        sm = StageModel(cl, plan, lc)
        fp = engines.footprint(plan, resident=cl is cpu)   # a CPU counts the bucket pages it touches
        frag = device_factors(cl.device).memory_fragmentation
        for i in range(plan.pp):
            for n in (1, 3, 8 // plan.pp):
                for k in {0, n} if plan.recompute == "full" else {0}:
                    want = stage_bytes(fp, plan, lc, i, n, k, frag)
                    assert sm.bytes(i, n, k) == pytest.approx(sum(want), rel=1e-12, abs=0), (plan, i, n, k)
            layers = (2,) * plan.pp
            assert cl is cpu or [sm.time(j, 2, 0) for j in range(plan.pp)] == pytest.approx(
                stage_times(lc, layers, (0,) * plan.pp, 0.003), rel=1e-12, abs=0)
    lc2 = layer_costs(m, cpu, t, z2)
    touched = stage_bytes(engines.footprint(z2, resident=True), z2, lc2, 0, 8, 0, 0.0)[5]
    assert touched == 2 * lc2.stage_psi(0, 1, 8)[0] < stage_bytes(engines.footprint(z2), z2, lc2, 0, 8, 0, 0.0)[5]
    # the step phase did set the peak: FP16_Optimizer's fp32 gradient copy (4 bytes/parameter)
    p0 = plans[0]
    lc0 = layer_costs(m, c, t, p0)
    _, _, _, acts, logits, buckets, _ = stage_bytes(engines.footprint(p0), p0, lc0, 0, 8, 0, 0.0)
    psi = lc0.stage_psi(0, 1, 8)[0]
    assert buckets == pytest.approx(4 * psi - acts - logits, rel=1e-12, abs=0) and buckets > 2 * psi


def test_one_block_that_needs_checkpointing():
    m, c = preset("glm-10b"), parse_cluster("8xA100-40GB")
    t = TrainSpec(global_batch=256, seq_len=1024, attention="eager")
    sm = _stage_model(m, c, t, Outer(tp=1, pp=8, dp=1, zero=1, micro_batch=16, grad_accum=16, recompute="full",
                                     sequence_parallel=False, interleave=1))
    assert sm.bytes(0, 1, 0) > sm.capacity >= sm.bytes(0, 1, 1)
    assert sm.fewest_checkpointed(0, 1, True) == 1 and sm.fewest_checkpointed(0, 1, allow=False) is None


def test_trial_reasons_and_capacity():
    m, c = preset("glm-130b"), parse_cluster("8xA100-40GB")
    t = TrainSpec(global_batch=8, seq_len=2048)
    outer = Outer(tp=2, pp=2, dp=2, zero=1, micro_batch=1, grad_accum=4, recompute="none", sequence_parallel=True,
                  interleave=1)
    trial = Evaluator(m, c, t)(outer, "exhaustive")
    sm = _stage_model(m, c, t, outer)
    from planner.specs.validate import runtime_problems
    assert trial.feasible is False
    assert trial.reason == "; ".join([p.line for p in runtime_problems(outer.plan("bf16"))] + [least_bytes(sm, 70, False).reason])
    assert trial.reason_code == "memory"
    ok = Evaluator(m, parse_cluster("96x8xA100-40GB"), TrainSpec(global_batch=4224, seq_len=2048))(
        Outer(tp=4, pp=8, dp=24, zero=1, micro_batch=1, grad_accum=176, recompute="full", sequence_parallel=False,
              interleave=1), "heuristic")
    assert ok.feasible is True and ok.capacity_bytes == A100_40GB and ok.reason == "" and ok.source == "heuristic"


def test_heuristic_without_data_parallelism_starts_at_zero_0_with_sp():
    m, c = scale(preset("glm-10b"), "small"), parse_cluster("8xA100")
    t = TrainSpec(global_batch=8, seq_len=1024)
    space = Space(model=m, cluster=c, train=t, max_interleave=1)
    ev = Evaluator(m, c, t)
    shape = heuristic(space, ev)
    assert (shape.tp, shape.pp, shape.dp) == (8, 1, 1)
    (first,) = [x for x in ev.cache.values() if x.source == "heuristic"]
    assert first.outer.zero == 0 and first.outer.sequence_parallel
    odd = TrainSpec(global_batch=8, seq_len=1020)  # 1020 % 8: no sequence parallelism at TP 8
    ev = Evaluator(m, c, odd)
    heuristic(Space(model=m, cluster=c, train=odd, max_interleave=1), ev)
    assert ev.cache and not any(x.outer.sequence_parallel for x in ev.cache.values())


def test_the_neighbour_polish_finds_the_optimum_from_two_trials():
    space = small_space()
    best = rank(exhaustive(space, Evaluator(space.model, space.cluster, space.train)))[0]
    ev = Evaluator(space.model, space.cluster, space.train)
    found, study = optuna_search(space, ev, heuristic(space, ev), n_trials=2, seed=0)
    assert len(study.trials) > 2 and rank(found)[0].plan == best.plan
    assert len({x.outer.shape for x in found}) < sum(1 for _ in space.shapes())


def test_optuna_stops_once_every_shape_was_tried():
    space = small_space()
    ev = Evaluator(space.model, space.cluster, space.train)
    found, study = optuna_search(space, ev, heuristic(space, ev), n_trials=500, seed=0)
    total = sum(1 for _ in space.shapes())
    assert len({x.outer.shape for x in found}) == total and len(study.trials) < 500


def test_infeasible_trials_tell_optuna_by_how_much():
    m, c = preset("chatglm3-6b"), parse_cluster("2x8xA100-40GB")
    # sequence 4096: eager attention's softmax (2 a s^2 b) makes some shapes miss 40 GB (at 2048
    # they all fit since the cost model charges only the tensors the executor keeps)
    t = TrainSpec(global_batch=16, seq_len=4096, attention="eager")
    space = Space(model=m, cluster=c, train=t, max_interleave=1)
    ev = Evaluator(m, c, t)
    _, study = optuna_search(space, ev, heuristic(space, ev), n_trials=6, seed=0)
    bad = [ft for ft in study.trials if not ft.user_attrs["best"]["feasible"]]
    assert bad
    for ft in bad:
        excess = ft.system_attrs["constraints:memory_excess_gb"]
        assert excess == pytest.approx(max(1e-3, ft.user_attrs["best"]["peak_memory_gb"] - A100_40GB / 1e9), rel=1e-9, abs=0)
        assert ft.value == 0


class LinearStages(StageModel):
    """A stage model with memory and time written out by hand: stage i with n blocks, k of
    them checkpointed, needs base[i] + n * per_block[i] - k * saving[i] bytes and
    n * t_block[i] + k * t_recompute + extra[i] seconds (numbers: the same for every stage)."""

    def __init__(self, cap, base, per_block, saving=0.0, t_block=1.0, t_recompute=0.5, extra=None):
        p = len(base)
        self.pp, self.capacity = p, cap
        self.base, self.per_block = base, per_block
        self.save = saving if isinstance(saving, list) else [saving] * p
        self.t_block = t_block if isinstance(t_block, list) else [t_block] * p
        self.t_recompute, self.extra = t_recompute, extra or [0.0] * p

    def bytes(self, i, n, k):
        return self.base[i] + n * self.per_block[i] - k * self.save[i]

    def time(self, i, n, k):
        return n * self.t_block[i] + k * self.t_recompute + self.extra[i]


def _splits(layers, pp):
    if pp == 1:
        yield (layers,)
        return
    for first in range(1, layers - pp + 2):
        for rest in _splits(layers - first, pp - 1):
            yield (first,) + rest


def test_bisection_returns_the_exact_fewest_checkpoint_count():
    sm = LinearStages(cap=100, base=[12], per_block=[10], saving=3)
    for n in range(1, 14):
        k = sm.fewest_checkpointed(0, n, True)
        if 12 + 10 * n - 3 * n > 100:
            assert k is None
        else:
            want = max(0, -(-(12 + 10 * n - 100) // 3))
            assert k == want and isinstance(k, int), (n, k, want)
    assert sm.fewest_checkpointed(0, 10, True) == 4 and sm.fewest_checkpointed(0, 9, True) == 1


def test_least_memory_split_by_brute_force():
    sm = LinearStages(cap=10, base=[50, 20, 35], per_block=[7, 11, 5], saving=2)
    for ckpt in (False, True):
        k = (lambda n: n) if ckpt else (lambda n: 0)
        best = min(max(sm.bytes(i, n, k(n)) for i, n in enumerate(sp)) for sp in _splits(9, 3))
        got = least_bytes(sm, 9, ckpt)
        assert got.needs_bytes == best and got.capacity_bytes == 10
        assert solve(sm, 9, ckpt) == got
    one = LinearStages(cap=10, base=[50], per_block=[7], saving=2)
    assert least_bytes(one, 9, True).needs_bytes == 50 + 9 * 5 and least_bytes(one, 9, False).needs_bytes == 50 + 63


def test_solver_checkpoints_a_single_stage_and_every_path_that_cannot_fit():
    one = LinearStages(cap=100, base=[20], per_block=[10], saving=4)
    assert solve(one, 10, True) == Partition(stage_layers=(10,), checkpointed=(5,), stage_times=(10 + 2.5,),
                                             stage_bytes=(100,))
    assert isinstance(solve(one, 10, False), NoFit)
    # a stage that cannot hold even one block (unless checkpointed), and one that fills up later
    tight = LinearStages(cap=100, base=[97, 10], per_block=[10, 10], saving=6)
    assert solve(tight, 6, True) == least_bytes(tight, 6, True) != least_bytes(tight, 6, False)
    later = LinearStages(cap=99, base=[40, 40], per_block=[20, 20], saving=5)
    assert solve(later, 8, True) == least_bytes(later, 8, True) != least_bytes(later, 8, False)


def test_solver_balances_unequal_stages_optimally():
    sm = LinearStages(cap=1e9, base=[0, 0, 0], per_block=[1, 1, 1], t_block=1.0, extra=[0.5, 0.0, 2.5])
    best = min(max(sm.time(i, n, 0) for i, n in enumerate(sp)) for sp in _splits(10, 3))
    got = solve(sm, 10, False)
    assert got.slowest == best and got.stage_layers == (4, 4, 2)


def test_baseline_micro_batch_and_accumulation_when_the_batch_does_not_split():
    m, c = preset("chatglm3-6b"), parse_cluster("8xA100")
    plan, _ = conventional_baseline(m, c, TrainSpec(global_batch=12, seq_len=128))
    assert (plan.dp, plan.micro_batch, plan.grad_accum) == (8, 1, 2)        # global batch 16, the next multiple of 8


def test_a_runtime_problem_and_a_no_fit_are_joined_into_one_reason():
    from planner.specs.validate import runtime_problems
    m, c = preset("glm-130b"), parse_cluster("8xA100-40GB")
    t = TrainSpec(global_batch=8, seq_len=2048)
    outer = Outer(tp=1, pp=2, dp=4, zero=1, micro_batch=1, grad_accum=2, recompute="none", sequence_parallel=False,
                  interleave=2)
    trial = Evaluator(m, c, t)(outer, "exhaustive")
    (problem,) = runtime_problems(trial.plan)
    assert trial.estimate is None and trial.reason.startswith(problem.line + "; stage ")
    assert trial.reason.endswith("even with the best stage split and checkpointing")


def test_heuristic_with_two_data_parallel_ranks_uses_zero_1():
    m, c = scale(preset("glm-10b"), "small"), parse_cluster("2x8xA100")
    t = TrainSpec(global_batch=8, seq_len=1024)
    ev = Evaluator(m, c, t)
    heuristic(Space(model=m, cluster=c, train=t, max_interleave=1), ev)
    (first,) = ev.cache.values()
    assert (first.outer.tp, first.outer.dp, first.outer.zero) == (8, 2, 1)


def test_optuna_when_nothing_fits_returns_the_infeasible_trials():
    m, c = preset("glm-130b"), parse_cluster("8xA100-40GB", cpu_mem_gb=0)   # no host: no offload either
    space = Space(model=m, cluster=c, train=TrainSpec(global_batch=8, seq_len=2048), max_interleave=1)
    ev = Evaluator(m, c, space.train)
    found, study = optuna_search(space, ev, heuristic(space, ev), n_trials=2, seed=0)
    assert found and not any(x.feasible for x in found) and len(study.trials) == 2


def test_optuna_keeps_its_study_in_the_storage_it_is_given():
    space = small_space()
    storage = optuna.storages.InMemoryStorage()
    ev = Evaluator(space.model, space.cluster, space.train)
    optuna_search(space, ev, heuristic(space, ev), n_trials=3, seed=0, storage=storage)
    (summary,) = optuna.get_all_study_summaries(storage)
    assert summary.study_name == study_name(space) and summary.n_trials >= 3


def test_space_rows_cover_every_zero_stage_and_interleaving():
    m, c = preset("glm-10b"), parse_cluster("2x8xA100")
    space = Space(model=m, cluster=c, train=TrainSpec(global_batch=64, seq_len=1024), max_interleave=3)
    assert len(space.outers(Shape(tp=2, pp=1, dp=8, recompute="none"))) == len(space.zero_options(1, 8, 2)) * 2
    assert {z for z, _ in space.zero_options(1, 8, 2)} == {0, 1, 2, 3}           # ZeRO 0-3 (x SP)
    rows = space.outers(Shape(tp=1, pp=4, dp=4, recompute="none"))
    inter = [o for row in rows for o in row if o.interleave > 1]
    assert inter and all(o.grad_accum % 4 == 0 for o in inter)
    assert {o.micro_batch for o in inter} == {1, 2, 4}                # 16 per rank: accumulation 16, 8, 4


def test_zero_options_offer_deepspeeds_variants_where_they_apply():
    from planner.search.space import PLAIN, ZeroVariant
    from planner.specs.hardware import Host
    dev = dataclasses.replace(parse_cluster("8xA100").device, host=Host(cpu_memory_gb=1000, pcie_gbps=25,
                                                                         cpu_adam_gparams=2, nvme_gbps=0))
    m, t = preset("glm-10b"), TrainSpec(global_batch=64, seq_len=1024)
    two = Space(model=m, cluster=parse_cluster("2x8xA100", dev), train=t)
    big, off = ZeroVariant(bucket_elements=200_000_000), ZeroVariant(offload_optimizer="cpu")
    serial = ZeroVariant(overlap_comm=False)
    # pipeline: ZeRO 0-1 only; ZeRO-1 with larger buckets, without overlap, or the optimizer on the host
    assert two.zero_options(2, 8) == [(0, PLAIN), (1, PLAIN), (1, big), (1, serial), (1, off)]
    z3 = [v for z, v in two.zero_options(1, 16) if z == 3]
    assert z3 == [PLAIN, big, serial, off, ZeroVariant(live_elements=1_000_000_000),
                  ZeroVariant(offload_optimizer="cpu", offload_params="cpu"), ZeroVariant(hpz=8),
                  ZeroVariant(hpz=8, quantized_weights=True, quantized_gradients=True), ZeroVariant(mics_shard=8)]
    # TP 2 leaves 4 data-parallel ranks per node: hpZ and MiCS over those 4
    assert ZeroVariant(hpz=4) in [v for _, v in two.zero_options(1, 8, 2)]
    # one node: nothing crosses nodes, so no hpZ / ZeRO++ / MiCS; NVMe only with a bandwidth
    one = Space(model=m, cluster=parse_cluster("8xA100", dev, nvme_gbps=20), train=t)
    z3 = [v for z, v in one.zero_options(1, 8) if z == 3]
    assert not any(v.hpz > 1 or v.mics_shard for v in z3)
    assert ZeroVariant(offload_optimizer="nvme", offload_params="nvme") in z3
    # no host numbers (or a CPU cluster): no offload; one rank: no bucket choice
    # across nodes means a DP group larger than a node's ranks on more than one node
    small = Space(model=m, cluster=parse_cluster("2x4xA100", dev), train=t)
    assert not any(v.hpz > 1 for _, v in small.zero_options(1, 4))          # DP 4 = the node's 4 ranks
    assert ZeroVariant(hpz=2) in [v for _, v in small.zero_options(1, 4, 2)]  # TP 2: 2 ranks per node
    assert not any(v.hpz > 1 for _, v in one.zero_options(1, 16))            # one node: nothing crosses
    assert (1, big) in one.zero_options(1, 2) and (1, big) not in one.zero_options(1, 1)
    # a shape's outer point keeps the variant (None for plain ZeRO), and its plan carries it
    shape = Shape(tp=1, pp=1, dp=16, recompute="none")
    assert shape.outer(1, 1, zero=3, variant=PLAIN).variant is None
    hp = shape.outer(1, 1, zero=3, variant=ZeroVariant(hpz=8, quantized_weights=True))
    assert (hp.plan("bf16").hpz, hp.plan("bf16").quantized_weights) == (8, True)
    bare = Space(model=m, cluster=parse_cluster("8xA100", dev, cpu_mem_gb=0), train=t)
    assert not any(v.offload_optimizer != "none" for _, v in bare.zero_options(1, 8))
    assert bare.zero_options(1, 1) == [(0, PLAIN), (1, PLAIN), (2, PLAIN), (3, PLAIN),
                                       (3, ZeroVariant(live_elements=1_000_000_000))]


def test_fp16_on_v100_and_selective_on_the_cpu_math_path():
    m = scale(preset("glm-10b"), "small")
    v100 = Space(model=m, cluster=parse_cluster("8xV100"), train=TrainSpec(global_batch=8, seq_len=1024,
                                                                          precision="fp16"))
    assert v100.layouts()
    cpu = Space(model=scale(preset("glm-10b"), "tiny"), cluster=parse_cluster("2xcpu"),
                train=TrainSpec(global_batch=8, seq_len=128))
    assert cpu.recompute_modes() == ("none", "selective", "full")   # attention dropout: SDPA's math path


def test_no_legal_plan_message():
    with pytest.raises(SpecError) as err:
        Space(model=preset("chatglm3-6b"), cluster=parse_cluster("8xV100"),
              train=TrainSpec(global_batch=8, seq_len=128)).require_nonempty()
    assert err.value.line() == ("plan space: no legal plan: V100 does not support bf16: use fp16 or fp32 "
                                "(fix: change the inputs named above)")


def test_the_sampler_seed_makes_a_study_reproducible():
    space = small_space()

    def shapes(seed):
        ev = Evaluator(space.model, space.cluster, space.train)
        _, study = optuna_search(space, ev, heuristic(space, ev), n_trials=12, seed=seed)
        return [tuple(sorted(t.params.items())) for t in study.trials[:12]]

    assert shapes(3) == shapes(3)
    assert shapes(3) != shapes(4)


def test_the_solvers_match_brute_force_on_random_stage_models():
    import random
    rng = random.Random(7)
    checked = {"fit": 0, "nofit": 0}
    for _ in range(120):
        pp = rng.choice((1, 2, 3))
        layers = rng.randint(pp, 7)
        per = [rng.randint(2, 15) for _ in range(pp)]
        sm = LinearStages(cap=rng.randint(30, 110), base=[rng.randint(0, 40) for _ in range(pp)], per_block=per,
                          saving=[rng.randint(0, x) for x in per], t_block=[rng.uniform(0.5, 2.0) for _ in range(pp)],
                          t_recompute=rng.uniform(0.1, 1.0), extra=[rng.uniform(0, 3) for _ in range(pp)])
        for ckpt in (False, True):
            k = (lambda n: n) if ckpt else (lambda n: 0)
            splits = list(_splits(layers, pp))
            best = None
            for sp in splits:
                ks = [sm.fewest_checkpointed(i, n, ckpt) for i, n in enumerate(sp)]
                if None not in ks:
                    t = max(sm.time(i, n, kk) for i, (n, kk) in enumerate(zip(sp, ks)))
                    best = t if best is None else min(best, t)
            got = solve(sm, layers, ckpt)
            least = min(max(sm.bytes(i, n, k(n)) for i, n in enumerate(sp)) for sp in splits)
            assert least_bytes(sm, layers, ckpt).needs_bytes == least
            if best is None:
                assert isinstance(got, NoFit) and got == least_bytes(sm, layers, ckpt)
                checked["nofit"] += 1
            else:
                assert isinstance(got, Partition) and got.slowest == pytest.approx(best, rel=1e-12, abs=0)
                checked["fit"] += 1
    assert checked["fit"] > 100 and checked["nofit"] > 20


def test_a_first_block_that_fits_only_checkpointed():
    sm = LinearStages(cap=100, base=[95, 10], per_block=[10, 10], saving=6)
    got = solve(sm, 6, True)
    assert isinstance(got, Partition) and got.checkpointed[0] >= 1
    assert isinstance(solve(sm, 6, False), NoFit)
    one = LinearStages(cap=100, base=[50], per_block=[10], saving=2)
    assert solve(one, 30, True) == least_bytes(one, 30, True) != least_bytes(one, 30, False)


def test_no_legal_plan_in_fp16_names_the_batch_not_the_precision():
    m, c = scale(preset("chatglm3-6b"), "tiny"), parse_cluster("4x8xV100")     # DP is at least 4 here
    with pytest.raises(SpecError) as err:
        Space(model=m, cluster=c, train=TrainSpec(global_batch=6, seq_len=128, precision="fp16")).require_nonempty()
    assert err.value.field == "--global-batch" and "multiple of 4" in err.value.line()


def test_study_names_are_stable_and_differ_with_every_input():
    space = small_space()
    name = study_name(space)
    assert name == study_name(small_space()) and name.startswith(f"{space.model.name}-32-")
    others = [dataclasses.replace(space, train=dataclasses.replace(space.train, global_batch=64)),
              dataclasses.replace(space, train=dataclasses.replace(space.train, attention="flash")),
              dataclasses.replace(space, max_interleave=2), dataclasses.replace(space, megatron_features=True),
              dataclasses.replace(space, model=dataclasses.replace(space.model, vocab=8193)),
              dataclasses.replace(space, cluster=parse_cluster("4x8xA100-40GB"))]
    assert len({name} | {study_name(o) for o in others}) == 1 + len(others)
