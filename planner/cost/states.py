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

from planner.cost import engines, params
from planner.cost.model import layer_costs
from planner.specs.hardware import ClusterSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import Plan
from planner.specs.train import TrainSpec


def counted_phases(plan: Plan) -> tuple[str, ...]:
    """The engine phases alive when the executor counts (see the module docstring)."""
    return ("always",) if plan.pp > 1 else ("always", "grads")


def rank_states(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, plan: Plan,
                rank: int) -> dict[str, dict[str, float]]:
    """{"device": {class: bytes}, "host": {class: bytes}} one rank holds when counted; host
    sums host memory and NVMe (what DeepSpeed offloads)."""
    lc = layer_costs(model, cluster, train, plan)
    stage, dp_rank = plan.coords(rank)[:2]
    blocks = plan.layers_per_stage(model.layers)[stage]
    psi, small = lc.stage_psi(stage, plan.pp, blocks)
    owned = params.zero1_owned(params.stage_tensors(model, plan.tp, plan.pp, stage, blocks).numels, plan.dp)[dp_rank]
    eng = engines.engine_for(plan)
    sz = engines.sizes(plan, psi, small, owned, largest=lc.largest)
    phases = counted_phases(plan)
    host = eng.bytes_by_role(sz, phases, location="host")
    nvme = eng.bytes_by_role(sz, phases, location="nvme")
    return {"device": eng.bytes_by_role(sz, phases, location="device"),
            "host": {k: host[k] + nvme[k] for k in host}}
