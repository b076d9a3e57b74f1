"""Long context: a sequence split over cp ranks (DeepSpeed-Ulysses or ring attention).

Both keep 1/cp of every sequence's tokens on a rank outside the attention core, so every
token-wise cost (GEMMs, element-wise ops, activations, logits, pipeline messages) is the
block's cost at the local sequence s/cp, and the cp ranks hold the same parameters: gradients
are reduced and ZeRO partitions over dp x cp ranks (DeepSpeed-Ulysses' sequence-data-parallel
group, Jacobs et al. 2023, arXiv 2309.14509, sec. 3.3; Megatron-Core's dp-cp group). `local`
turns a plan into that equivalent one, exactly: the rank layout (pp, dp, cp, tp) read with
dp' = dp x cp is the same ranks in the same order (planner/specs/plan.py).

What differs is the attention core and its communication:
- core: each rank computes 1/cp of the full s x s work (Ulysses: all s queries of heads/cp;
  ring: s/cp queries against all s keys), cp times what a block at s/cp computes
  (core_factor). Costed from the flash kernel's throughput (planner.cost.compute.core_time).
- Ulysses (Jacobs et al. 2023, sec. 3.1; DeepSpeed sequence/layer.py DistributedAttention):
  forward all-to-alls of q, k and v (heads scattered, sequence gathered) and one of the output
  back, each message the rank's b (s/cp) width/tp elements; backward the same four
  (_SeqAllToAll.backward): 4 per pass, exposed (no overlap with compute).
- ring (Liu et al. 2023, "Ring Attention", arXiv 2310.01889; Megatron-Core context
  parallelism via Transformer Engine): cp - 1 steps each sending the rank's KV chunk
  b (s/cp) 2 kv/tp to the next rank, overlapped with the attention of the chunk in hand:
  only what exceeds the core's compute is exposed; backward sends KV and dKV (2x).
"""
from __future__ import annotations

import dataclasses

from planner.cost import comm
from planner.specs.cluster import ClusterSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import Plan
from planner.specs.train import TrainSpec


def local(plan: Plan, train: TrainSpec) -> tuple[Plan, TrainSpec]:
    """The equivalent plan and training setup of one rank without context parallelism: dp x cp
    data-parallel ranks, each with sequences of s/cp tokens, cp times as many of them per step
    (the same tokens per step)."""
    c = plan.cp
    if c == 1:
        return plan, train
    return (dataclasses.replace(plan, dp=plan.dp * c, cp=1),
            dataclasses.replace(train, seq_len=train.seq_len // c, global_batch=train.global_batch * c))


def core_factor(cp: int) -> float:
    """A rank's attention-core work over that of a block at s/cp: (s^2/cp) / (s/cp)^2 = cp."""
    return float(cp)


def axis_link(cluster: ClusterSpec, tp: int, cp: int) -> tuple[float, float, bool]:
    """(bus bandwidth, latency, crosses nodes) of a group of cp ranks at stride tp, consecutive
    in the layout (a cp group; an ep group of the cp-free plan); inside a node when tp x cp divides one (the node-aligned layout), else it
    rides the node's network, shared by the tp crossing groups with members on each node
    (planner.cost.comm.group_links' convention: s groups sharing a node's network get 1/s each)."""
    g = cluster.gpus_per_node
    intra, inter = cluster.intra_node, cluster.inter_node
    if g % (tp * cp) == 0:
        return intra.busbw_gbps * 1e9, intra.latency_us * 1e-6, False
    return min(intra.busbw_gbps, inter.busbw_gbps / tp) * 1e9, inter.latency_us * 1e-6, True


def alltoall_time(nbytes: float, n: int, busbw: float, latency: float, efficiency: float) -> float:
    """All-to-all where each rank holds `nbytes` and keeps 1/n of it: (n-1)/n of it crosses
    the link (nccl-tests alltoall busbw = algbw x (n-1)/n), n - 1 latency steps."""
    if n <= 1:
        return 0.0
    return nbytes * (n - 1) / n / (busbw * efficiency) + (n - 1) * latency


def ulysses_comm(model: ModelSpec, s_local: int, b: int, t: int, e: float, cp: int,
                 link: tuple[float, float], eff: float) -> tuple[float, float]:
    """(forward, backward) seconds of one block's Ulysses all-to-alls: q, k, v and the output,
    each b s/cp (width / tp) e bytes per rank."""
    bw, lat = link
    tokens = b * s_local * e / t
    one = sum(alltoall_time(tokens * w, cp, bw, lat, eff) for w in (model.q_size, model.kv_size, model.kv_size,
                                                                     model.q_size))
    return one, one


def ring_comm(model: ModelSpec, s_local: int, b: int, t: int, e: float, cp: int, link: tuple[float, float],
              eff: float, core_fwd: float, core_bwd: float) -> tuple[float, float]:
    """(forward, backward) exposed seconds of one block's ring: cp - 1 sends of the KV chunk
    (b s/cp 2 kv/tp e bytes) forward, of KV and dKV backward, each hidden behind the attention
    of the chunk in hand (core time / cp per step)."""
    if cp <= 1:
        return 0.0, 0.0
    bw, lat = link
    kv = b * s_local * 2 * model.kv_size / t * e
    step = kv / (bw * eff) + lat
    fwd = (cp - 1) * max(0.0, step - core_fwd / cp)
    bwd = (cp - 1) * max(0.0, 2 * step - lat - core_bwd / cp)
    return fwd, bwd


def block_comm(model: ModelSpec, cluster: ClusterSpec, tp: int, b: int, cp: int, kind: str, s_local: int, e: float,
               eff: float, core_fwd: float, core_bwd: float) -> tuple[float, float]:
    """(forward, backward) exposed context-parallel seconds of one block (0 without cp)."""
    if cp == 1:
        return 0.0, 0.0
    bw, lat, _ = axis_link(cluster, tp, cp)
    if kind == "ulysses":
        return ulysses_comm(model, s_local, b, tp, e, cp, (bw, lat), eff)
    return ring_comm(model, s_local, b, tp, e, cp, (bw, lat), eff, core_fwd, core_bwd)
