"""ZeRO as DeepSpeed runs it: ZeRO-3's per-tensor gathers and per-bucket reduce-scatters,
overlapped with the compute they run next to; ZeRO++ (hpZ, qwZ, qgZ), MiCS, and offload.

ZeRO-3 (Rajbhandari et al. 2020, sec. 5.3; DeepSpeed 0.19.8 runtime/zero/
partitioned_param_coordinator.py fetch_sub_module): each module's parameters are all-gathered
just before it runs -- forward, again in backward, and for the recompute of a checkpointed
block, whose backward then gathers again only what was released in between (reuse_gathers:
stage3_max_reuse_distance) -- one collective per parameter tensor (biases and norms below
stage3_param_persistence_threshold stay gathered and are never fetched). While a module
computes, the next module's parameters are already being gathered (prefetch: DeepSpeed
always fetches at least the next tensor when stage3_prefetch_bucket_size > 0). Gradients are
reduce-scattered bucket by bucket (reduce_bucket_size elements each) on the same network
while backward computes. So per unit of the model (one block, the embedding, the output
layer) and per pass:

    comm    = gathers + (backward) its share of the reduce-scatters (+ host copies)
    hidden  = min(what can run ahead, dp_overlap x the unit's compute)
    exposed = comm - hidden  (+ zero3_fetch_overhead_s per fetched tensor, never hidden)

which is why small micro-batches expose the gathers (little compute per fetched byte: the
micro-batch-1 rows of DeepSpeed's 530B/1T runs reach ~40% of micro-batch 8,
reference/deepspeed-at-scale.md B) and large ones hide them. Every collective pays its latency
(planner.cost.comm Route: its class's base latency, and its intra-node and network steps x
the links' per-step latency x latency_scale).

ZeRO++ (Wang et al. 2023, arXiv 2306.10209, sec. 3): qwZ gathers the forward weights in int8
(1 byte per element plus a 4-byte scale per 2048-element block); hpZ keeps a secondary copy
of the weights partitioned inside the node, so backward (and recompute) gathers stay on the
node's link among hpz ranks; qgZ reduces gradients in int4 in two hops, an all-to-all inside
the node then one across nodes over 1/g of the data.
MiCS (Zhang et al. 2022, arXiv 2211.00839, sec. 3): states sharded over mics_shard ranks
(gathers and reduce-scatters inside that group), and the gradient partitions all-reduced
across the dp/mics_shard replicas once per step.
Offload (ZeRO-Offload, Ren et al. 2021, sec. 4; ZeRO-Infinity, Rajbhandari et al. 2021):
gradients cross PCIe to the host every micro-batch (behind backward like the
reduce-scatters), DeepSpeedCPUAdam updates the partition on the node's CPU (every rank of the
node shares it), and the updated 16-bit partition crosses back; NVMe adds the swap of the
optimizer states per step, pipelined with the CPU update; parameter offload copies each
fetched partition host-to-device (or reads it from NVMe) before its gather.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

from planner.cost import comm, params
from planner.cost.factors import Factors
from planner.specs.cluster import ClusterSpec
from planner.specs.mesh import Mesh
from planner.specs.model import ModelSpec
from planner.specs.plan import Plan

QWZ_BYTES = 1.0 + 4.0 / 2048
"""qwZ: int8 weights plus one fp32 scale per 2048-element quantisation block (ZeRO++ sec. 3.1)."""
QGZ_BYTES = 0.5 + 4.0 / 2048
"""qgZ: int4 gradients plus one fp32 scale per block (ZeRO++ sec. 3.3)."""


@dataclass(frozen=True, slots=True)
class Unit:
    """One part of a ZeRO-3 model that is fetched as a whole and then computed."""

    tensors: tuple[int, ...]
    """Elements of each fetched (non-persistent) tensor."""
    elements: int
    """All its elements (persistent ones too: their gradients are reduced as well)."""
    forward: float
    """Seconds of one micro-batch's forward of this unit."""
    backward: float
    recomputed: bool = False
    count: int = 1
    """How many identical units (the blocks)."""


@dataclass(frozen=True, slots=True)
class Zero3Time:
    gather: float
    """Exposed seconds per step of gathers (and parameter host copies)."""
    sync: float
    """Exposed seconds per step of gradient reduction (and gradient host copies)."""
    fetches: int
    """Fetched tensors per micro-batch (each pays zero3_fetch_overhead_s; included in gather)."""
    collectives: int
    """Collectives per micro-batch."""


def _link(cluster: ClusterSpec, plan: Plan, ranks: int, stride: int = 1) -> comm.Route:
    """The Route (planner.cost.comm) of the groups of `ranks` data-parallel ranks spaced
    `stride` DP ranks apart (stride 1: consecutive, MiCS shard groups and hpZ groups; stride
    mics_shard: MiCS's replica groups), laid out as planner.cost.comm lays out ranks (no
    pipeline under ZeRO-3: global rank = dp_index x tp + tp_index)."""
    if ranks <= 1:
        return comm.route(cluster, 1, 0, 1, 1)
    share, k, m = _strided(cluster.gpus_per_node, plan.tp, plan.dp, ranks, stride)
    return comm.route(cluster, ranks, share, k, m)


