"""Collective and point-to-point times, and the links the plan's rank layout puts them on.

nccl-tests (PERFORMANCE.md): all-reduce busbw = algbw x 2(n-1)/n; reduce-scatter and all-gather
busbw = algbw x (n-1)/n; send/recv busbw = algbw. So with a link's busbw B, an all-reduce of
S bytes over n ranks takes S x 2(n-1)/n / B, plus a latency of alpha per ring step.

Rank layout (planner/specs/mesh.py, DeepSpeed's PipeModelDataParallelTopology): global rank
= (pp_i * dp + dp_i) * tp + tp_i, and node = rank // gpus_per_node. Which groups and which
pipeline boundaries cross nodes follows from that alone: nothing here assumes the layout is
aligned to nodes.
"""
from __future__ import annotations

import math
from functools import lru_cache

from planner.specs.hardware import ClusterSpec
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


def p2p_time(nbytes: float, cluster: ClusterSpec, cross_node: bool, efficiency: float) -> float:
    """One send/recv of `nbytes` between pipeline stages. Inside a node it rides the
    intra-node link; across nodes each device gets its share of the node's network
    (inter-node bus bandwidth / devices per node: every rank of a stage sends at once)."""
    if cross_node:
        link = cluster.inter_node
        bw = link.busbw_gbps * 1e9 / cluster.gpus_per_node
    else:
        link = cluster.intra_node
        bw = link.busbw_gbps * 1e9
    return nbytes / (bw * efficiency) + link.latency_us * 1e-6
