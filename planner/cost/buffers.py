"""The vocabulary of DeepSpeed's optimizer engines (planner/cost/engines.py): a Buffer (bytes x
a basis, partitioned or not, alive for one phase of the step, on the device, the host or NVMe),
the collectives an engine sends over DP, an Engine (its buffers), the bases of one device (Sizes).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

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
    elements (planner.cost.stage.resident_memory)."""

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
