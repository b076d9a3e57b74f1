"""DeepSpeed's optimizer engines: which buffers each one holds, and what it sends over DP.

DeepSpeed 0.19.8 picks the optimizer wrapper in runtime/engine.py
`_do_optimizer_sanity_check` / `_configure_optimizer`, from the ZeRO stage, the model dtype
(bf16/fp16/fp32), the gradient-accumulation dtype (our configs leave it unset: the model
dtype) and whether the module is a PipelineModule:

| ZeRO | precision | pipeline | wrapper                                   | engine here  |
|------|-----------|----------|-------------------------------------------|--------------|
| 0    | fp32      | any      | none: the basic optimizer (torch AdamW on CPU, FusedAdam on GPU) | torch_adam |
| 0    | bf16      | no       | DDP_BFLOAT16 -> FP16_Optimizer (fused) / FP16_UnfusedOptimizer (client optimizer) | fp16_optimizer |
| 0    | fp16      | any      | FP16 -> FP16_Optimizer / FP16_UnfusedOptimizer | fp16_optimizer |
| 0    | bf16      | yes      | BFLOAT16 -> BF16_Optimizer                 | bf16_optimizer |
| 1, 2 | any       | (1 only) | DeepSpeedZeroOptimizer (stage_1_and_2.py)  | zero1 / zero2 |
| 3    | any       | no       | DeepSpeedZeroOptimizer_Stage3 (stage3.py)  | zero3        |

Each engine is a list of buffers. A buffer's size is bytes x a basis (the device's
parameters, its small parameters, the reduce bucket, ...), divided by the DP degree when
DeepSpeed partitions it, and lives for one phase of the step:

- "always": allocated at start-up (weights, master copies, Adam moments, flat buffers);
- "grads": created by backward and freed by the optimizer step (p.grad, a ZeRO partition of
  the reduced gradients) -- held at the step;
- "backward": only while backward runs (ZeRO-1's full p.grad before its epilogue moves the
  owned partition out, the reduce buckets, ZeRO-3's gathered parameters);
- "step": only inside optimizer.step (fp32 copies of the gradients).

The executor counts the same buffers tensor by tensor (planner/runtime/observe/measure.py): those
reached through the module (`held_by="module"`: p.data, p.grad, ZeRO-3's ds_tensor) and those
reached through the optimizer (`held_by="optimizer"`). Measured on tiny runs (README "The cost
model"): every "always" and "grads" buffer below appears with the predicted size.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from functools import lru_cache

from planner.specs.plan import Plan
from planner.specs.dtypes import activation_bytes

FALLBACK_BUCKET = 500_000_000
"""Elements per flat all-reduce in ZeRO-0's gradient reduction (runtime/engine.py
MEMORY_OPT_ALLREDUCE_SIZE, used by allreduce_gradients -> buffered_allreduce_fallback ->
allreduce_no_retain, which flattens up to this many elements into one temporary buffer)."""

PHASES = ("always", "grads", "backward", "step")
ROLES = ("params", "grads", "optimizer", "buckets")
BASES = ("psi", "small", "reduce_bucket", "fallback_bucket", "live_params", "sub_group", "owned", "hpz", "largest")
LOCATIONS = ("device", "host", "nvme")


class Kind(enum.Enum):
    """What a buffer is, for the rules that move buffers (offload, ZeRO variants): they select by
    kind, never by the display name."""
    OTHER = "other"
    MASTER_PARTITION = "fp32 master partition"
    ADAM_MOMENTS = "Adam moments"
    FP32_GRAD_PARTITION = "fp32 gradient partition"
    OWNED_GRAD_PARTITION = "owned gradient partition"
    GRAD_PARTITION = "gradient partition"
    WEIGHT_PARTITION = "weight partition"


@dataclass(frozen=True, slots=True, kw_only=True)
class Buffer:
    """One kind of tensor an engine holds on each device."""

    name: str
    """Display label (the report, metrics.json's buffer names)."""
    kind: Kind = Kind.OTHER
    role: str
    """Memory breakdown field: params, grads, optimizer or buckets."""
    bytes: float
    """Bytes per element of the basis."""
    basis: str = "psi"
    """psi: the device's parameters; small: ZeRO-3's persistent (small) parameters;
    reduce_bucket: plan.bucket_elements; fallback_bucket: min(psi, FALLBACK_BUCKET);
    live_params: min(psi, plan.bucket_elements); sub_group: min(psi / dp, plan.bucket_elements);
    owned: the elements of the whole gradients ZeRO-1 keeps for this rank's partition
    (planner.cost.params.zero1_owned; psi / dp when the tensors are not known);
    hpz: (psi - small) / hpz (ZeRO++'s secondary partition of the non-persistent weights);
    largest: the model's largest parameter tensor (offload staging buffers)."""
    sharded: bool = False
    """Partitioned over the data-parallel group (divided by dp)."""
    count: int = 1
    """How many such tensors (ZeRO-1/2's double reduce buffer under overlap_comm)."""
    phase: str = "always"
    held_by: str = "optimizer"
    """Where the executor's measurement finds it: module (p.data, p.grad) or optimizer."""
    source: str = ""
    """DeepSpeed 0.19.8 file and function that allocates it."""
    location: str = "device"
    """device, host (offloaded to CPU memory) or nvme (ZeRO-Infinity's swap files)."""

    def __post_init__(self) -> None:
        assert self.role in ROLES and self.phase in PHASES and self.basis in BASES, self
        assert self.location in LOCATIONS, self
        assert self.held_by in ("module", "optimizer") and isinstance(self.sharded, bool), self
        assert self.count >= 1 and (self.count == 1 or self.basis == "reduce_bucket"), self


@dataclass(frozen=True, slots=True, kw_only=True)
class Collective:
    """One data-parallel collective of an engine."""

    kind: str
    """all_reduce, reduce_scatter or all_gather (ring, nccl-tests conventions: planner.cost.comm)."""
    bytes: float
    """Bytes per parameter of the device (the full buffer, before partitioning)."""
    per: str
    """step (once per optimizer step) or micro_batch (every micro-batch)."""
    overlap: bool
    """Runs while backward still computes (hidden by up to dp_overlap of its time when
    overlap_comm is on); False: after backward or after the step, exposed."""
    source: str = ""

    def __post_init__(self) -> None:
        assert self.kind in ("all_reduce", "reduce_scatter", "all_gather") and self.per in ("step", "micro_batch"), self
        assert isinstance(self.overlap, bool), self


@dataclass(frozen=True, slots=True, kw_only=True)
class Engine:
    name: str
    """DeepSpeed's class name."""
    buffers: tuple[Buffer, ...]
    collectives: tuple[Collective, ...]
    optimizer_sharded: bool
    """Adam updates only this rank's 1/dp of the parameters."""
    source: str

    def __post_init__(self) -> None:
        assert isinstance(self.optimizer_sharded, bool), self

    def bytes_by_role(self, sizes: "Sizes", phases: tuple[str, ...] = ("always", "grads", "backward"),
                      held_by: str | None = None, location: str | None = "device") -> dict[str, float]:
        """Bytes per role of the buffers alive in `phases` (optionally only those the executor
        finds through `held_by`) kept in `location` (None: everywhere)."""
        out = dict.fromkeys(ROLES, 0.0)
        for b in self.buffers:
            if b.phase in phases and (held_by is None or b.held_by == held_by) and \
                    (location is None or b.location == location):
                out[b.role] += b.bytes * b.count * sizes.of(b)
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Sizes:
    """The bases buffers are sized from, for one device."""

    psi: float
    """Parameters the device holds (planner.cost.params)."""
    small: float = 0.0
    """Of those, elements in tensors ZeRO-3 keeps whole (planner.cost.params.persistence_threshold)."""
    dp: int = 1
    bucket_elements: float = 0.0
    owned: float | None = None
    """Elements ZeRO-1 keeps for this rank's gradient partition (planner.cost.params.zero1_owned);
    None: psi / dp."""
    live: float = 0.0
    """ZeRO-3's stage3_max_live_parameters (0: bucket_elements)."""
    hpz: int = 1
    largest: float = 0.0
    """Elements of the largest parameter tensor (planner.cost.layers.LayerCosts.largest)."""
    resident: bool = False
    """Count only the pages a buffer touches, as a CPU's resident set does (a GPU's allocator
    counts what was allocated): DeepSpeed allocates its reduce buckets with torch.empty and
    fills them with the rank's gradients, so `count` buckets touch min(psi, count x bucket)
    elements (planner.cost.model.resident_memory)."""

    def of(self, b: Buffer) -> float:
        if b.basis == "owned":
            return self.psi / self.dp if self.owned is None else self.owned
        if b.basis == "psi":
            n = self.psi
        elif b.basis == "small":
            n = self.small
        elif b.basis == "reduce_bucket":
            n = min(self.bucket_elements, self.psi / b.count) if self.resident else self.bucket_elements
        elif b.basis == "fallback_bucket":
            n = min(self.psi, FALLBACK_BUCKET)
        elif b.basis == "live_params":
            n = min(self.psi, self.live or self.bucket_elements)
        elif b.basis == "hpz":
            n = (self.psi - self.small) / self.hpz
        elif b.basis == "largest":
            n = self.largest
        else:  # sub_group
            n = min(self.psi / self.dp, self.bucket_elements)
        return n / self.dp if b.sharded else n


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
                role="grads", bytes=e, sharded=stage == 2, phase="grads", basis="owned" if stage == 1 else "psi",
                source=s +
                    ": stage 1: averaged_gradients = views of the whole p.grad of every parameter overlapping the "
                    "partition (all_grad_tensors, planner.cost.params.zero1_owned); stage 2: grads_in_partition; "
                    "freed after the step",
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


@lru_cache(maxsize=256)
def _engine(zero: int, precision: str, pipeline: bool, overlap_comm: bool, offload_optimizer: str = "none",
            offload_params: str = "none", hpz: bool = False, qwz: bool = False, accumulates: bool = False) -> Engine:
    return _with_variants(_base_engine(zero, precision, pipeline, overlap_comm), zero, activation_bytes(precision),
                          offload_optimizer, offload_params, hpz, qwz, accumulates)


def _base_engine(zero: int, precision: str, pipeline: bool, overlap_comm: bool) -> Engine:
    e = activation_bytes(precision)
    if zero == 0:
        if precision == "fp32":
            return _torch_adam(e)
        if precision == "bf16" and pipeline:
            return _bf16_optimizer(e)
        return _fp16_optimizer(e)
    if zero in (1, 2):
        # the pipeline engine turns overlap_comm off (runtime/engine.py _configure_zero_optimizer)
        return _zero12(zero, e, overlap=overlap_comm and not pipeline, pipeline=pipeline)
    return _zero3(e)


def engine_for(plan: Plan) -> Engine:
    """The optimizer engine DeepSpeed 0.19.8 builds for this plan's ds_config."""
    # fp8 (Transformer Engine) keeps bf16 weights and gradients: the bf16 engine
    precision = "bf16" if plan.precision == "fp8" else plan.precision
    return _engine(plan.zero, precision, plan.pp > 1, plan.overlap_comm, plan.offload_optimizer, plan.offload_params,
                   plan.hpz > 1, plan.quantized_weights, plan.zero == 2 and plan.offload_optimizer != "none" and plan.grad_accum > 1)


def sizes(plan: Plan, psi: float, small: float, owned: float | None = None, resident: bool = False,
          largest: float = 0.0) -> Sizes:
    """A device's bases. ZeRO partitions over plan.zero_shard ranks (the DP group, or MiCS's shard group)."""
    return Sizes(psi=psi, small=small, dp=plan.zero_shard, bucket_elements=float(plan.bucket_elements), owned=owned,
                 live=float(plan.live), hpz=plan.hpz, largest=largest, resident=resident)


class Footprint:
    """An engine's buffers for one plan, precompiled into coefficients so that the search can
    evaluate them hundreds of thousands of times: the same numbers as Engine.bytes_by_role.

    A buffer is either linear, a * psi + b * small + c bytes, capped, k * min(psi / div, cap),
    or k * owned (ZeRO-1's owned gradients, planner.cost.params.zero1_owned)."""

    __slots__ = ("linear_terms", "capped_terms", "owned_terms", "linear", "mins", "owned", "dp")

    def __init__(self, engine: Engine, plan: Plan, resident: bool, largest: float = 0.0) -> None:
        d, bucket = plan.zero_shard, float(plan.bucket_elements)
        capped = {"fallback_bucket": (1, float(FALLBACK_BUCKET)), "live_params": (1, float(plan.live)),
                  "sub_group": (d, bucket)}
        linear_terms, capped_terms, owned_terms = [], [], []
        self.dp = d
        for buf in engine.buffers:
            # a CPU "device" is the host: what DeepSpeed offloads stays in the same resident set
            if buf.location == "nvme" or (buf.location == "host" and not resident):
                continue
            group = 0 if buf.phase in ("always", "grads") else 1 if buf.phase == "backward" else 2
            k = buf.count * buf.bytes / (d if buf.sharded else 1)
            role = ROLES.index(buf.role)
            if buf.basis == "owned":
                owned_terms.append((group, role, k))
            elif buf.basis == "reduce_bucket" and resident:
                capped_terms.append((group, role, k, buf.count, bucket))
            elif buf.basis in capped:
                capped_terms.append((group, role, k, *capped[buf.basis]))
            else:
                coef = {"psi": (k, 0.0, 0.0), "small": (0.0, k, 0.0), "reduce_bucket": (0.0, 0.0, k * bucket),
                        "hpz": (k / plan.hpz, -k / plan.hpz, 0.0), "largest": (0.0, 0.0, k * largest)}
                linear_terms.append((group, role, *coef[buf.basis]))
        self.linear_terms, self.capped_terms = tuple(linear_terms), tuple(capped_terms)
        self.owned_terms = tuple(owned_terms)
        # totals for the search's fast path (planner.search.checkpoint.StageModel): per quantity
        # (held, held buckets, backward, backward buckets, step) a * psi + b * small + c, plus
        # the capped terms
        lin = [[0.0, 0.0, 0.0] for _ in range(5)]
        for group, role, a, b, c in linear_terms:
            for q in _slots(group, role):
                lin[q] = [lin[q][0] + a, lin[q][1] + b, lin[q][2] + c]
        self.linear = tuple(tuple(x) for x in lin)
        self.mins = tuple((q, k, div, cap) for group, role, k, div, cap in capped_terms for q in _slots(group, role))
        self.owned = tuple((q, k) for group, role, k in owned_terms for q in _slots(group, role))

    def evaluate(self, psi: float, small: float, owned: float | None = None) -> tuple[list[float], list[float], float]:
        """(bytes per role held from backward through the step, bytes per role during backward
        only, bytes during the step only) for a device with `psi` parameters (`owned`: see
        Sizes.owned)."""
        out = ([0.0] * 4, [0.0] * 4, [0.0])
        for group, role, a, b, c in self.linear_terms:
            out[group][role if group < 2 else 0] += a * psi + b * small + c
        for group, role, k, div, cap in self.capped_terms:
            out[group][role if group < 2 else 0] += k * min(psi / div, cap)
        for group, role, k in self.owned_terms:
            out[group][role if group < 2 else 0] += k * (psi / self.dp if owned is None else owned)
        return out[0], out[1], out[2][0]


def _slots(group: int, role: int) -> tuple[int, ...]:
    """Which totals a buffer adds to: held (0), held buckets (1), backward (2), backward
    buckets (3), step (4)."""
    if group == 2:
        return (4,)
    return (2 * group, 2 * group + 1) if role == ROLES.index("buckets") else (2 * group,)


_ENGINE_FIELDS = ("zero", "precision", "overlap_comm", "dp", "bucket_elements", "live_elements", "offload_optimizer",
                  "offload_params", "hpz", "quantized_weights", "mics_shard")


@lru_cache(maxsize=4096)
def _footprint(key: tuple, pipeline: bool, accumulates: bool, resident: bool, largest: float) -> Footprint:
    plan = Plan(**dict(zip(_ENGINE_FIELDS, key)), pp=2 if pipeline else 1, grad_accum=2 if accumulates else 1)
    return Footprint(engine_for(plan), plan, resident, largest)


def footprint(plan: Plan, resident: bool = False, largest: float = 0.0) -> Footprint:
    """The plan's engine, precompiled; `resident`: see Sizes.resident (a CPU device, whose host
    buffers are its own memory: offloaded buffers count); `largest`: see Sizes.largest."""
    return _footprint(tuple(getattr(plan, f) for f in _ENGINE_FIELDS), plan.pp > 1, plan.grad_accum > 1, resident,
                      float(largest))


def host_bytes(plan: Plan, psi: float, small: float, location: str = "host", largest: float = 0.0) -> float:
    """Bytes one rank keeps in host memory (or on NVMe) for the plan's offloaded states."""
    eng = engine_for(plan)
    return sum(eng.bytes_by_role(sizes(plan, psi, small, largest=largest), PHASES, location=location).values())


def state_bytes(plan: Plan, psi: float, small: float, location: str = "device", largest: float = 0.0) -> float:
    """Model-state bytes one rank holds at the optimizer step in `location` (the buffers of the
    "always" and "grads" phases): what the executor counts tensor by tensor after backward."""
    eng = engine_for(plan)
    return sum(eng.bytes_by_role(sizes(plan, psi, small, largest=largest), ("always", "grads"),
                                 location=location).values())
