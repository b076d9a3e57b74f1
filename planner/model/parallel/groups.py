"""Process groups of the plan's rank layout, and the Megatron `mpu` DeepSpeed asks for them.

One vocabulary (planner/specs/mesh.py): global rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i,
i.e. torch.arange(world).view(pp, dp, cp, tp); without context parallelism that is DeepSpeed's
PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp) (axes pipe, data, model), with it
the topology's data axis is dp x cp (dp index x cp + cp index).
Every rank creates every group, in the same order, before the module is built
(torch.distributed.new_group is collective over the world).

Who uses what:
- the tensor-parallel layers (tensor.py) use `tp` (a TPGroup) for their collectives;
- pp == 1: `Groups` itself is the mpu handed to deepspeed.initialize. Its model-parallel group
  is the TP group (Megatron's convention), so ZeRO partitions over the DP group and the
  gradient norm is summed over TP (deepspeed/runtime/utils.py clip_grad_norm_,
  zero/stage_1_and_2.py, zero/stage3.py);
- pp > 1: the PipelineModule gets `topology` and builds DeepSpeed's PipelineParallelGrid, which
  is then the engine's mpu (DeepSpeed asserts that no mpu is passed with a pipeline). Its
  model-parallel group spans pipe x model.
- context parallelism (DeepSpeed-Ulysses, cp > 1): `cp` (a TPGroup of the ranks that split each
  sequence) for DistributedAttention, and the mpu's sequence-parallel API, which DeepSpeed
  asks for its sequence-data-parallel group (dp x cp: gradients reduced and ZeRO partitions
  there, deepspeed/utils/groups.py _get_sequence_data_parallel_group);
- expert parallelism (a MoE model): `ep` (this rank's place among the ep consecutive
  data-parallel ranks that split the experts), and DeepSpeed-MoE's expert-parallel and
  expert-data-parallel groups registered under its group name (ep_size_<ep>) before the
  engine is built, so deepspeed.moe.layer.MoE uses them instead of building its own
  (DeepSpeed's legacy layout would put TP peers in one expert-parallel group). Expert data
  parallelism: the ranks of the same pipeline stage, TP rank and place in the EP group, over
  dp / ep EP groups and the cp ranks (Plan.expert_dp).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class TPGroup:
    """This rank's place in its tensor-parallel group: what a TP layer needs."""

    rank: int = 0
    size: int = 1
    group: Any = None
    """torch ProcessGroup. None: no communication (size 1, or one rank's shapes timed alone by
    the profiler)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: activations outside the TP region are split along the sequence."""


def expert_group_name(ep: int) -> str:
    """DeepSpeed-MoE's name of the expert-parallel group of size ep (deepspeed/moe/layer.py)."""
    return f"ep_size_{ep}"


SINGLE = TPGroup()
"""No tensor parallelism: the same layers, groups of size 1, no communication."""


