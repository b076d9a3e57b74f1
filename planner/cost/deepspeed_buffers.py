"""The buffers DeepSpeed 0.19.8 allocates, per optimizer engine and ZeRO variant (the table and
the phases are planner/cost/engines.py's docstring); each buffer cites the file and function
that allocates it."""
from __future__ import annotations

import dataclasses

from planner.cost.buffers import Buffer, Collective, Engine, Kind

ENGINE_SRC = "deepspeed/runtime/engine.py _do_optimizer_sanity_check, _configure_optimizer"
SRC_ZERO12 = "runtime/zero/stage_1_and_2.py"
SRC_ZERO3 = "runtime/zero/stage3.py"


def _torch_adam(e: float) -> Engine:
    return Engine(
        name="torch AdamW / FusedAdam (no wrapper)",
        optimizer_sharded=False,
        source=ENGINE_SRC + ": fp32 without ZeRO returns no wrapper",
        buffers=(
            Buffer(
                name="fp32 weights",
                role="params", bytes=4, held_by="module",
                source="the module's parameters",
            ),
            Buffer(
                name="fp32 gradients",
                role="grads", bytes=4, phase="grads", held_by="module",
                source="p.grad; engine.py _take_model_step -> zero_grad frees them",
            ),
            Buffer(
                name="Adam moments", kind=Kind.ADAM_MOMENTS,
                role="optimizer", bytes=8,
                source="torch.optim.AdamW state exp_avg, exp_avg_sq",
            ),
            Buffer(
                name="flat all-reduce buffer",
                role="buckets", bytes=e, basis="fallback_bucket", phase="backward",
                source="engine.py allreduce_no_retain -> allreduce_bucket: self.flatten(bucket)",
            ),
        ),
        collectives=(
            Collective(
                kind="all_reduce", bytes=e, per="step", overlap=False,
                source="engine.py allreduce_gradients -> buffered_allreduce_fallback, at the accumulation "
                       "boundary after backward",
            ),
        ))


def _fp16_optimizer(e: float) -> Engine:
    return Engine(
        name="FP16_Optimizer / FP16_UnfusedOptimizer",
        optimizer_sharded=False,
        source=ENGINE_SRC + ": bf16 without pipeline -> DDP_BFLOAT16, fp16 -> FP16; runtime/fp16/fused_optimizer.py "
                            "(FusedAdam) or unfused_optimizer.py (a client torch optimizer)",
        buffers=(
            Buffer(
                name="16-bit weights",
                role="params", bytes=e, held_by="module",
                source="fused_optimizer.py __init__: fp16_groups_flat (the module's weights are views)",
            ),
            Buffer(
                name="16-bit gradients",
                role="grads", bytes=e, phase="grads", held_by="module",
                source="p.grad, freed by step (fused: p.grad = None; unfused: zero_grad)",
            ),
            Buffer(
                name="fp32 master weights",
                role="optimizer", bytes=4,
                source="fused_optimizer.py __init__: fp32_groups_flat; unfused_optimizer.py: fp32_groups",
            ),
            Buffer(
                name="Adam moments", kind=Kind.ADAM_MOMENTS,
                role="optimizer", bytes=8,
                source="exp_avg, exp_avg_sq of the fp32 copy",
            ),
            Buffer(
                name="fp32 gradient copy",
                role="grads", bytes=4, phase="step",
                source="fused_optimizer.py step: grads_groups_flat (p.grad.to(fp32)); unfused: fp32_param.grad",
            ),
            Buffer(
                name="flat all-reduce buffer",
                role="buckets", bytes=e, basis="fallback_bucket", phase="backward",
                source="engine.py allreduce_no_retain -> allreduce_bucket: self.flatten(bucket)",
            ),
        ),
        collectives=(
            Collective(
                kind="all_reduce", bytes=e, per="step", overlap=False,
                source="engine.py allreduce_gradients -> buffered_allreduce_fallback",
            ),
        ))


