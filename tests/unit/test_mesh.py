"""The rank layout (planner/specs/mesh.py, Plan.rank/coords/groups) is DeepSpeed's own: every
rank's coordinates and every group of every axis, against PipeModelDataParallelTopology (the
topology the runtime's process groups are built from) and, with the context-parallel axis,
against ProcessTopology over (pipe, data, context, model)."""
from __future__ import annotations

import pytest

from planner.specs.mesh import Mesh
from planner.specs.plan import Plan

topology = pytest.importorskip("deepspeed.runtime.pipe.topology")

SHAPES = [(1, 1, 1), (2, 3, 4), (4, 2, 2), (3, 5, 1), (1, 8, 2), (2, 1, 8)]
"""(pp, dp, tp)"""


@pytest.mark.parametrize("pp,dp,tp", SHAPES)
def test_the_layout_is_deepspeeds_pipe_data_model_topology(pp: int, dp: int, tp: int) -> None:
    ds = topology.PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    plan = Plan(pp=pp, dp=dp, tp=tp, micro_batch=1, grad_accum=max(1, pp))
    for r in range(plan.world_size):
        c = ds.get_coord(r)
        assert plan.coords(r) == (c.pipe, c.data, 0, c.model)
        assert plan.rank(pp=c.pipe, dp=c.data, tp=c.model) == r == ds.get_rank(pipe=c.pipe, data=c.data, model=c.model)
    for ours, theirs in (("tp", "model"), ("dp", "data"), ("pp", "pipe")):
        assert sorted(map(list, plan.groups(ours))) == sorted(ds.get_axis_comm_lists(theirs))
        for r in range(plan.world_size):
            assert r in plan.mesh.group(ours, r) in plan.groups(ours)


@pytest.mark.parametrize("pp,dp,cp,tp", [(2, 2, 2, 2), (1, 3, 2, 2), (2, 1, 4, 1)])
def test_the_context_axis_sits_between_data_and_model(pp: int, dp: int, cp: int, tp: int) -> None:
    ds = topology.ProcessTopology(axes=["pipe", "data", "context", "model"], dims=[pp, dp, cp, tp])
    mesh = Mesh(pp=pp, dp=dp, cp=cp, tp=tp)
    for r in range(mesh.world):
        c = ds.get_coord(r)
        assert mesh.coords(r) == (c.pipe, c.data, c.context, c.model)
    for ours, theirs in (("tp", "model"), ("cp", "context"), ("dp", "data"), ("pp", "pipe")):
        assert sorted(map(list, mesh.groups(ours))) == sorted(ds.get_axis_comm_lists(theirs))


def test_groups_come_stage_by_stage() -> None:
    """The cost model reads the groups of one pipeline stage as one slice (planner/cost/comm.py)."""
    mesh = Mesh(pp=2, dp=2, tp=2)
    assert mesh.groups("dp") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert mesh.groups("tp") == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert mesh.groups("pp") == ((0, 4), (1, 5), (2, 6), (3, 7))
    with pytest.raises(ValueError):
        mesh.groups("ep")
