"""Collective times: alpha-beta per link tier with nccl-tests bus-bandwidth conventions.

nccl-tests (PERFORMANCE.md): all-reduce busbw = algbw x 2(n-1)/n; reduce-scatter and all-gather
busbw = algbw x (n-1)/n; send/recv busbw = algbw. So with a link's busbw B, an all-reduce of
S bytes over n ranks takes S x 2(n-1)/n / B, plus a latency of alpha per ring step.
"""
from __future__ import annotations

from planner.specs.hardware import ClusterSpec, Link


def group_link(cluster: ClusterSpec, size: int, stride: int) -> tuple[float, float]:
    """(bus bandwidth bytes/s, latency s) for a group of `size` ranks spaced `stride` apart.

    Rank layout (planner/specs/plan.py): tp fastest, then dp, then pp. A group whose ranks all
    sit in one node rides the intra-node link. A group spanning nodes is limited by the node's
    network shared by the groups running at the same time: with k members per node out of g
    devices, this group gets k/g of the node's inter-node bus bandwidth.
    """
    g = cluster.gpus_per_node
    if size <= 1:
        return float("inf"), 0.0
    intra = cluster.intra_node
    if stride * (size - 1) < g or cluster.nodes == 1:  # the group starting at rank 0 fits one node
        return intra.busbw_gbps * 1e9, intra.latency_us * 1e-6
    members_per_node = 1 if stride >= g else min(size, g // stride)
    inter = cluster.inter_node
    bw = min(intra.busbw_gbps, inter.busbw_gbps * members_per_node / g) * 1e9
    return bw, inter.latency_us * 1e-6


def allreduce_time(nbytes: float, n: int, busbw: float, latency: float, efficiency: float = 1.0) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    return nbytes * 2.0 * (n - 1) / n / (busbw * efficiency) + 2.0 * (n - 1) * latency


def allgather_time(nbytes: float, n: int, busbw: float, latency: float, efficiency: float = 1.0) -> float:
    """All-gather (or reduce-scatter) whose full (gathered) buffer is `nbytes`."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return nbytes * (n - 1) / n / (busbw * efficiency) + (n - 1) * latency


reducescatter_time = allgather_time


def p2p_time(nbytes: float, link: Link, concurrent_per_node: int, gpus_per_node: int, inter: bool,
             efficiency: float = 1.0) -> float:
    """One send/recv of `nbytes`. Across nodes, each device gets its share of the node's network."""
    if nbytes <= 0:
        return 0.0
    bw = link.busbw_gbps * 1e9 * efficiency
    if inter:
        bw = bw * max(1, concurrent_per_node) / gpus_per_node
    return nbytes / bw + link.latency_us * 1e-6
