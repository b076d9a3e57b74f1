"""Named runtime factors: how the runtime a plan runs on departs from the ideal.

They live in each profile's "factors" map (per device; DeepSpeed) and in each runtime's file
(profiles/runtimes/*.json), are fitted from measured runs by `planner calibrate`, and default
to the values below. None is a silent fudge: each has one meaning, and a built-in profile
states where its value came from in "sources".

The cost model takes them as one typed, frozen `Factors` (cluster_factors), never as a dict:
a misspelt factor is an AttributeError, not a silent default.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from planner.cost.runtime import DEFAULT as DEFAULT_RUNTIME, get_runtime, runtime_factors
from planner.specs.hardware import DeviceProfile
from planner.specs.cluster import ClusterSpec
from planner.specs.plan import Plan


@dataclass(frozen=True, slots=True, kw_only=True)
class Factors:
    """The factor set one plan is costed with (planner.cost.factors.cluster_factors)."""

    compute_scale: float = 1.0
    """Multiplier on GEMM time (1.0: the profile's gemm_efficiency curve holds as measured)."""
    attention_scale: float = 1.0
    """Multiplier on the attention-core batched GEMMs (QK^T, AV) relative to the GEMM curve."""
    elementwise_scale: float = 1.0
    """Multiplier on memory-bound (non-GEMM) time: norms, activations, softmax, dropout, adds."""
    comm_efficiency: float = 1.0
    """Fraction of the link's bus bandwidth the runtime's collectives reach."""
    network_efficiency: float = 1.0
    """Fraction of the network (inter-node) link class's measured efficiency that the runtime's
    collectives and sends reach where the network is their bottleneck (planner.cost.comm.Route)."""
    latency_scale: float = 1.0
    """Multiplier on every collective's latency (ring steps x the link's per-step latency)."""
    zero3_fetch_overhead_s: float = 0.0
    """Host-side seconds per ZeRO-3 tensor fetch (module hooks, coordinator bookkeeping), never hidden."""
    cpu_adam_scale: float = 1.0
    """Multiplier on DeepSpeedCPUAdam time under optimizer offload (the host's Adam throughput)."""
    dp_overlap: float = 0.7
    """Fraction of the data-parallel gradient traffic hidden behind backward when overlap_comm."""
    step_overhead_s: float = 0.0
    """Fixed seconds per optimizer step (launcher, logging, data loading, host sync)."""
    microbatch_overhead_s: float = 0.0
    """Fixed seconds per micro-batch per stage (kernel launches, pipeline engine bookkeeping)."""
    optimizer_scale: float = 1.0
    """Multiplier on the memory-bound Adam step time."""
    activation_scale: float = 1.0
    """Multiplier on saved-activation bytes (a less fused runtime keeps more than Table 2)."""
    memory_overhead_gb: float = 1.0
    """Fixed per-device allowance: CUDA context, NCCL buffers (CPU: interpreter and libraries)."""
    memory_fragmentation: float = 0.1
    """Allocator fragmentation as a fraction of the dynamic memory (activations, logits, buckets)."""

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_mapping(cls, values: Mapping[str, float], base: Factors | None = None) -> Factors:
        """`base` (default: the defaults) with every factor `values` names; other keys (a
        profile's serving factors) are ignored."""
        known = {k: float(v) for k, v in values.items() if k in _NAMES}
        return dataclasses.replace(base or DEFAULT, **known)

    def replace(self, **changes: float) -> Factors:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, float]:
        return {n: getattr(self, n) for n in _NAMES}


_NAMES = frozenset(Factors.names())
DEFAULT = Factors()
DEFAULTS: Mapping[str, float] = MappingProxyType(DEFAULT.to_dict())
"""Each factor's default by name (what a fitter starts from)."""


def factor(device: DeviceProfile, name: str) -> float:
    """The device's fitted value of a factor, or its default."""
    return device.factor(name, DEFAULTS[name])


def device_factors(device: DeviceProfile) -> Factors:
    """The device's own (DeepSpeed) factors, defaults where it states none."""
    return Factors.from_mapping(device.factors)


def oversubscription(cluster: ClusterSpec) -> float:
    """A training plan's CPU oversubscription: every device of a node is one process
    (planner.specs.hardware.DeviceProfile.oversubscription)."""
    return cluster.device.oversubscription(cluster.gpus_per_node)


def concurrency(cluster: ClusterSpec, plan: Plan | None) -> float:
    """A profiled CPU's measured slow-down of a rank while another computes beside it
    (planner/specs/step.py Parallel.concurrency, of the plan's precision) for a plan of 2 or
    more processes; 1 for GPUs, one process, or no measurement (plan None: the probes' own
    one-process reference)."""
    dev = cluster.device
    if plan is None or dev.kind != "cpu" or plan.world_size < 2:
        return 1.0
    par = dev.step.parallel.get(plan.precision)
    return par.concurrency if par is not None else 1.0


def cluster_factors(cluster: ClusterSpec, runtime: str = DEFAULT_RUNTIME, plan: Plan | None = None) -> Factors:
    """The factors a plan on `runtime` is costed with (planner.cost.runtime.runtime_factors:
    DeepSpeed takes the device's, the others their own file's), with CPU oversubscription applied
    to compute and memory-bound work (times a profiled CPU's measured concurrency slow-down for
    `plan`'s precision when it runs 2 or more processes), and the cluster's --memory-headroom as
    the fixed allowance."""
    dev = cluster.device
    f = Factors.from_mapping(runtime_factors(get_runtime(runtime), dev.name, dev.factors, DEFAULTS))
    if cluster.memory_headroom is not None:
        f = f.replace(memory_overhead_gb=float(cluster.memory_headroom))  # --memory-headroom
    k = oversubscription(cluster) * concurrency(cluster, plan)
    if k != 1.0:
        f = f.replace(compute_scale=f.compute_scale * k, attention_scale=f.attention_scale * k,
                      elementwise_scale=f.elementwise_scale * k, optimizer_scale=f.optimizer_scale * k)
    return f
