"""Collective and point-to-point times, and the links the plan's rank layout puts them on.

nccl-tests (PERFORMANCE.md): all-reduce busbw = algbw x 2(n-1)/n; reduce-scatter and all-gather
busbw = algbw x (n-1)/n; send/recv busbw = algbw. So with a link's busbw B, an all-reduce of
S bytes over n ranks takes S x 2(n-1)/n / B, plus a latency of alpha per ring step.

Rank layout (planner/specs/mesh.py, DeepSpeed's PipeModelDataParallelTopology): global rank
= (pp_i * dp + dp_i) * tp + tp_i, and node = rank // gpus_per_node. Which groups and which
pipeline boundaries cross nodes follows from that alone: nothing here assumes the layout is
aligned to nodes.

Link classes (profiles/links/classes.json, measured by benchmarks/link_curves.py where data exists):
a collective on a class pays its fixed base latency once and reaches the class's efficiency of
the stated bus bandwidth. A group that spans nodes runs hierarchically (Route): its k ranks
per node step over the intra-node link and its m nodes over the network, so an all-reduce pays
2(k-1) intra-node steps and 2(m-1) network steps on NCCL's ring, or 2(k-1) intra-node and
2 ceil(log2 m) network steps on its double binary tree (which moves 2 S per rank instead of the
ring's 2 S (n-1)/n); the cheaper of the two for the message size is taken, so small messages
go by tree and large ones by ring, as NCCL's tuner picks them.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache

from planner.specs.hardware import PROFILES_DIR, Link
from planner.specs.cluster import ClusterSpec
from planner.specs.mesh import Mesh
from planner.specs.plan import Plan


@lru_cache(maxsize=4096)
def group_sharing(gpus_per_node: int, dp: int, tp: int, pp: int, axis: str) -> tuple[int, ...]:
    """Per pipeline stage: 0 when every group of `axis` in that stage sits inside one node;
    else the largest number of node-crossing groups (of every stage, all syncing together)
    that share one node's network with a crossing group of this stage."""
    assert axis in ("dp", "tp"), axis
    g = gpus_per_node
    groups = Mesh(pp=pp, dp=dp, tp=tp).groups(axis)
    crossing: dict[int, int] = {}
    spans = []
    for ranks in groups:
        nodes = {r // g for r in ranks}
        spans.append(nodes if len(nodes) > 1 else set())
        for n in spans[-1]:
            crossing[n] = crossing.get(n, 0) + 1
    per_group = len(groups) // pp
    out = []
    for i in range(pp):
        share = 0
        for nodes in spans[i * per_group:(i + 1) * per_group]:
            for n in nodes:
                share = max(share, crossing[n])
        out.append(share)
    return tuple(out)


LINKS_FILE = PROFILES_DIR / "links" / "classes.json"


@lru_cache(maxsize=1)
def link_classes() -> dict[str, dict]:
    """profiles/links/classes.json's classes: {name: {match, base_us, efficiency}}."""
    return json.loads(LINKS_FILE.read_text())["classes"]


@lru_cache(maxsize=256)
def _class_of(name: str) -> str:
    low = f" {name.lower()}"
    for cls, c in link_classes().items():
        if any(m in low for m in c["match"]):
            return cls
    return ""


def link_class(link: Link) -> str:
    """The class of a link by its name ("" when none matches: no base latency, efficiency 1)."""
    return _class_of(link.name)


def class_base(link: Link) -> float:
    """Seconds every collective (or send) on this link pays once, whatever the group."""
    c = link_classes().get(link_class(link))
    return c["base_us"] * 1e-6 if c else 0.0


def class_efficiency(link: Link) -> float:
    """Fraction of the link's stated bus bandwidth its class reaches (measured where known)."""
    c = link_classes().get(link_class(link))
    return c["efficiency"] if c else 1.0


@dataclass(frozen=True, slots=True)
class Route:
    """How one group's collectives travel: `busbw` the bottleneck bus bandwidth (B/s, the
    node's network share when the group spans nodes) at `efficiency` of it; `per_node` ranks
    of the group on the busiest node stepping over the intra-node link (`intra_step` s per
    step) and `nodes` nodes stepping over the network (`inter_step` s); `base` s paid once."""

    busbw: float
    efficiency: float
    per_node: int
    nodes: int
    intra_step: float
    inter_step: float
    base: float
    network: bool = False
    """The bottleneck is the inter-node network (its bandwidth takes the runtime's network_efficiency)."""


def _bw(r: Route, efficiency: float, network: float) -> float:
    return r.busbw * r.efficiency * efficiency * (network if r.network else 1.0)


def route_allreduce(nbytes: float, n: int, r: Route, efficiency: float, latency_scale: float = 1.0,
                    network: float = 1.0) -> float:
    """All-reduce of `nbytes` over the n ranks of route `r`: the cheaper of NCCL's ring and tree
    (module docstring); 0 for one rank. `efficiency`: the runtime's comm_efficiency; `network`:
    its network_efficiency, where the network is the bottleneck."""
    if n <= 1:
        return 0.0
    bw = _bw(r, efficiency, network)
    intra = 2 * (r.per_node - 1) * r.intra_step
    ring = nbytes * 2.0 * (n - 1) / n / bw + r.base + latency_scale * (intra + 2 * (r.nodes - 1) * r.inter_step)
    if r.nodes <= 1:
        return ring
    tree = nbytes * 2.0 / bw + r.base + latency_scale * (intra + 2 * math.ceil(math.log2(r.nodes)) * r.inter_step)
    return min(ring, tree)


def route_allgather(nbytes: float, n: int, r: Route, efficiency: float, latency_scale: float = 1.0,
                    network: float = 1.0) -> float:
    """All-gather (or reduce-scatter) whose full buffer is `nbytes` over route `r`: NCCL's ring,
    k-1 intra-node steps and m-1 network steps; 0 for one rank."""
    if n <= 1:
        return 0.0
    bw = _bw(r, efficiency, network)
    return nbytes * (n - 1) / n / bw + r.base + latency_scale * ((r.per_node - 1) * r.intra_step
                                                                 + (r.nodes - 1) * r.inter_step)


ROUTE_COLLECTIVES = {"all_reduce": route_allreduce, "all_gather": route_allgather, "reduce_scatter": route_allgather}


def route(cluster: ClusterSpec, ranks: int, share: int, per_node: int, nodes: int) -> Route:
    """The Route of a group of `ranks` with at most `per_node` of them on one of its `nodes`
    nodes; `share`: node-crossing groups sharing one node's network (0: inside one node)."""
    intra, inter = cluster.intra_node, cluster.inter_node
    if share == 0 or nodes <= 1:
        return Route(busbw=intra.busbw_gbps * 1e9, efficiency=class_efficiency(intra), per_node=ranks, nodes=1,
                     intra_step=intra.latency_us * 1e-6, inter_step=0.0, base=class_base(intra))
    net = inter.busbw_gbps / share
    bottleneck = inter if net < intra.busbw_gbps else intra
    return Route(busbw=min(intra.busbw_gbps, net) * 1e9, efficiency=class_efficiency(bottleneck),
                 per_node=per_node, nodes=nodes, intra_step=intra.latency_us * 1e-6,
                 inter_step=inter.latency_us * 1e-6, base=max(class_base(intra), class_base(inter)),
                 network=bottleneck is inter)


@lru_cache(maxsize=4096)
def group_shape(gpus_per_node: int, dp: int, tp: int, pp: int, axis: str) -> tuple[tuple[int, int], ...]:
    """Per pipeline stage: (most ranks of one `axis` group on one node, most nodes one group spans)."""
    g = gpus_per_node
    groups = Mesh(pp=pp, dp=dp, tp=tp).groups(axis)
    per_group = len(groups) // pp
    out = []
    for i in range(pp):
        k = m = 1
        for ranks in groups[i * per_group:(i + 1) * per_group]:
            count: dict[int, int] = {}
            for r in ranks:
                count[r // g] = count.get(r // g, 0) + 1
            k, m = max(k, max(count.values())), max(m, len(count))
        out.append((k, m))
    return tuple(out)


def group_routes(cluster: ClusterSpec, plan: Plan, axis: str) -> tuple[Route, ...]:
    """The Route of the `axis` groups of each pipeline stage (group_links' bandwidth, with the
    groups' hierarchy and their links' classes)."""
    share = group_sharing(cluster.gpus_per_node, plan.dp, plan.tp, plan.pp, axis)
    shape = group_shape(cluster.gpus_per_node, plan.dp, plan.tp, plan.pp, axis)
    n = plan.dp if axis == "dp" else plan.tp
    return tuple(route(cluster, n, s, k, m) for s, (k, m) in zip(share, shape))


def group_links(cluster: ClusterSpec, plan: Plan, axis: str) -> tuple[tuple[float, float], ...]:
    """(bus bandwidth bytes/s, latency s) of the `axis` groups of each pipeline stage.

    A group inside one node rides the intra-node link. A group that spans nodes is limited
    by the node's inter-node network, shared by all the node-crossing groups of that axis
    with members on the same node (for node-aligned layouts: k members of the group per node
    out of g devices gives it k/g of the node's bus bandwidth)."""
    intra, inter = cluster.intra_node, cluster.inter_node
    share = group_sharing(cluster.gpus_per_node, plan.dp, plan.tp, plan.pp, axis)
    out = []
    for s in share:
        if s == 0:
            out.append((intra.busbw_gbps * 1e9, intra.latency_us * 1e-6))
        else:
            out.append((min(intra.busbw_gbps, inter.busbw_gbps / s) * 1e9, inter.latency_us * 1e-6))
    return tuple(out)


@lru_cache(maxsize=4096)
def cross_node_boundaries(gpus_per_node: int, dp: int, tp: int, pp: int) -> tuple[bool, ...]:
    """For each pipeline boundary i -> i+1: does any rank of stage i send to another node? A rank
    sends to the rank of the next stage in its pipeline group."""
    g = gpus_per_node
    chains = Mesh(pp=pp, dp=dp, tp=tp).groups("pp")
    return tuple(any(c[i] // g != c[i + 1] // g for c in chains) for i in range(pp - 1))


def allreduce_steps(n: int) -> int:
    """Latency steps of an all-reduce over n ranks: NCCL's tuner takes the cheaper of the ring
    (2(n-1) steps: reduce-scatter then all-gather round the ring) and the double binary tree
    (2 ceil(log2 n): up the tree and down again; Sanders et al. 2009; NCCL 2.4 "Massively
    scale your deep learning training with NCCL 2.4"). The tree's count is never above the
    ring's (equal for n = 2, 3), so large groups pay a logarithmic latency. All-gather and
    reduce-scatter have only the ring in NCCL: n - 1 steps."""
    return 2 * math.ceil(math.log2(n)) if n > 1 else 0


def allreduce_time(nbytes: float, n: int, busbw: float, latency: float, efficiency: float) -> float:
    """All-reduce of `nbytes` over n ranks at the ring's bus bandwidth, with the latency of the
    cheaper algorithm (allreduce_steps); 0 for one rank: nothing is sent."""
    return nbytes * 2.0 * (n - 1) / n / (busbw * efficiency) + allreduce_steps(n) * latency


def allgather_time(nbytes: float, n: int, busbw: float, latency: float, efficiency: float) -> float:
    """All-gather (or reduce-scatter) whose full (gathered) buffer is `nbytes` (0 for one rank)."""
    return nbytes * (n - 1) / n / (busbw * efficiency) + (n - 1) * latency


reducescatter_time = allgather_time

COLLECTIVES = {"all_reduce": allreduce_time, "all_gather": allgather_time, "reduce_scatter": reducescatter_time}


def p2p_time(nbytes: float, cluster: ClusterSpec, cross_node: bool, efficiency: float, network: float = 1.0) -> float:
    """One send/recv of `nbytes` between pipeline stages. Inside a node it rides the
    intra-node link; across nodes each device gets its share of the node's network
    (inter-node bus bandwidth / devices per node: every rank of a stage sends at once), at its
    class's efficiency; one send pays the class's base latency and one step."""
    if cross_node:
        link = cluster.inter_node
        bw = link.busbw_gbps * 1e9 / cluster.gpus_per_node * network
    else:
        link = cluster.intra_node
        bw = link.busbw_gbps * 1e9
    return nbytes / (bw * class_efficiency(link) * efficiency) + class_base(link) + link.latency_us * 1e-6
