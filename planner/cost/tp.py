"""The tensor-parallel collectives the cost model charges (docs/runtime.md): one block's
(Megatron-LM: Shoeybi et al. 2019 sec. 3; sequence parallelism: Korthikanti et al. 2022
sec. 4.2.2), the first and last stages' outside the blocks, Megatron-Core's TP communication
overlap, and the TP group's link.

Pure Python (no torch, deepspeed or optuna).
"""
from __future__ import annotations

from planner.cost import comm
from planner.specs.cluster import ClusterSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import Plan


CE_ALLREDUCES = 3
"""Small fp32 all-reduces of b x s values in the vocab-parallel cross-entropy (max logit, sum
of exponentials, target logit: Megatron-LM _VocabParallelCrossEntropy, the executor's
planner/model/parallel/tensor.py)."""


def tp_link(cluster: ClusterSpec, plan: Plan) -> tuple[float, float]:
    """(bus bandwidth bytes/s, latency s) of the TP group (it divides the node: the same in every
    stage). A profiled CPU's all-reduce measured inside autograd (planner/specs/step.py
    tp_allreduce) replaces the link's back-to-back figure when the group sits in one node. It is
    not stretched by the oversubscription as compute is: a rank waiting for its peer leaves its
    core to the others (measured on 2 cores: tiny TP2xDP2 ZeRO-1 on 4 processes and TP2xPP2xDP2 on
    8, before calibration +25% and +60% with the stretch, -8% and +0% without; docs/lab.md)."""
    link = comm.group_links(cluster, plan, "tp")[0]
    probe = cluster.device.step.tp_link(plan.tp) if plan.tp > 1 else None
    if probe is None or plan.tp > cluster.gpus_per_node:
        return link
    return probe.busbw_gbps * 1e9, probe.latency_us * 1e-6


def overlapped_tp(tp_fwd: float, tp_bwd: float, gemm_fwd: float, gemm_bwd: float | None = None) -> tuple[float, float]:
    """Megatron-Core's TP communication overlap (--tp-comm-overlap, Transformer Engine
    userbuffers; profiles/runtimes/megatron-core.json): each sequence-parallel all-gather /
    reduce-scatter is split into chunks pipelined with the GEMM that consumes or produces it,
    so a block exposes only the communication its GEMMs cannot cover: forward against the
    forward GEMMs, backward against the backward GEMMs (input and weight gradients; 2x forward
    when not given)."""
    return max(tp_fwd - gemm_fwd, 0.0), max(tp_bwd - (2.0 * gemm_fwd if gemm_bwd is None else gemm_bwd), 0.0)


def replicated_grad_allreduces(model: ModelSpec) -> int:
    """Under sequence parallelism, the replicated parameters of one block used on sequence
    shards (norm weights and biases, row-parallel biases) each get an all-reduce of their h
    elements over TP in backward, once per micro-batch (docs/runtime.md "With sequence
    parallelism"; planner/model/parallel/tensor.py `replicated`): 2 (RMSNorm) or 4
    (LayerNorm) + 2 (attention-output and FFN-output biases, if any)."""
    per_norm = 2 if model.norm == "layernorm" else 1
    return 2 * per_norm + (2 if model.linear_bias else 0)


def tp_block_comm(model: ModelSpec, s: int, b: int, t: int, e: float, sp: bool, link: tuple[float, float],
                  eff: float) -> tuple[float, float]:
    """(forward, backward) seconds of one block's TP collectives, all exposed (docs/runtime.md,
    Megatron-LM: Shoeybi et al. 2019 sec. 3; SP: Korthikanti et al. 2022 sec. 4.2.2).

    Without SP: 2 all-reduces of b s h forward (attention and FFN outputs) and 2 backward
    (gradients of the QKV and FFN inputs). With SP: forward 2 all-gathers (QKV and FFN-in
    inputs) and 2 reduce-scatters (attention and FFN outputs); backward per column-parallel
    linear 1 all-gather (its saved sequence shard gathered again) and 1 reduce-scatter (input
    gradient), per row-parallel linear 1 all-gather: 4 all-gathers and 2 reduce-scatters of
    b s h, plus the replicated parameters' gradient all-reduces of h elements."""
    bw, lat = link
    sbh = s * b * model.hidden * e
    if not sp:
        ar = comm.allreduce_time(sbh, t, bw, lat, eff)
        return 2 * ar, 2 * ar
    ag = comm.allgather_time(sbh, t, bw, lat, eff)
    rs = comm.reducescatter_time(sbh, t, bw, lat, eff)
    params = replicated_grad_allreduces(model) * comm.allreduce_time(model.hidden * e, t, bw, lat, eff)
    return 2 * ag + 2 * rs, 4 * ag + 2 * rs + params


def tp_stage_comm(model: ModelSpec, s: int, b: int, t: int, e: float, sp: bool, link: tuple[float, float],
                  eff: float) -> tuple[float, float]:
    """(first stage, last stage) seconds of the TP collectives outside the blocks, per micro-batch
    (docs/runtime.md): the word embedding's forward all-reduce of b s h (SP: a reduce-scatter
    for rotary / ALiBi models; learned positions keep the all-reduce and split the sum
    afterwards), under SP with a backward all-gather; the output layer's backward all-reduce
    of b s h (SP: a forward all-gather of its input, a backward all-gather and reduce-scatter,
    and the final norm's 1 (RMSNorm) or 2 (LayerNorm) parameter all-reduces of h); the
    vocab-parallel cross-entropy's three small fp32 all-reduces of b s."""
    bw, lat = link
    sbh = s * b * model.hidden * e
    ar = comm.allreduce_time(sbh, t, bw, lat, eff)
    ce = CE_ALLREDUCES * comm.allreduce_time(s * b * 4.0, t, bw, lat, eff)
    if not sp:
        return ar, ar + ce
    ag = comm.allgather_time(sbh, t, bw, lat, eff)
    rs = comm.reducescatter_time(sbh, t, bw, lat, eff)
    first = (ar if model.position == "learned" else rs) + ag
    norm = (2 if model.norm == "layernorm" else 1) * comm.allreduce_time(model.hidden * e, t, bw, lat, eff)
    return first, 2 * ag + rs + norm + ce
