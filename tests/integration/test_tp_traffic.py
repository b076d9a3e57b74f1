"""The cost model's TP collectives (planner.cost.tp.tp_block_comm / tp_stage_comm) against the
collectives the executor's layers really issue: one training step of the whole model at TP 2 on
two gloo processes, with and without sequence parallelism, counting every all-reduce,
all-gather and reduce-scatter torch.distributed runs (docs/runtime.md "Tensor parallelism").

Two numbers are compared per case: the bus bytes (all-reduce 2 (n-1)/n x its buffer,
all-gather and reduce-scatter (n-1)/n x the gathered buffer; a link of 1 byte/s and no
latency in the cost model) and the ring steps (2 (n-1) per all-reduce, n - 1 per all-gather or
reduce-scatter; a link with infinite bandwidth and 1 s latency).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from planner.cost.tp import tp_block_comm, tp_stage_comm
from planner.specs import preset, scale

pytestmark = pytest.mark.integration

_COUNT = r"""
import json, sys
import torch, torch.distributed as dist
from planner.model import glm as M
from planner.model.parallel.groups import Groups
from planner.specs import preset, scale
store, rank, cases = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
calls = []
real = {k: getattr(dist, k) for k in ("all_reduce", "all_gather", "reduce_scatter")}

def wrap(kind):
    def run(*a, **kw):
        group = kw.get("group")
        if group is not None and dist.get_world_size(group) == 2:
            if kind == "all_reduce":
                full = a[0].numel() * a[0].element_size()
            elif kind == "all_gather":
                full = sum(t.numel() * t.element_size() for t in a[0])
            else:
                full = sum(t.numel() * t.element_size() for t in a[1])
            calls.append((kind, full))
        return real[kind](*a, **kw)
    return run

for k in real:
    setattr(dist, k, wrap(k))
out = []
for name, sp, b, s in cases:
    spec = scale(preset(name), "tiny")
    import dataclasses
    spec = dataclasses.replace(spec, hidden_dropout=0.0, attention_dropout=0.0)
    groups = Groups(1, 1, 2, sequence_parallel=sp)
    torch.manual_seed(0)
    model = M.GLMModel(spec, [False] * spec.layers, False, tp=groups.tp).to(torch.bfloat16)
    ids = torch.randint(0, spec.vocab, (b, s))
    pos, seg = torch.arange(s).repeat(b, 1), torch.ones(b, s, dtype=torch.long)
    calls.clear()
    loss = model.loss_fn(model(ids, pos, seg), ids)
    forward = list(calls)
    loss.backward()
    out.append({"forward": forward, "all": list(calls)})
dist.barrier()
if rank == 0:
    print(json.dumps(out))
dist.destroy_process_group()
"""


def _steps(kind: str, n: int = 2) -> int:
    return 2 * (n - 1) if kind == "all_reduce" else n - 1


def _bus(kind: str, nbytes: float, n: int = 2) -> float:
    return nbytes * (2 if kind == "all_reduce" else 1) * (n - 1) / n


def test_tp_collectives_are_the_cost_models(tmp_path) -> None:
    cases = [("chatglm3-6b", False, 2, 16), ("chatglm3-6b", True, 2, 16), ("glm-10b", False, 2, 16),
             ("glm-10b", True, 2, 16)]
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    procs = [subprocess.Popen([sys.executable, "-c", _COUNT, str(tmp_path / "store"), str(r), json.dumps(cases)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][1][-2000:] + outs[1][1][-2000:]
    got = json.loads(outs[0][0].strip().splitlines()[-1])
    for (name, sp, b, s), run in zip(cases, got):
        spec = scale(preset(name), "tiny")
        bus = sum(_bus(k, n) for k, n in run["all"])
        steps = sum(_steps(k) for k, _ in run["all"])
        volume = (1.0, 0.0)       # 1 byte/s, no latency: seconds = bus bytes
        latency = (1e30, 1.0)     # no transfer time, 1 s per ring step: seconds = ring steps
        want = []
        for link in (volume, latency):
            fwd, bwd = tp_block_comm(spec, s, b, 2, 2.0, sp, link, 1.0)
            first, last = tp_stage_comm(spec, s, b, 2, 2.0, sp, link, 1.0)
            want.append(spec.layers * (fwd + bwd) + first + last)
        assert bus == pytest.approx(want[0], rel=1e-12), (name, sp, run["all"])
        assert steps == pytest.approx(want[1], rel=1e-12), (name, sp, run["all"])
        # forward, b s h messages: per block 2 all-reduces (SP: 2 all-gathers + 2 reduce-scatters);
        # the embedding's all-reduce (SP: a reduce-scatter; learned positions keep the all-reduce);
        # under SP the output layer's all-gather of its input
        h = spec.hidden * b * s * 2
        fwd = {k: sum(1 for kind, n in run["forward"] if kind == k and n == h)
               for k in ("all_reduce", "all_gather", "reduce_scatter")}
        learned = spec.position == "learned"
        L = spec.layers
        if sp:
            assert fwd == {"all_reduce": int(learned), "all_gather": 2 * L + 1, "reduce_scatter": 2 * L + (not learned)}
        else:
            assert fwd == {"all_reduce": 2 * L + 1, "all_gather": 0, "reduce_scatter": 0}
