"""The model states one rank holds when the executor counts them, by the estimate's classes.

The executor counts model states tensor by tensor once per run (planner/runtime/observe/measure.py
model_states; planner/runtime/train/loop.py): after the last micro-batch's backward of the second
step, before its optimizer step -- or, under a pipeline, after the last step, when DeepSpeed's
pipeline engine has freed the gradients. At that moment a rank holds its engine's buffers of
the "always" and "grads" phases ("always" only under a pipeline; planner.cost.engines.PHASES).
This module predicts those bytes per class (params, grads, optimizer, buckets: the estimate's
MemoryBreakdown fields and planner.cost.engines.ROLES), for the rank's own pipeline stage and,
under ZeRO-1, its own data-parallel partition (planner.cost.params.zero1_owned), so that
metrics.json's predicted - measured is a field-by-field subtraction.
"""
from __future__ import annotations

from planner.cost import engines, longctx, moe, params
from planner.cost.model import layer_costs
from planner.specs.cluster import ClusterSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import Plan
from planner.specs.train import TrainSpec


def counted_phases(plan: Plan) -> tuple[str, ...]:
    """The engine phases alive when the executor counts (see the module docstring)."""
    return ("always",) if plan.pp > 1 else ("always", "grads")


def rank_states(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, plan: Plan,
                rank: int) -> dict[str, dict[str, float]]:
    """{"device": {class: bytes}, "host": {class: bytes}} one rank holds when counted; host
    sums host memory and NVMe (what DeepSpeed offloads).

    Context parallelism: ZeRO partitions over the dp x cp ranks (planner.cost.longctx.local),
    the rank's place there is dp index x cp + cp index. A MoE model (pp 1, as the executor runs
    it): the dense tensors are the first_dense dense blocks and the MoE blocks' replicated parts
    (router, shared experts); the routed experts, experts / ep per block, are DeepSpeed's own
    parameter group, which ZeRO partitions over the expert-data-parallel ranks (dp x cp / ep:
    planner.cost.moe.expert_plan; the rank's place there is (dp index // ep) x cp + cp index).
    Their params, grads and optimizer states are added; buckets are the dense group's (one
    reduce bucket serves both groups)."""
    lc = layer_costs(model, cluster, train, plan)
    stage, dp_i, cp_i, _ = plan.coords(rank)
    zplan, _ = longctx.local(plan, train)
    blocks = plan.layers_per_stage(model.layers)[stage]
    psi, small = lc.stage_psi(stage, plan.pp, blocks)
    tensors = params.stage_tensors(model, plan.tp, plan.pp, stage, blocks).numels
    if model.moe is not None and plan.pp == 1:
        dense, moe_blk = params.block_tensors(model, plan.tp).numels, params.moe_block_tensors(model, plan.tp).numels
        m = model.moe.first_dense
        tensors = (params.first_stage_tensors(model, plan.tp).numels + dense * m + moe_blk * (model.layers - m)
                   + params.last_stage_tensors(model, plan.tp, plan.pp).numels)
        psi = sum(tensors)
    owned = params.zero1_owned(tensors, zplan.dp)[dp_i * plan.cp + cp_i]
    eng = engines.engine_for(zplan)
    # lc.largest is over every parameter group, the experts' included: DeepSpeed keeps one offload
    # staging buffer per optimizer, counted with the dense group only (largest=0.0 below)
    sz = engines.sizes(zplan, psi, small, owned, largest=lc.largest)
    phases = counted_phases(plan)
    out = _by_location(eng, sz, phases)
    if model.moe is not None and plan.pp == 1:
        eplan = moe.expert_plan(zplan)
        numels = params.expert_tensors(model, plan.ep).numels * model.moe_layers
        e_owned = params.zero1_owned(numels, eplan.dp)[(dp_i // plan.ep) * plan.cp + cp_i]
        e_sz = engines.sizes(eplan, float(sum(numels)), 0.0, e_owned, largest=0.0)
        experts = _by_location(engines.engine_for(eplan), e_sz, phases)
        for loc, by in experts.items():
            for role in ("params", "grads", "optimizer"):
                out[loc][role] = out[loc].get(role, 0.0) + by.get(role, 0.0)
    return out


def _by_location(eng, sz, phases) -> dict[str, dict[str, float]]:
    host = eng.bytes_by_role(sz, phases, location="host")
    nvme = eng.bytes_by_role(sz, phases, location="nvme")
    return {"device": eng.bytes_by_role(sz, phases, location="device"),
            "host": {k: host[k] + nvme[k] for k in host}}
