"""Search: legal space, exact inner solvers (checked by brute force), Optuna vs exhaustive."""
from __future__ import annotations

import dataclasses
import itertools

import optuna
import pytest

from planner.cost import estimate, layer_costs
from planner.cost.factors import device_factors
from planner.cost.stage import stage_times
from planner.errors import SpecError
from planner.search import Evaluator, Space, conventional_baseline, rank
from planner.search.checkpoint import StageModel
from planner.search.driver import search
from planner.search.exhaustive import exhaustive
from planner.search.heuristic import heuristic
from planner.search.optuna_search import optuna_search, params_of
from planner.search.partition import NoFit, Partition, solve
from planner.search.space import Outer
from planner.specs import TrainSpec, parse_cluster, preset, scale
from planner.specs.validate import plan_problems


def inputs(model="glm-10b", gpus="8xA100", batch=64, seq=1024, size=None, attention="flash", precision="bf16"):
    m = scale(preset(model), size)
    return m, parse_cluster(gpus), TrainSpec(global_batch=batch, seq_len=seq, attention=attention, precision=precision)


@pytest.mark.parametrize("args", [("glm-10b", "8xA100", 64, 1024), ("chatglm3-6b", "2x8xH100", 96, 2048),
                                  ("glm-130b", "4x8xA100-40GB", 48, 2048)])
