"""Named runtime factors: how the runtime we emit for (DeepSpeed) departs from the ideal.

They live in each profile's "factors" map (per device and runtime), are fitted from measured
runs by `planner calibrate`, and default to the values below. None is a silent fudge: each
has one meaning, and a built-in profile states where its value came from in "sources".
"""
from __future__ import annotations

from planner.cost.runtime import DEFAULT as DEFAULT_RUNTIME, get_runtime, runtime_factors
from planner.specs.hardware import ClusterSpec, DeviceProfile

DEFAULTS: dict[str, float] = {
    "compute_scale": 1.0,
    # multiplier on GEMM time (1.0: the profile's gemm_efficiency curve holds as measured)
    "attention_scale": 1.0,
    # multiplier on the attention-core batched GEMMs (QK^T, AV) relative to the GEMM curve
    "elementwise_scale": 1.0,
    # multiplier on memory-bound (non-GEMM) time: norms, activations, softmax, dropout, adds
    "comm_efficiency": 1.0,
    # fraction of the link's bus bandwidth the runtime's collectives reach
    "latency_scale": 1.0,
    # multiplier on every collective's latency (ring steps x the link's per-step latency)
    "zero3_fetch_overhead_s": 0.0,
    # host-side seconds per ZeRO-3 tensor fetch (module hooks, coordinator bookkeeping), never hidden
    "cpu_adam_scale": 1.0,
    # multiplier on DeepSpeedCPUAdam time under optimizer offload (the host's Adam throughput)
    "dp_overlap": 0.7,
    # fraction of the data-parallel gradient traffic hidden behind backward when overlap_comm
    "step_overhead_s": 0.0,
    # fixed seconds per optimizer step (launcher, logging, data loading, host sync)
    "microbatch_overhead_s": 0.0,
    # fixed seconds per micro-batch per stage (kernel launches, pipeline engine bookkeeping)
    "optimizer_scale": 1.0,
    # multiplier on the memory-bound Adam step time
    "activation_scale": 1.0,
    # multiplier on saved-activation bytes (a less fused runtime keeps more than Table 2)
    "memory_overhead_gb": 1.0,
    # fixed per-device allowance: CUDA context, NCCL buffers (CPU: interpreter and libraries)
    "memory_fragmentation": 0.1,
    # allocator fragmentation as a fraction of the dynamic memory (activations, logits, buckets)
}


def factor(device: DeviceProfile, name: str) -> float:
    """The device's fitted value of a factor, or its default."""
    return device.factor(name, DEFAULTS[name])


def all_factors(device: DeviceProfile) -> dict[str, float]:
    return {k: factor(device, k) for k in DEFAULTS}


def oversubscription(cluster: ClusterSpec) -> float:
    """A training plan's CPU oversubscription: every device of a node is one process
    (planner.specs.hardware.DeviceProfile.oversubscription)."""
    return cluster.device.oversubscription(cluster.gpus_per_node)


def cluster_factors(cluster: ClusterSpec, runtime: str = DEFAULT_RUNTIME) -> dict[str, float]:
    """The factors a plan on `runtime` is costed with (planner.cost.runtime.runtime_factors:
    DeepSpeed takes the device's, the others their own file's), with CPU oversubscription applied
    to compute and memory-bound work, and the cluster's --memory-headroom as the fixed allowance."""
    dev = cluster.device
    f = runtime_factors(get_runtime(runtime), dev.name, dev.factors, DEFAULTS)
    if cluster.memory_headroom is not None:
        f["memory_overhead_gb"] = float(cluster.memory_headroom)  # --memory-headroom
    k = oversubscription(cluster)
    if k != 1.0:
        for name in ("compute_scale", "attention_scale", "elementwise_scale", "optimizer_scale"):
            f[name] *= k
    return f
