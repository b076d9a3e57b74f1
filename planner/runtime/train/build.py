"""Build one rank's DeepSpeed engine and data loader exactly as plan.json / ds_config.json say."""
from __future__ import annotations

import copy
import traceback
from typing import Any, Callable

import torch
from torch.utils.data import DataLoader

from planner import dsconfig
from planner.errors import ExecutionError
from planner.data.batching import Layout, Rows
from planner.data.loader import LoaderSettings, MicroBatches
from planner.model.embedding import WordEmbedding
from planner.model.glm import GLMModel
from planner.model.recompute import block_flags
from planner.model.parallel.groups import SINGLE, Groups
from planner.model.parallel.pipeline import build_pipeline
from planner.model.parallel.tensor import seed_dropout
from planner.specs.model import ModelSpec
from planner.specs.plan import Plan


def build_module(plan: Plan, spec: ModelSpec, groups: Groups, attention: str = "flash",
                 seed: int = 1234) -> torch.nn.Module:
    """The plan's model on this rank: Megatron-style TP layers on `groups`, cut into pipeline
    stages when pp > 1 (parallel/pipeline.py)."""
    stages = plan.layers_per_stage(spec.layers)
    flags = block_flags(spec, stages, plan.checkpointed_per_stage(spec.layers))
    selective = plan.recompute == "selective"
    if plan.pp > 1 and spec.share_layers > 1:
        raise ExecutionError("plan.pp", f"share-layers {spec.share_layers} cannot run under pp {plan.pp} (a shared "
                             "block's parameters would live on several stages)", "use pp 1")
    if plan.pp == 1:
        return GLMModel(spec, flags, selective, tp=groups.tp, attention=attention, seed=seed, cp=groups.cp,
                        ep=groups.ep or SINGLE)
    if plan.cp > 1 or spec.moe is not None:
        raise ValueError("the executor runs context parallelism and mixture-of-experts layers with pp 1 only")
    return build_pipeline(spec, groups, stages, flags, selective, attention, seed)


def mark_norm_owners(module: torch.nn.Module, tp_rank: int) -> None:
    """Make DeepSpeed's gradient norm count each parameter exactly once.

    DeepSpeed counts a parameter on a rank when `is_model_parallel_parameter(p)` (the attribute
    `model_parallel`) or when the rank is model-parallel rank 0, then sums over its model-parallel
    group (deepspeed/runtime/utils.py clip_grad_norm_ and is_model_parallel_parameter;
    zero/stage_1_and_2.py and zero/stage3.py get_grad_norm_direct; bf16_optimizer.py
    get_grads_for_norm). Most paths take "rank 0" as the TP rank, but clip_grad_norm_ (fp32,
    ZeRO-0) takes mpu.get_model_parallel_rank(), which under a pipeline is the rank in the
    pipe x model group, and it does not skip the tied copy on the last stage. So: a TP-split
    parameter is counted on every TP rank (each holds a different slice), a replicated one on
    TP rank 0 only, and the pipeline's tied copy (`ds_pipe_replicated`) never."""
    for p in module.parameters():
        if getattr(p, "ds_pipe_replicated", False):
            p.model_parallel = False
        else:
            p.model_parallel = getattr(p, "tp_split", None) is not None or tp_rank == 0