def test_every_point_is_legal_and_the_rules_hold(args):
    m, c, t = inputs(*args)
    space = Space(model=m, cluster=c, train=t)
    points = list(space.points())
    assert points and len(set(points)) == len(points)
    for o in points:
        plan = o.plan(t.precision)
        assert plan_problems(m, c, t, plan) == [], o
        assert o.dp * o.tp * o.pp == c.world_size and o.micro_batch * o.grad_accum * o.dp == t.global_batch
        assert o.pp == 1 or o.zero <= 1
    # every legal (tp, pp) of the brute-force enumeration is in the space
    legal = {(tp, pp) for tp in range(1, 9) for pp in range(1, m.layers + 1)
             if c.world_size % (tp * pp) == 0 and not plan_problems(
                 m, c, t, dataclasses.replace(points[0].plan(t.precision), tp=tp, pp=pp,
                                              dp=c.world_size // (tp * pp), zero=0, schedule="1f1b", interleave=1,
                                              sequence_parallel=False, micro_batch=1,
                                              grad_accum=t.global_batch // (c.world_size // (tp * pp)) or 1))}
    assert legal == {(o.tp, o.pp) for o in points}


def test_no_legal_plan_is_one_line():
    m, c, t = inputs("chatglm3-6b", "4x8xA100", batch=6, seq=128, size="tiny")   # DP is at least 4 here
    with pytest.raises(SpecError) as err:
        Space(model=m, cluster=c, train=t).require_nonempty()
    assert err.value.field == "--global-batch" and "multiple of 4" in err.value.line()
    m, c, t = inputs("glm-10b", "8xV100", batch=8, seq=1024)                    # V100 has no bf16
    with pytest.raises(SpecError) as err:
        Space(model=m, cluster=c, train=t).require_nonempty()
    assert "bf16" in err.value.line()


def _model_for(o: Outer, m, c, t):
    plan = o.plan(t.precision)
    return StageModel(c, plan, layer_costs(m, c, t, plan)), plan


@pytest.mark.parametrize("pp,recompute,mb", [(2, "none", 1), (3, "full", 2), (4, "full", 4), (3, "selective", 1)])
def test_partition_is_optimal_by_brute_force(pp, recompute, mb):
    m, c, t = inputs("glm-10b", "8xA100-40GB", batch=64, seq=1024)
    m = dataclasses.replace(m, layers=10)
    dp = 8 // pp if 8 % pp == 0 else 1
    o = Outer(tp=8 // (dp * pp) or 1, pp=pp, dp=dp, zero=1, micro_batch=mb, grad_accum=1, recompute=recompute,
              sequence_parallel=False, interleave=1)
    sm, _ = _model_for(o, m, c, t)
    full = recompute == "full"
    best = None
    for split in itertools.product(range(1, m.layers + 1), repeat=pp):
        if sum(split) != m.layers:
            continue
        ks = [sm.fewest_checkpointed(i, n, full) for i, n in enumerate(split)]
        if None in ks:
            continue
        slow = max(sm.time(i, n, k) for i, (n, k) in enumerate(zip(split, ks)))
        best = slow if best is None else min(best, slow)
    got = solve(sm, m.layers, full)
    if best is None:
        assert isinstance(got, NoFit)
    else:
        assert isinstance(got, Partition) and got.slowest == pytest.approx(best, rel=1e-12)


def test_checkpoint_count_is_the_fewest():
    m, c, t = inputs("glm-10b", "8xA100-40GB", batch=64, seq=1024)
    o = Outer(tp=1, pp=2, dp=4, zero=1, micro_batch=2, grad_accum=8, recompute="full", sequence_parallel=False,
              interleave=1)
    sm, _ = _model_for(o, m, c, t)
    seen_partial = False
    for n in range(1, m.layers):
        k = sm.fewest_checkpointed(0, n, True)
        if k is None:
            assert sm.bytes(0, n, n) > sm.capacity
            continue
        assert sm.bytes(0, n, k) <= sm.capacity
        assert k == 0 or sm.bytes(0, n, k - 1) > sm.capacity
        seen_partial |= 0 < k < n
    assert seen_partial


@pytest.mark.parametrize("args", [("glm-10b", "8xA100-40GB", 64, 1024), ("glm-4-9b", "2x8xH100", 64, 4096),
                                  ("chatglm3-6b", "2x8xA100", 64, 2048, None, "eager", "fp32")])
def test_solver_and_estimate_agree(args):
    """The solvers' memory and time per stage are the cost model's, to rounding."""
    m, c, t = inputs(*args)
    ev = Evaluator(m, c, t)
    checked = 0
    for o in itertools.islice(Space(model=m, cluster=c, train=t).points(), 0, None, 7):
        trial = ev(o, "exhaustive")
        if trial.estimate is None:
            continue
        plan = trial.plan
        sm, _ = _model_for(o, m, c, t)
        lc = layer_costs(m, c, t, plan)
        ks = plan.checkpointed_per_stage(m.layers)
        ns = plan.layers_per_stage(m.layers)
        est = trial.estimate
        for i, (n, k) in enumerate(zip(ns, ks)):
            assert sm.bytes(i, n, k) == pytest.approx(est.stage_memory[i].total, rel=1e-12)
        times = stage_times(lc, ns, ks, device_factors(c.device).microbatch_overhead_s)
        assert [sm.time(i, n, k) for i, (n, k) in enumerate(zip(ns, ks))] == pytest.approx(times, rel=1e-12)
        checked += 1
    assert checked > 20


@pytest.mark.parametrize("args,interleave,trials,seed", [
    (("glm-10b", "4x8xA100", 32, 1024, "small", "eager"), 1, 6, 0),      # 45 shapes, 738 plans
    (("glm-130b", "96x8xA100-40GB", 4224, 2048), 4, 15, 1),              # 90 shapes, 6088 plans
], ids=["glm10b-small", "glm130b"])
def test_optuna_reaches_the_exhaustive_optimum_on_a_fraction_of_the_shapes(args, interleave, trials, seed):
    """Optuna earns its keep only where it does not enumerate the space: with a small trial
    budget it evaluates at most 60% of the shapes (its hill-climbing polish walks the best
    shape's neighbours, about half of GLM-130B's 90) and still lands on the exhaustive
    optimum, which the heuristic start alone does not reach."""
    m, c, t = inputs(*args)
    space = Space(model=m, cluster=c, train=t, max_interleave=interleave)
    best = rank(exhaustive(space, Evaluator(m, c, t)))[0]
    total = sum(1 for _ in space.shapes())
    ev = Evaluator(m, c, t)
    start = heuristic(space, ev)
    from_start = rank(list(ev.cache.values()))
    found, study = optuna_search(space, ev, start, n_trials=trials, seed=seed)
    assert study.trials[0].params == params_of(start, space)            # heuristic enqueued first
    assert len({x.outer.shape for x in found}) <= 0.6 * total
    assert rank(found)[0].plan == best.plan
    assert from_start and from_start[0].tokens_per_s < 0.95 * best.tokens_per_s


def test_partition_solver_beats_the_uniform_split_on_an_unbalanced_pipeline():
    """A large vocabulary makes the last stage's output layer cost about two blocks: the exact
    solver moves blocks to the first stage; the uniform split leaves the last stage slowest."""
    m, c, t = inputs("glm-10b", "8xA100", batch=64, seq=1024)
    m = dataclasses.replace(m, layers=8, vocab=400_000)
    o = Outer(tp=1, pp=2, dp=4, zero=1, micro_batch=1, grad_accum=16, recompute="none", sequence_parallel=False,
              interleave=1)
    sm, _ = _model_for(o, m, c, t)
    got = solve(sm, m.layers, False)
    uniform = max(sm.time(0, 4, 0), sm.time(1, 4, 0))
    assert isinstance(got, Partition) and got.stage_layers[0] > got.stage_layers[1]
    assert got.slowest < 0.9 * uniform
    # the hand-checked optimum: the last stage's extra work is worth about two blocks
    per_block = sm.time(0, 2, 0) - sm.time(0, 1, 0)
    extra = sm.time(1, 1, 0) - per_block
    assert got.stage_layers == min(((n, 8 - n) for n in range(1, 8)),
                                   key=lambda s: max(s[0] * per_block + sm.time(0, 0, 0), s[1] * per_block + extra))


def test_study_resumes(tmp_path):
    m, c, t = inputs("chatglm3-6b", "8xA100", batch=64, seq=2048, attention="eager")  # 3 recompute modes
    url = f"sqlite:///{tmp_path / 'study.db'}"
    first = search(m, c, t, n_trials=8, seed=1, storage=url)
    n = len(optuna.load_study(study_name=first.study_name, storage=url).trials)
    again = search(m, c, t, n_trials=8, seed=1, storage=url)           # already holds 8: nothing new
    assert len(optuna.load_study(study_name=first.study_name, storage=url).trials) == n
    assert again.best.plan == first.best.plan
    more = search(m, c, t, n_trials=n + 5, seed=1, storage=url)
    assert len(optuna.load_study(study_name=first.study_name, storage=url).trials) >= n + 1
    assert more.best.tokens_per_s >= first.best.tokens_per_s


def test_baseline_is_plain_dp_with_the_largest_fitting_micro_batch():
    m, c, t = inputs("chatglm3-6b", "8xA100-40GB", batch=2048, seq=1024, size="small")
    plan, est = conventional_baseline(m, c, t)
    assert (plan.dp, plan.tp, plan.pp, plan.zero, plan.recompute) == (8, 1, 1, 0, "none")
    assert est.feasible and 1 < plan.micro_batch < 256             # a middle micro-batch: both sides checked
    nxt = dataclasses.replace(plan, micro_batch=2 * plan.micro_batch, grad_accum=plan.grad_accum // 2)
    assert not estimate(m, c, t, nxt).feasible
    fp32, _ = conventional_baseline(m, c, t, precision="fp32")
    assert fp32.precision == "fp32"


def test_fits_nowhere_names_the_memory():
    m, _, t = inputs("glm-130b", "8xA100-40GB", batch=8, seq=2048)
    c = parse_cluster("8xA100-40GB", cpu_mem_gb=0)         # no host to offload to
    with pytest.raises(SpecError) as err:
        search(m, c, t, exhaustive=True)
    line = err.value.line()
    assert "does not fit" in line and "GB" in line and "\n" not in line


def test_deepspeed_runtime_never_chooses_what_it_cannot_run():
    """Interleaved 1F1B is evaluated but only chosen when allowed; sequence parallelism (the
    executor's own TP layers run it) is chosen like any other knob."""
    m, c, t = inputs("chatglm3-6b", "2x8xH100", 96, 2048)
    space = Space(model=m, cluster=c, train=t)
    plain = exhaustive(space, Evaluator(m, c, t))
    marked = [x for x in plain if x.plan.schedule == "interleaved"]
    assert marked and all(not x.feasible and "Megatron-LM only" in x.reason for x in marked)
    assert all(x.plan.schedule == "1f1b" for x in rank(plain))
    assert any(x.plan.sequence_parallel for x in rank(plain))
    assert not any("Megatron-LM only" in x.reason for x in plain if x.plan.schedule == "1f1b")
    allowed = exhaustive(dataclasses.replace(space, megatron_features=True), Evaluator(m, c, t, megatron_features=True))
    best = rank(allowed)[0]
    assert best.tokens_per_s >= rank(plain)[0].tokens_per_s
    pipelines = [x for x in rank(allowed) if x.plan.pp > 1]
    assert any(x.plan.schedule == "interleaved" for x in pipelines[:20])


def test_heuristic_start_is_runnable_under_deepspeed():
    """The plan Optuna starts from is Megatron's rule of thumb as the executor runs it: TP = the
    node with sequence parallelism, 1F1B (never interleaved), ZeRO-1, micro-batch 1."""
    m, c, t = inputs("glm-130b", "96x8xA100-40GB", 4224, 2048)
    space = Space(model=m, cluster=c, train=t)
    ev = Evaluator(m, c, t)
    shape = heuristic(space, ev)
    started = [tr for tr in ev.cache.values() if tr.source == "heuristic"]
    assert started and all(tr.plan.sequence_parallel and tr.plan.schedule == "1f1b" for tr in started)
    assert len(started) > 1 and [tr.outer.pp for tr in started] == sorted(tr.outer.pp for tr in started)
    assert all(tr.outer.tp == 8 and tr.outer.zero == 1 and tr.outer.micro_batch == 1 for tr in started)
    assert any(tr.feasible and tr.outer.pp == shape.pp and tr.outer.tp == shape.tp for tr in started)