@lru_cache(maxsize=4096)
def _strided(g: int, tp: int, dp: int, ranks: int, stride: int) -> tuple[int, int, int]:
    """(node-crossing groups sharing one node's network (0: every group inside a node), most
    ranks of a group on one node, most nodes a group spans)."""
    mesh = Mesh(dp=dp, tp=tp)
    crossing: dict[int, int] = {}
    k = m = 1
    spans = []
    for block in range(dp // (ranks * stride)):
        for j in range(stride):
            for t in range(tp):
                count: dict[int, int] = {}
                for i in range(ranks):
                    node = mesh.rank(dp=block * ranks * stride + j + i * stride, tp=t) // g
                    count[node] = count.get(node, 0) + 1
                k, m = max(k, max(count.values())), max(m, len(count))
                if len(count) > 1:
                    spans.append(count)
                    for n in count:
                        crossing[n] = crossing.get(n, 0) + 1
    if not spans:
        return 0, ranks, 1
    return max(crossing.values()), k, m


def host_copy(cluster: ClusterSpec, nbytes: float) -> float:
    """Seconds of a copy between device and host over PCIe (a CPU device copies within its own
    memory, at its memory bandwidth)."""
    if cluster.device.kind == "cpu":
        return nbytes / (cluster.device.hbm_bandwidth_gbps * 1e9)
    return nbytes / (cluster.host.pcie_gbps * 1e9)


def _gather(nbytes: float, n: int, link: comm.Route, eff: float, lat_scale: float, network: float = 1.0) -> float:
    return comm.route_allgather(nbytes, n, link, eff, lat_scale, network)


def units(model: ModelSpec, plan: Plan, block_fwd: float, block_bwd: float, first: tuple[float, float],
          last: tuple[float, float], recomputed_blocks: int, threshold: int) -> tuple[Unit, ...]:
    """The fetched units of a ZeRO-3 model (no pipeline): the embedding, the blocks (the
    checkpointed ones separately) and the final norm + output layer."""
    t = plan.tp
    out = []
    for part, (fw, bw) in ((params.first_stage_tensors(model, t), first),):
        out.append(Unit(tensors=tuple(n for n in part.numels if n > threshold), elements=part.total,
                        forward=fw, backward=bw))
    blk = params.block_tensors(model, t)
    big = tuple(n for n in blk.numels if n > threshold)
    plain = model.layers - recomputed_blocks
    if plain:
        out.append(Unit(tensors=big, elements=blk.total, forward=block_fwd, backward=block_bwd, count=plain))
    if recomputed_blocks:
        out.append(Unit(tensors=big, elements=blk.total, forward=block_fwd, backward=block_bwd, recomputed=True,
                        count=recomputed_blocks))
    part = params.last_stage_tensors(model, t, 1)
    out.append(Unit(tensors=tuple(n for n in part.numels if n > threshold), elements=part.total,
                    forward=last[0], backward=last[1]))
    return tuple(out)


def flat_units(us: tuple[Unit, ...]) -> tuple[Unit, ...]:
    """The units as a runtime with flat parameters gathers them (FSDP's FlatParameter, one per
    wrapped block: torch.distributed.fsdp FlatParamHandle; Megatron-FSDP's contiguous buffers):
    one all-gather of all the unit's elements, persistent ones included, instead of one per tensor."""
    return tuple(dataclasses.replace(u, tensors=(u.elements,)) for u in us)


def reuse_gathers(tensors: tuple[int, ...], reuse_distance: int) -> tuple[int, ...]:
    """The tensors of a recomputed unit that backward must gather again. DeepSpeed keeps a
    gathered parameter whose next use is at most stage3_max_reuse_distance parameter elements
    away (partitioned_param_coordinator.py release_sub_module: the trace's reuse distance).
    Recomputing runs the unit's tensors t_1..t_k forward, then backward runs t_k..t_1, so
    between t_i's two uses the tensors after it are used twice: its distance is
    2 x (t_(i+1) + ... + t_k). The last tensor is always reused."""
    out = []
    after = 0
    for n in reversed(tensors):
        if 2 * after > reuse_distance:
            out.append(n)
        after += n
    return tuple(reversed(out))


def zero3_time(cluster: ClusterSpec, plan: Plan, us: tuple[Unit, ...], f: Factors, e: float) -> Zero3Time:
    """Exposed gather and gradient-reduction seconds per step of a ZeRO-3 plan (module docstring)."""
    eff, ls, hide, net = f.comm_efficiency, f.latency_scale, f.dp_overlap, f.network_efficiency
    overhead = f.zero3_fetch_overhead_s
    shard = plan.zero_shard
    g_node = max(1, cluster.gpus_per_node // plan.tp)
    main = _link(cluster, plan, shard)
    back_n, back_link = (plan.hpz, _link(cluster, plan, plan.hpz)) if plan.hpz > 1 else (shard, main)
    fwd_bytes = QWZ_BYTES if plan.quantized_weights else e

    def param_fetch(numel: int) -> float:
        """Bringing one offloaded weight partition to the device before its gather."""
        part = numel * e / shard
        if plan.offload_params == "cpu":
            return host_copy(cluster, part)
        if plan.offload_params == "nvme":
            return host_copy(cluster, part) + part * g_node / (cluster.host.nvme_gbps * 1e9)
        return 0.0

    psi = sum(u.elements * u.count for u in us)
    # gradient reduction of one micro-batch, over the whole model, bucket by bucket
    buckets = max(1, math.ceil(psi / plan.bucket_elements))
    if plan.quantized_gradients and cluster.nodes > 1 and shard > g_node:
        nodes = math.ceil(shard / g_node)
        # one hop inside the node, one across nodes (each rank's 1/g slice over its own share)
        intra = comm.route(cluster, g_node, 0, g_node, 1)
        inter = comm.Route(busbw=cluster.inter_node.busbw_gbps * 1e9, efficiency=comm.class_efficiency(
            cluster.inter_node), per_node=1, nodes=nodes, intra_step=0.0,
            inter_step=cluster.inter_node.latency_us * 1e-6, base=comm.class_base(cluster.inter_node), network=True)
        reduce = buckets * (_gather(psi / buckets * QGZ_BYTES, g_node, intra, eff, ls)
                            + _gather(psi / buckets / g_node * QGZ_BYTES, nodes, inter, eff, ls, net))
        rs_count = 2 * buckets
    else:
        reduce = buckets * _gather(psi / buckets * (QGZ_BYTES if plan.quantized_gradients else e), shard, main,
                                   eff, ls, net)
        rs_count = buckets
    if plan.offload_optimizer != "none":
        reduce += host_copy(cluster, psi * e / shard)  # the reduced partition goes to the host every micro-batch
    reduce_per_element = reduce / psi

    gather = sync = 0.0
    fetches = 0
    collectives = rs_count
    for u in us:
        g_f = sum(_gather(n * fwd_bytes, shard, main, eff, ls, net) + param_fetch(n) for n in u.tensors)
        g_b = sum(_gather(n * e, back_n, back_link, eff, ls, net) + param_fetch(n) for n in u.tensors)
        # a recomputed unit gathers for the recompute; its backward then gathers again only the
        # tensors released in between (reuse_gathers)
        regather = reuse_gathers(u.tensors, plan.live) if u.recomputed else ()
        g_back = g_b + sum(_gather(n * e, back_n, back_link, eff, ls, net) + param_fetch(n) for n in regather)
        passes = 2 * len(u.tensors) + len(regather)
        fetch = passes * overhead
        fetches += passes * u.count
        collectives += passes * u.count
        # forward: the next unit's gathers run behind this one's compute
        exp_f = g_f - min(g_f, hide * u.forward)
        # backward (with the recompute's forward and its gathers): gathers and this unit's
        # share of the reduce-scatters share the network
        r = u.elements * reduce_per_element
        work = u.backward + (u.forward if u.recomputed else 0.0)
        can_hide = g_back + (r if plan.overlap_comm else 0.0)
        hidden = min(can_hide, hide * work)
        exp_b = g_back + r - hidden
        share_g = g_back / (g_back + r) if g_back + r > 0 else 0.0
        gather += u.count * (exp_f + exp_b * share_g + fetch)
        sync += u.count * exp_b * (1.0 - share_g)
    m = plan.grad_accum
    gather, sync = m * gather, m * sync
    if plan.mics_shard and plan.dp > plan.mics_shard:
        # MiCS: the gradient partitions all-reduced across the replicas once per step
        reps = plan.dp // plan.mics_shard
        sync += comm.route_allreduce(psi * e / shard, reps, _link(cluster, plan, reps, stride=plan.mics_shard), eff, ls,
                                     net)
        collectives += 0  # per step, not per micro-batch
    return Zero3Time(gather=gather, sync=sync, fetches=fetches, collectives=collectives)


def offload_step_time(cluster: ClusterSpec, plan: Plan, psi: float, e: float, f: Factors) -> float:
    """Seconds of an optimizer step whose states are offloaded: DeepSpeedCPUAdam over this
    rank's partition (the node's ranks share its CPU), pipelined with the NVMe swap of the
    states (read and write fp32 master and moments, read the fp32 gradient: 28 bytes per
    element, every rank of the node through the node's NVMe), then the updated 16-bit
    partition back to the device over PCIe (ZeRO-1/2: the all-gather after the step is the
    engine's collective, counted with the data-parallel sync)."""
    part = psi / plan.zero_shard
    g_node = max(1, cluster.gpus_per_node // plan.tp)
    host = cluster.host
    if cluster.device.kind == "cpu":
        # no PCIe: Adam on the same cores, memory-bound like the device's own step
        return part * 28.0 / (cluster.device.hbm_bandwidth_gbps * 1e9) * f.optimizer_scale
    adam = part * g_node / (host.cpu_adam_gparams * 1e9) * f.cpu_adam_scale
    if plan.offload_optimizer == "nvme":
        adam = max(adam, part * 28.0 * g_node / (host.nvme_gbps * 1e9))
    return adam + part * e / (host.pcie_gbps * 1e9)