def build_engine(plan: Plan, spec: ModelSpec, cfg: dict[str, Any], *, attention: str = "flash", seed: int = 1234,
                 init_weights: Callable[[torch.nn.Module], None] | None = None):
    """deepspeed.initialize with the saved config; a client torch AdamW when the config names
    no optimizer (CPU; planner/dsconfig.py explains why). `init_weights(module)` runs on the
    built (TP- and PP-sharded) module before deepspeed.initialize, so ZeRO-3 partitions what it
    loaded (planner/hf/weights.py load_hf_weights). Returns (engine, groups)."""
    import deepspeed
    ac = cfg.get("activation_checkpointing", {})
    deepspeed.checkpointing.configure(None, partition_activations=ac.get("partition_activations", False),
                                      contiguous_checkpointing=ac.get("contiguous_memory_optimization", False),
                                      checkpoint_in_cpu=ac.get("cpu_checkpointing", False),
                                      synchronize=ac.get("synchronize_checkpoint_boundary", False),
                                      profile=ac.get("profile", False))
    try:
        groups = Groups(plan.pp, plan.dp, plan.tp, sequence_parallel=plan.sequence_parallel, cp=plan.cp,
                        ep=plan.ep if spec.moe is not None else None)
        module = build_module(plan, spec, groups, attention, seed)
    except ValueError as exc:
        raise ExecutionError("plan.json", f"the model cannot be split as planned: {exc}",
                             "re-plan with `planner search`") from None
    if init_weights is not None:
        init_weights(module)
    seed_dropout(seed, groups.pp_rank, groups.tp_rank)  # after the build: PipelineModule may reseed
    mark_norm_owners(module, groups.tp_rank)
    if plan.zero == 3 and plan.pp == 1 and spec.tied_embeddings:
        # the output layer uses the embedding's weight outside the embedding's forward
        deepspeed.zero.register_external_parameter(module, module.embedding.word_embeddings.weight)
    cfg = copy.deepcopy(cfg)
    optimizer = None
    params: Any = list(module.parameters())
    if spec.moe is not None:
        # DeepSpeed-MoE: the experts in their own parameter groups (one per expert-parallel group
        # name), which ZeRO partitions over the expert-data-parallel ranks
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
        params = split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "dense"})
    if "optimizer" not in cfg:
        o = dsconfig.OPTIMIZER
        optimizer = torch.optim.AdamW(params, lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"],
                                      weight_decay=o["weight_decay"])
    try:
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=cfg,
                                               mpu=groups if plan.pp == 1 else None,
                                               model_parameters=None if optimizer else params)
    except (AssertionError, ValueError, NotImplementedError, TypeError) as exc:
        traceback.print_exc()  # the rank's log keeps the DeepSpeed frame that refused
        raise ExecutionError("ds_config.json", f"DeepSpeed rejected the plan: {type(exc).__name__}: {exc}",
                             "re-plan with `planner search` (the plan is not runnable as written)") from None
    _keep_fp32_clip_norm(engine, groups)
    return engine, groups


def _keep_fp32_clip_norm(engine, groups: Groups) -> None:
    """DeepSpeed's fp32 ZeRO-0 path (engine.clip_fp32_gradients) computes the global gradient
    norm for clipping and drops it; keep it, so get_global_grad_norm() (the stability monitor,
    the parity test) sees the norm the step used. With expert parallelism DeepSpeed's
    clip_grad_norm_ averages each rank's norm over the data-parallel ranks, which is not the
    norm of the whole gradient when the ranks hold different experts: there the norm is
    moe_grad_norm's."""
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip() -> None:
        engine._global_grad_norm = clip_grad_norm_(parameters=engine.module.parameters(),
                                                   max_norm=engine.gradient_clipping(), mpu=engine.mpu)

    def clip_moe() -> None:
        params = [p for p in engine.module.parameters() if p.grad is not None]
        norm = moe_grad_norm(params, groups)
        engine._global_grad_norm = norm
        if engine.gradient_clipping() > 0:
            coef = min(1.0, engine.gradient_clipping() / (float(norm) + 1e-6))
            for p in params:
                p.grad.data.mul_(coef)
    engine.clip_fp32_gradients = clip_moe if groups.ep is not None and groups.ep.size > 1 else clip


def moe_grad_norm(params: list[torch.nn.Parameter], groups: Groups) -> torch.Tensor:
    """The 2-norm of the whole gradient with the experts split over expert-parallel ranks: the
    replicated and TP-split parameters as DeepSpeed counts them (model_parallel, mark_norm_owners)
    summed over TP, plus the experts' squares summed over TP rank 0 of every EP rank."""
    import torch.distributed as dist
    from deepspeed.moe.utils import is_moe_param
    dense = torch.zeros(1, dtype=torch.float64)
    expert = torch.zeros(1, dtype=torch.float64)
    for p in params:
        sq = p.grad.detach().double().pow(2).sum()
        if is_moe_param(p):
            expert += sq if groups.tp_rank == 0 else 0.0
        elif getattr(p, "model_parallel", True):
            dense += sq
    if groups.tp.group is not None:
        dist.all_reduce(dense, group=groups.tp.group)
        dist.all_reduce(expert, group=groups.tp.group)
    dist.all_reduce(expert, group=groups.ep.group)
    return (dense + expert).sqrt().float()


