"""One stage-memory and stage-time definition: the search's fast path (planner/search/checkpoint.py
StageModel, precomputed linear forms called thousands of times per plan) equals the cost model's
(planner/cost/stage.py stage_bytes / stage_times) under every named factor of the profile, for
every engine shape the fast path special-cases: ZeRO-1's owned gradients, ZeRO-3's bucket minima,
offload, fp8's weight copies, MoE experts in their own ZeRO group, pipelines, every recompute
mode, a CPU device (resident pages) and a GPU."""
from __future__ import annotations

import dataclasses

import pytest

from planner.cost import engines
from planner.cost.factors import DEFAULTS, cluster_factors
from planner.cost.model import layer_costs
from planner.cost.stage import resident_memory, stage_bytes, stage_times
from planner.search.checkpoint import StageModel
from planner.specs import preset, scale
from planner.specs.cluster import parse_cluster
from planner.specs.plan import Plan
from planner.specs.train import TrainSpec

DENSE = scale(preset("glm-10b"), "small")
MOE = scale(preset("glm-4.5-air"), "small")
T = TrainSpec(global_batch=32, seq_len=64)

PLANS = [
    (DENSE, "8xA100", Plan(dp=8, zero=0, micro_batch=1, grad_accum=4)),
    (DENSE, "8xA100", Plan(dp=8, zero=1, micro_batch=2, grad_accum=2, recompute="selective")),
    (DENSE, "8xA100", Plan(dp=8, zero=2, micro_batch=1, grad_accum=4, bucket_elements=1_000_000)),
    (DENSE, "8xA100", Plan(dp=8, zero=3, micro_batch=1, grad_accum=4, bucket_elements=2_000_000)),
    (DENSE, "8xA100", Plan(dp=8, zero=3, micro_batch=1, grad_accum=4, offload_optimizer="cpu",
                           offload_params="cpu")),
    (DENSE, "8xA100", Plan(dp=2, pp=4, zero=1, micro_batch=1, grad_accum=16, recompute="full")),
    (DENSE, "8xA100", Plan(dp=2, tp=2, pp=2, zero=0, micro_batch=2, grad_accum=8, precision="fp32",
                           sequence_parallel=True)),
    (DENSE, "8xH100", Plan(dp=8, zero=1, micro_batch=1, grad_accum=4, precision="fp8", runtime="megatron-core")),
    (MOE, "8xH100", Plan(dp=8, ep=4, zero=1, micro_batch=1, grad_accum=4)),
    (MOE, "8xH100", Plan(dp=4, pp=2, ep=2, zero=1, micro_batch=1, grad_accum=8, recompute="full")),
    (DENSE, "8xcpu", Plan(dp=8, zero=2, micro_batch=1, grad_accum=4)),
    (DENSE, "8xcpu", Plan(dp=4, pp=2, zero=1, micro_batch=1, grad_accum=8, recompute="full")),
]

FACTOR_SETS = [{}] + [{name: (0.5 if name == "dp_overlap" else 1.37 * value + 0.01)} for name, value in
                      DEFAULTS.items()] + [{name: 1.21 * value + 0.02 for name, value in DEFAULTS.items()
                                            if name != "dp_overlap"}]
"""The profile's factors as shipped, each factor moved alone, and all moved at once."""


def _with_factors(cluster, factors: dict[str, float]):
    dev = dataclasses.replace(cluster.device, factors={**cluster.device.factors, **factors})
    return dataclasses.replace(cluster, device=dev)


@pytest.mark.parametrize("model,gpus,plan", PLANS, ids=[f"{g}-{p.describe()}" for _, g, p in PLANS])
def test_the_fast_path_is_the_cost_models_stage(model, gpus, plan) -> None:
    for factors in FACTOR_SETS:
        cluster = _with_factors(parse_cluster(gpus), factors)
        lc = layer_costs(model, cluster, T, plan)
        sm = StageModel(cluster, plan, lc)
        f = cluster_factors(cluster, plan.runtime)
        fp = engines.footprint(plan, resident_memory(cluster.device.kind), lc.largest)
        for i in range(plan.pp):
            for n in (1, 2, model.layers // plan.pp):
                for k in sorted({0, n // 2, n}) if plan.recompute == "full" else (0,):
                    want = sum(stage_bytes(fp, plan, lc, i, n, k, f.memory_fragmentation))
                    assert sm.bytes(i, n, k) == pytest.approx(want, rel=1e-12, abs=0), (factors, i, n, k)
            ks = (0,) * plan.pp
            assert [sm.time(j, 2, 0) for j in range(plan.pp)] == pytest.approx(
                stage_times(lc, (2,) * plan.pp, ks, f.microbatch_overhead_s), rel=1e-12, abs=0), factors


def test_the_factor_sets_move_what_they_name() -> None:
    """The comparison can fail: moving a memory factor moves the fast path's bytes."""
    model, gpus, plan = PLANS[1]
    base = _with_factors(parse_cluster(gpus), {})
    moved = _with_factors(parse_cluster(gpus), {"memory_fragmentation": 0.5, "activation_scale": 2.0})
    one = StageModel(base, plan, layer_costs(model, base, T, plan)).bytes(0, model.layers, 0)
    two = StageModel(moved, plan, layer_costs(model, moved, T, plan)).bytes(0, model.layers, 0)
    assert two > one