def _bf16_optimizer(e: float) -> Engine:
    return Engine(
        name="BF16_Optimizer",
        optimizer_sharded=True,
        source=ENGINE_SRC + ": bf16 with a pipeline and no ZeRO -> BFLOAT16; runtime/bf16_optimizer.py",
        buffers=(
            Buffer(
                name="bf16 weights",
                role="params", bytes=e, held_by="module",
                source="bf16_optimizer.py _setup_for_real_optimizer: bf16_groups_flat",
            ),
            Buffer(
                name="bf16 gradients",
                role="grads", bytes=e, phase="grads", held_by="module",
                source="p.grad (pipe/engine.py clears them before backward, zero_grad frees them after the step)",
            ),
            Buffer(
                name="gradient accumulation buffer",
                role="grads", bytes=e,
                source="bf16_optimizer.py _setup_for_real_optimizer: fp32_groups_gradients_flat in grad_acc_dtype (= "
                    "bf16 here), whole, never freed",
            ),
            Buffer(
                name="fp32 master partition", kind=Kind.MASTER_PARTITION,
                role="optimizer", bytes=4, sharded=True,
                source="bf16_optimizer.py: fp32_groups_flat_partition (1/dp of the flat weights)",
            ),
            Buffer(
                name="Adam moments", kind=Kind.ADAM_MOMENTS,
                role="optimizer", bytes=8, sharded=True,
                source="the basic optimizer steps the fp32 partition only",
            ),
            Buffer(
                name="fp32 gradient partition", kind=Kind.FP32_GRAD_PARTITION,
                role="grads", bytes=4, sharded=True, phase="step",
                source="bf16_optimizer.py step: grad_partition.to(fp32) when grad_acc_dtype is bf16",
            ),
        ),
        collectives=(
            Collective(
                kind="all_reduce", bytes=e, per="step", overlap=False,
                source="pipe/engine.py _exec_reduce_grads -> _bf16_reduce_grads -> buffered_allreduce_fallback",
            ),
            Collective(
                kind="all_gather", bytes=e, per="step", overlap=False,
                source="bf16_optimizer.py update_lp_params -> all_gather_dp_groups",
            ),
        ))


def _zero12(stage: int, e: float, overlap: bool, pipeline: bool = False) -> Engine:
    s = SRC_ZERO12
    grads = (
        Buffer(
            name="16-bit gradients",
            role="grads", bytes=e, phase="backward", held_by="module",
            source=s +
                ": p.grad until independent_gradient_partition_epilogue moves the owned partition (all_grad_tensors) "
                "and _clear_param_grad_only",
        ),
    ) if stage == 1 else ()
    return Engine(
        name=f"DeepSpeedZeroOptimizer (stage {stage})",
        optimizer_sharded=True,
        source=ENGINE_SRC + f": ZeRO -> _configure_zero_optimizer; {s}",
        buffers=grads + (
            Buffer(
                name="weights",
                role="params", bytes=e, held_by="module",
                source=s + " __init__: bit16_groups_flat (the module's weights are views)",
            ),
            Buffer(
                name="owned gradient partition", kind=Kind.OWNED_GRAD_PARTITION,
                role="grads", bytes=e, phase="grads", basis="owned",
                source=s +
                    ": stage 1: averaged_gradients = views of the whole p.grad of every parameter overlapping the "
                    "partition (all_grad_tensors, planner.cost.params.zero1_owned); stage 2: grads_in_partition, "
                    "which copy_grads_in_partition allocates as the sum of numel() over params_in_partition, i.e. "
                    "whole tensors too, the same owned count (measured: SP2xDP2 ZeRO-2's four ranks hold exactly "
                    "zero1_owned, docs/runtime.md); freed after the step",
            ),
            Buffer(
                name="fp32 master partition", kind=Kind.MASTER_PARTITION,
                role="optimizer", bytes=4, sharded=True,
                source=s + " __init__: single_partition_of_fp32_groups (a copy even in fp32)",
            ),
            Buffer(
                name="Adam moments", kind=Kind.ADAM_MOMENTS,
                role="optimizer", bytes=8, sharded=True,
                source="state of the fp32 partition",
            ),
            Buffer(
                name="fp32 gradient partition", kind=Kind.FP32_GRAD_PARTITION,
                role="grads", bytes=4, sharded=True, phase="step",
                source=s + " step: single_partition_of_fp32_groups.grad (flattened, cast to fp32)",
            ),
            Buffer(
                name="reduce buckets",
                role="buckets", bytes=e, count=2 if overlap or pipeline else 1, basis="reduce_bucket",
                phase="backward",
                source=s +
                    " setup_buckets (x2 with overlap_comm); a pipeline turns overlap_comm off but reduce_gradients("
                    "pipeline_parallel=True) appends a second buffer (contiguous_gradients), so two again (measured: "
                    "the allocated peak of a DP2xPP2 ZeRO-1 run, docs/lab.md); reduce_bucket_size elements each, "
                    "released by the epilogue",
            ),
        ),
        collectives=(
            Collective(
                kind="reduce_scatter", bytes=e, per="step" if stage == 1 else "micro_batch", overlap=overlap,
                source=s + " reduce_ipg_grads (stage 1: at the accumulation boundary; stage 2: every micro-batch)",
            ),
            Collective(
                kind="all_gather", bytes=e, per="step", overlap=False,
                source=s + " step -> all_gather_dp_groups of the updated partitions",
            ),
        ))