def check_topology(engine, groups: Groups, plan: Plan, rank: int) -> None:
    """DeepSpeed's groups and ours must match the plan's rank layout (one vocabulary)."""
    import torch.distributed as dist
    from deepspeed.utils.bwc import bwc_tensor_model_parallel_rank
    pp_i, dp_i, cp_i, tp_i = plan.coords(rank)
    want = {axis: list(plan.mesh.group(short, rank)) for axis, short in (("model", "tp"), ("data", "dp"),
                                                                          ("pipe", "pp"))}
    got_groups = {k: v for k, v in groups.ranks.items() if k in want}
    mpu = engine.mpu
    got = {"coords": (groups.pp_rank, groups.dp_rank, groups.cp_rank, groups.tp_rank), "groups": got_groups,
           "deepspeed data group": dist.get_process_group_ranks(mpu.get_data_parallel_group()),
           "deepspeed TP rank": bwc_tensor_model_parallel_rank(mpu)}
    if plan.pp > 1:
        got["deepspeed stage/dp"] = (engine.grid.get_stage_id(), engine.grid.get_data_parallel_id())
        got["deepspeed TP group"] = dist.get_process_group_ranks(engine.grid.get_slice_parallel_group())
    if plan.cp > 1:
        want_seq = list(plan.mesh.group("cp", rank))
        got["deepspeed sequence group"] = dist.get_process_group_ranks(mpu.get_sequence_parallel_group())
        got["deepspeed sequence-data group"] = sorted(dist.get_process_group_ranks(
            mpu.get_sequence_data_parallel_group()))
    expect = {"coords": (pp_i, dp_i, cp_i, tp_i), "groups": want, "deepspeed data group": want["data"],
              "deepspeed TP rank": tp_i}
    if plan.cp > 1:
        expect["deepspeed sequence group"] = want_seq
        expect["deepspeed sequence-data group"] = sorted(r for d in range(plan.dp) for c in range(plan.cp)
                                                         for r in [plan.rank(pp_i, d, c, tp_i)])
    if plan.pp > 1:
        expect["deepspeed stage/dp"] = (pp_i, dp_i)
        expect["deepspeed TP group"] = want["model"]
    for key, value in expect.items():
        if got[key] != value:
            raise ExecutionError("rank layout", f"rank {rank}: {key} is {got[key]}, the plan's layout says {value}",
                                 "report this as a bug")


def set_poison(engine, on: bool) -> None:
    for m in engine.module.modules():
        if isinstance(m, WordEmbedding):
            m.poison = on


class TensorMicroBatches(MicroBatches):
    """MicroBatches (planner/data/loader.py) as torch's map-style dataset: item k is the k-th
    micro-batch's (ids, pos, segments, labels) tensors."""

    def __getitem__(self, k: int):
        return tuple(torch.from_numpy(a) for a in self.arrays(k))


def loader(rows: Rows, layout: Layout, batch_ids: list[int], dp_rank: int, device: str,
           settings: LoaderSettings) -> DataLoader:
    """The rank's torch DataLoader over its micro-batches of `batch_ids`, in order, with the
    workers, pinned memory and prefetch of `settings` (planner/data/loader.py choose_loader)."""
    ds = TensorMicroBatches(rows, layout, batch_ids, dp_rank)
    kw: dict[str, Any] = {"batch_size": None, "shuffle": False, "num_workers": settings.workers,
                          "pin_memory": settings.pin_memory and device == "cuda"}
    if settings.workers > 0:
        kw.update(prefetch_factor=settings.prefetch_factor, persistent_workers=False)
    return DataLoader(ds, **kw)
