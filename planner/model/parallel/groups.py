"""Process groups of the plan's rank layout, and the Megatron `mpu` DeepSpeed asks for them.

One vocabulary (planner/specs/plan.py): global rank = (pp_i * dp + dp_i) * tp + tp_i, i.e.
torch.arange(world).view(pp, dp, tp), which is DeepSpeed's
PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp) (axes pipe, data, model).
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


SINGLE = TPGroup()
"""No tensor parallelism: the same layers, groups of size 1, no communication."""


class Groups:
    """The plan's process groups; for pp == 1 also DeepSpeed's mpu (Megatron API)."""

    def __init__(self, pp: int, dp: int, tp: int, sequence_parallel: bool = False) -> None:
        import torch.distributed as dist
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
        self.topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
        self.rank = dist.get_rank()
        coord = self.topology.get_coord(self.rank)
        self.pp_rank, self.dp_rank, self.tp_rank = coord.pipe, coord.data, coord.model
        self.sizes = {"pipe": pp, "data": dp, "model": tp}
        self.ranks: dict[str, list[int]] = {}
        self._group: dict[str, Any] = {}
        for axis in ("model", "data", "pipe"):
            for ranks in self.topology.get_axis_comm_lists(axis):
                group = dist.new_group(ranks=ranks)
                if self.rank in ranks:
                    self.ranks[axis], self._group[axis] = list(ranks), group
        self.tp = TPGroup(rank=self.tp_rank, size=tp, group=self._group["model"] if tp > 1 else None,
                          sequence_parallel=sequence_parallel)

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