class Groups:
    """The plan's process groups; for pp == 1 also DeepSpeed's mpu (Megatron API)."""

    def __init__(self, pp: int, dp: int, tp: int, sequence_parallel: bool = False, cp: int = 1,
                 ep: int | None = None) -> None:
        """ep: the expert-parallel size of a MoE model (None: a dense model, no expert groups)."""
        import torch.distributed as dist
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
        from planner.specs.mesh import Mesh
        self.topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp * cp)
        self.mesh = mesh = Mesh(pp=pp, dp=dp, cp=cp, tp=tp)
        self.rank = dist.get_rank()
        self.pp_rank, self.dp_rank, self.cp_rank, self.tp_rank = mesh.coords(self.rank)
        self.sizes = {"pipe": pp, "data": dp, "model": tp, "seq": cp, "seqdata": dp * cp}
        self.ranks: dict[str, list[int]] = {}
        self._group: dict[str, Any] = {}
        # every rank creates every group in the same order (new_group is collective)
        lists = {"model": mesh.groups("tp"), "data": mesh.groups("dp"), "pipe": mesh.groups("pp")}
        if cp > 1:
            lists["seq"] = mesh.groups("cp")
            lists["seqdata"] = tuple(tuple(mesh.rank(p, d, c, t) for d in range(dp) for c in range(cp))
                                     for p in range(pp) for t in range(tp))
        for axis, groups in lists.items():
            for ranks in groups:
                group = dist.new_group(ranks=list(ranks))
                if self.rank in ranks:
                    self.ranks[axis], self._group[axis] = list(ranks), group
        if cp == 1:
            self.ranks["seq"], self._group["seq"] = [self.rank], None
            self.ranks["seqdata"], self._group["seqdata"] = self.ranks["data"], self._group["data"]
        self.tp = TPGroup(rank=self.tp_rank, size=tp, group=self._group["model"] if tp > 1 else None,
                          sequence_parallel=sequence_parallel)
        self.cp = TPGroup(rank=self.cp_rank, size=cp, group=self._group["seq"])
        self.ep = None
        if ep is not None:
            self.ep = self._expert_groups(ep)

    def _expert_groups(self, ep: int) -> TPGroup:
        """Build and register DeepSpeed-MoE's expert-parallel and expert-data-parallel groups of
        size ep (module docstring); returns this rank's place in its expert-parallel group."""
        import torch.distributed as dist
        from deepspeed.utils import groups as ds_groups
        m, (pp, dp, cp, tp) = self.mesh, (self.mesh.pp, self.mesh.dp, self.mesh.cp, self.mesh.tp)
        if dp % ep:
            raise ValueError(f"EP {ep} must divide the data-parallel size {dp}")
        name = expert_group_name(ep)
        ep_lists = [[m.rank(p, blk * ep + i, c, t) for i in range(ep)]
                    for p in range(pp) for blk in range(dp // ep) for c in range(cp) for t in range(tp)]
        edp_lists = [[m.rank(p, blk * ep + i, c, t) for blk in range(dp // ep) for c in range(cp)]
                     for p in range(pp) for t in range(tp) for i in range(ep)]
        for key, lists in (("ep", ep_lists), ("edp", edp_lists)):
            for ranks in lists:
                group = dist.new_group(ranks=ranks)
                if self.rank in ranks:
                    self.ranks[key], self._group[key] = ranks, group
        ds_groups._EXPERT_PARALLEL_GROUP[name] = self._group["ep"]
        ds_groups._EXPERT_PARALLEL_GROUP_RANKS[name] = self.ranks["ep"]
        ds_groups._EXPERT_DATA_PARALLEL_GROUP[name] = self._group["edp"]
        ds_groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = self.ranks["edp"]
        return TPGroup(rank=self.ranks["ep"].index(self.rank), size=ep, group=self._group["ep"])

    # --- Megatron mpu API, as DeepSpeed 0.19.8 calls it (pp == 1) ----------------------------
    def get_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.sizes["model"]

    def get_model_parallel_group(self):
        return self._group["model"]

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.ranks["model"][0]

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.sizes["data"]

    def get_data_parallel_group(self):
        return self._group["data"]

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.ranks["data"]

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.pp_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.sizes["pipe"]

    def get_pipeline_model_parallel_group(self):
        return self._group["pipe"]

    # --- DeepSpeed-Ulysses: the sequence-parallel API deepspeed/utils/groups.py asks ----------
    def get_sequence_parallel_group(self):
        return self._group["seq"]

    def get_sequence_parallel_world_size(self) -> int:
        return self.sizes["seq"]

    def get_sequence_parallel_rank(self) -> int:
        return self.cp_rank

    def get_sequence_data_parallel_group(self):
        return self._group["seqdata"]

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.sizes["seqdata"]

    def get_sequence_data_parallel_rank(self) -> int:
        return self.ranks["seqdata"].index(self.rank)
