"""Build one rank's DeepSpeed engine and data loader exactly as plan.json / ds_config.json say."""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from planner import dsconfig
from planner.errors import ExecutionError
from planner.executor.data import Layout, Rows
from planner.executor.model import (Block, Embedding, FinalNorm, GLMModel, Head, block_flags, lm_loss,
                                    tied_logits)
from planner.specs.model import ModelSpec
from planner.specs.plan import Plan


def rank_coords(rank: int, plan: Plan) -> tuple[int, int, int]:
    """(pp_index, dp_index, tp_index) of a global rank: torch.arange(world).view(pp, dp, tp)
    (planner/specs/plan.py; DeepSpeed's PipeModelDataParallelTopology order)."""
    return rank // (plan.dp * plan.tp), (rank // plan.tp) % plan.dp, rank % plan.tp


def _pipeline_class():
    from deepspeed.pipe import PipelineModule

    class PlannedPipeline(PipelineModule):
        """PipelineModule cut at the plan's explicit stage boundaries (DeepSpeed has no such
        partition method; overriding _partition_layers is the measured way, see the CPU notes)."""

        def __init__(self, *args, parts: list[int], **kw) -> None:
            object.__setattr__(self, "_planned_parts", list(parts))
            super().__init__(*args, **kw)

        def _partition_layers(self, method: str = "uniform") -> None:
            self.parts = list(self._planned_parts)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    return PlannedPipeline


def build_module(plan: Plan, spec: ModelSpec) -> torch.nn.Module:
    stages = plan.layers_per_stage(spec.layers)
    flags = block_flags(spec, stages, plan.checkpointed_per_stage(spec.layers))
    selective = plan.recompute == "selective"
    if plan.pp == 1:
        return GLMModel(spec, flags, selective)
    from deepspeed.pipe import LayerSpec, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    blocks = [LayerSpec(Block, spec, f, selective) for f in flags]
    if spec.tied_embeddings:  # the first and last stage share the embedding (DeepSpeed ties its gradient)
        tie = {"tied_weight_attr": ["word_embeddings.weight"]}
        layers = [TiedLayerSpec("embed", Embedding, spec, **tie)] + blocks + [
            LayerSpec(FinalNorm, spec), TiedLayerSpec("embed", Embedding, spec, forward_fn=tied_logits, **tie)]
    else:
        layers = [LayerSpec(Embedding, spec)] + blocks + [LayerSpec(Head, spec)]
    # embedding on the first stage, head on the last: boundaries in the flat layer list
    parts, at = [0], 1
    for n in stages:
        at += n
        parts.append(at)
    parts[-1] = len(layers)
    topo = PipeModelDataParallelTopology(num_pp=plan.pp, num_mp=plan.tp, num_dp=plan.dp)
    return _pipeline_class()(layers=layers, topology=topo, loss_fn=lm_loss, parts=parts,
                             seed_layers=True, activation_checkpoint_interval=0, partition_method="uniform")


def build_engine(plan: Plan, spec: ModelSpec, cfg: dict[str, Any]):
    """deepspeed.initialize with the saved config; a client torch AdamW when the config names
    no optimizer (CPU; planner/dsconfig.py explains why)."""
    import deepspeed
    ac = cfg.get("activation_checkpointing", {})
    deepspeed.checkpointing.configure(None, partition_activations=ac.get("partition_activations", False),
                                      contiguous_checkpointing=ac.get("contiguous_memory_optimization", False),
                                      checkpoint_in_cpu=ac.get("cpu_checkpointing", False),
                                      synchronize=ac.get("synchronize_checkpoint_boundary", False),
                                      profile=ac.get("profile", False))
    module = build_module(plan, spec)
    cfg = copy.deepcopy(cfg)
    optimizer = None
    if "optimizer" not in cfg:
        o = dsconfig.OPTIMIZER
        optimizer = torch.optim.AdamW(module.parameters(), lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"],
                                      weight_decay=o["weight_decay"])
    mpu = None
    if plan.tp > 1:
        # DeepSpeed checks train_batch_size against the DP size of the mpu it is given; with
        # config-only AutoTP it would count TP ranks as data parallel. Build the (dp, tp) mesh
        # first (TP fastest, the plan's rank order) and pass DeepSpeed's own groups as the mpu.
        from deepspeed.utils import groups
        groups._init_tp_mesh_device(tensor_model_parallel_size=plan.tp)
        mpu = groups
    try:
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=cfg, mpu=mpu,
                                               model_parameters=None if optimizer else module.parameters())
    except (AssertionError, ValueError, NotImplementedError, TypeError) as exc:
        raise ExecutionError("ds_config.json", f"DeepSpeed rejected the plan: {type(exc).__name__}: {exc}",
                             "re-plan with `planner search` (the plan is not runnable as written)") from None
    return engine


def check_topology(engine, plan: Plan, rank: int) -> None:
    """DeepSpeed's groups must match the plan's rank layout (one vocabulary)."""
    pp_i, dp_i, tp_i = rank_coords(rank, plan)
    if plan.pp > 1:
        got = (engine.grid.get_stage_id(), engine.grid.get_data_parallel_id())
        if got != (pp_i, dp_i):
            raise ExecutionError("rank layout", f"rank {rank}: DeepSpeed put it at stage/dp {got}, plan says "
                                 f"{(pp_i, dp_i)}", "report this as a bug")
    if plan.tp > 1:
        from deepspeed.utils import groups
        if groups.get_tensor_model_parallel_rank() != tp_i:
            raise ExecutionError("rank layout", f"rank {rank}: DeepSpeed's TP rank is "
                                 f"{groups.get_tensor_model_parallel_rank()}, plan says {tp_i}", "report this as a bug")


def set_poison(engine, on: bool) -> None:
    for m in engine.module.modules():
        if isinstance(m, Embedding):
            m.poison = on


class MicroBatches(Dataset):
    """Item i = the i-th micro-batch this rank reads: (ids, pos, segments, labels) tensors."""

    def __init__(self, rows: Rows, layout: Layout, batch_ids: list[int], dp_rank: int) -> None:
        self.index = [(b, m) for b in batch_ids for m in range(layout.grad_accum)]
        self.rows_of = [list(layout.rows(b, m, dp_rank)) for b, m in self.index]
        self.data = {i: rows.tensors(i) for r in self.rows_of for i in r}  # materialised once, picklable

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, k: int):
        parts = [self.data[i] for i in self.rows_of[k]]
        return tuple(torch.from_numpy(__import__("numpy").stack(col)) for col in zip(*parts))


def loader(rows: Rows, layout: Layout, batch_ids: list[int], dp_rank: int, device: str, workers: int) -> DataLoader:
    ds = MicroBatches(rows, layout, batch_ids, dp_rank)
    kw: dict[str, Any] = {"batch_size": None, "shuffle": False, "num_workers": workers,
                          "pin_memory": device == "cuda"}
    if workers > 0:
        kw.update(prefetch_factor=2, persistent_workers=False)
    return DataLoader(ds, **kw)