def _zero3(e: float) -> Engine:
    s = SRC_ZERO3
    return Engine(
        name="DeepSpeedZeroOptimizer_Stage3",
        optimizer_sharded=True,
        source=ENGINE_SRC + f": ZeRO-3 -> {s}",
        buffers=(
            Buffer(
                name="weight partition", kind=Kind.WEIGHT_PARTITION,
                role="params", bytes=e, sharded=True, held_by="module",
                source="partition_parameters.py: ds_tensor",
            ),
            Buffer(
                name="reduce bucket",
                role="buckets", bytes=e, basis="reduce_bucket",
                source=s + " __init__: ipg_buckets[dtype].buffer (reduce_bucket_size elements, kept)",
            ),
            Buffer(
                name="persistent small weights",
                role="params", bytes=e, basis="small",
                source="parameter_offload.py mark_persistent_parameters (numel <= param_persistence_threshold): kept "
                    "gathered",
            ),
            Buffer(
                name="gathered weights",
                role="buckets", bytes=e, basis="live_params", phase="backward",
                source="partitioned_param_coordinator.py: at most stage3_max_live_parameters gathered",
            ),
            Buffer(
                name="gradient partition", kind=Kind.GRAD_PARTITION,
                role="grads", bytes=e, sharded=True,
                source=s + " __init__: grad_partitions_flat_buffer",
            ),
            Buffer(
                name="fp32 master partition", kind=Kind.MASTER_PARTITION,
                role="optimizer", bytes=4, sharded=True,
                source=s + " _create_fp32_partitions: fp32_partitioned_groups_flat",
            ),
            Buffer(
                name="Adam moments", kind=Kind.ADAM_MOMENTS,
                role="optimizer", bytes=8, sharded=True,
                source="state of the fp32 partition",
            ),
            Buffer(
                name="fp32 gradient sub-group", kind=Kind.FP32_GRAD_PARTITION,
                role="grads", bytes=4, basis="sub_group", phase="step",
                source=s + " step: _prepare_fp32_grad_for_sub_group (one sub_group_size sub-group at a time)",
            ),
        ),
        # ZeRO-3's collectives are per fetched tensor and per bucket: planner/cost/zero.py
        collectives=())


SRC_OFFLOAD = "runtime/zero/offload_config.py; stage_1_and_2.py / stage3.py with offload_optimizer"


def _with_variants(engine: Engine, zero: int, e: float, offload_optimizer: str, offload_params: str, hpz: bool,
                   qwz: bool, accumulates: bool) -> Engine:
    """The engine with DeepSpeed's ZeRO variants applied to its buffers.

    Optimizer offload (ZeRO-Offload, Ren et al. 2021; ZeRO-Infinity for nvme): the fp32 master
    partition and Adam moments move to the host (or NVMe); gradients are copied out of the
    reduce buckets into the host fp32 partition's .grad (allocated at start-up, pinned; on
    NVMe swapped out with the states), so the device keeps no gradient partition and no fp32
    gradient copy. NVMe keeps a host swap buffer of one sub-group (fp32 master, moments and
    gradient, double-buffered).
    Parameter offload (ZeRO-3): the 16-bit weight partition (ds_tensor) lives on the host or
    NVMe (with a host swap buffer of the live parameters); gathered weights still come to the
    device. hpZ (ZeRO++, Wang et al. 2023): a secondary copy of the weights partitioned over
    the hpZ group only (ds_secondary_tensor). qwZ: the int8 gathered weights before
    dequantisation, up to the live parameters."""
    opt = {"cpu": "host", "nvme": "nvme"}.get(offload_optimizer)
    out = [m for m in (_moved(b, opt, offload_optimizer, offload_params) for b in engine.buffers) if m is not None]
    out += _variant_buffers(zero, e, opt, offload_optimizer, offload_params, hpz, qwz, accumulates)
    if not (opt or offload_params != "none" or hpz or qwz):
        return engine
    names = [v for v, on in ((f"optimizer offload to {offload_optimizer}", opt),
                             (f"parameter offload to {offload_params}", offload_params != "none"),
                             ("hpZ", hpz), ("qwZ", qwz)) if on]
    return dataclasses.replace(engine, name=f"{engine.name} + {', '.join(names)}", buffers=tuple(out))


def _moved(b: Buffer, opt: str | None, offload_optimizer: str, offload_params: str) -> Buffer | None:
    """Where optimizer / parameter offload puts one buffer (None: offload drops it)."""
    if opt and b.kind in (Kind.MASTER_PARTITION, Kind.ADAM_MOMENTS):
        b = dataclasses.replace(
            b, location=opt,
            source=b.source + f"; offload_optimizer {offload_optimizer}")
    elif opt and b.kind is Kind.FP32_GRAD_PARTITION:
        b = dataclasses.replace(b, location=opt, phase="always", basis="psi", sharded=True,
                                source=SRC_OFFLOAD + ": the host fp32 partition's .grad, accumulated from the "
                                                     "reduce buckets every micro-batch (nvme: swapped out with "
                                                     "the optimizer states, partitioned_optimizer_swapper.py)")
    elif opt and b.kind is Kind.OWNED_GRAD_PARTITION:
        return None  # ZeRO-1/2: the reduced gradients go straight to the host fp32 gradient
    elif opt and b.kind is Kind.GRAD_PARTITION:
        b = dataclasses.replace(b, location="host" if opt == "host" else "nvme",
                                source=SRC_ZERO3 + " with offload_optimizer: grad_partitions_flat_buffer in host "
                                                   "memory (measured: planner/runtime/observe/measure.py); with NVMe "
                                                   "swapped like the rest (ZeRO-Infinity, Rajbhandari et al. "
                                                   "2021, sec. 5: gradients offloaded to NVMe)")
    elif offload_params != "none" and b.kind is Kind.WEIGHT_PARTITION:
        b = dataclasses.replace(
            b, location="host" if offload_params == "cpu" else "nvme",
            source=b.source + f"; offload_param {offload_params}")
    return b


def _variant_buffers(zero: int, e: float, opt: str | None, offload_optimizer: str, offload_params: str, hpz: bool,
                     qwz: bool, accumulates: bool) -> list[Buffer]:
    """The buffers the ZeRO variants add: offload's staging and swap buffers, hpZ's secondary
    partition, qwZ's int8 gathers."""
    out: list[Buffer] = []
    if opt and zero in (1, 2):
        out += [
            Buffer(
                name="device gradient staging buffer",
                role="optimizer", bytes=e, basis="largest",
                source=SRC_ZERO12 + " __init__ (cpu_offload): temp_grad_buffer_for_gpu_offload, the largest "
                                    "parameter's size",
            ),
            Buffer(
                name="host gradient staging buffer",
                role="grads", bytes=e, basis="largest", location="host",
                source=SRC_ZERO12 + " __init__ (cpu_offload): temp_grad_buffer_for_cpu_offload",
            ),
            Buffer(
                name="16-bit partition for the copy back",
                role="optimizer", bytes=e, sharded=True, location="host",
                source=SRC_ZERO12 + " __init__ (cpu_offload): param_buffer_of_bit16_for_cpu_offload_groups",
            ),
        ]
        if zero == 2 and accumulates:
            out.append(Buffer(
                name="accumulated gradient partition",
                role="grads", bytes=e, sharded=True, location="host",
                source=SRC_ZERO12 + " async_accumulate_grad_in_cpu_via_gpu: accumulated_grads_in_cpu "
                                    "(gradient accumulation > 1)",
            ))
    if offload_optimizer == "nvme":
        out.append(Buffer(
            name="optimizer swap buffer",
            role="optimizer", bytes=32, basis="sub_group", location="host",
            source="runtime/swap_tensor/partitioned_optimizer_swapper.py: one sub-group's fp32 master, moments and "
                   "gradient, double-buffered",
        ))
    if offload_params == "nvme":
        out.append(Buffer(
            name="parameter swap buffer",
            role="params", bytes=e, basis="live_params", location="host",
            source="runtime/swap_tensor/partitioned_param_swapper.py: buffer_count x buffer_size pinned buffers "
                   "(about the live parameters)",
        ))
    if hpz:
        out.append(Buffer(
            name="hpZ secondary partition",
            role="params", bytes=e, basis="hpz", held_by="module",
            source="runtime/zero/partition_parameters.py _partition_param_sec: ds_secondary_tensor",
        ))
    if qwz:
        out.append(Buffer(
            name="int8 gathered weights",
            role="buckets", bytes=1, basis="live_params", phase="backward",
            source="runtime/zero/partition_parameters.py all_gather_coalesced (quantize): int8 buffers before "
                   "dequantisation",
        ))
    return out
