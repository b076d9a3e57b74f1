"""The cost model: (model, cluster, train, plan) -> Estimate, and the per-layer costs the
search's exact solvers share with it.

Pure Python (no torch, deepspeed or optuna), deterministic, and fast enough for hundreds of
thousands of calls in a search.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from planner.cost import comm, compute, engines, longctx, memory, moe, params, pipeline
from planner.cost.attention import attention_kernel
from planner.cost.factors import Factors, cluster_factors
from planner.cost.layers import LayerCosts
from planner.cost.runtime import get_runtime
from planner.specs.estimate import GB, MemoryBreakdown
from planner.specs.cluster import ClusterSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import Plan
from planner.specs.train import TrainSpec
from planner.specs.dtypes import activation_bytes

CE_ALLREDUCES = 3
"""Small fp32 all-reduces of b x s values in the vocab-parallel cross-entropy (max logit, sum
of exponentials, target logit: Megatron-LM _VocabParallelCrossEntropy, the executor's
planner/model/parallel/tensor.py)."""


@dataclass(frozen=True, slots=True)
class _BlockTimes:
    forward: float  # GEMMs + attention core + element-wise, no communication
    backward: float  # 2x forward, plus flash's recomputed scores
    tp_fwd: float  # exposed collectives of one forward: TP's and (a2a_fwd of them) EP's / CP's
    tp_bwd: float
    selective: float  # extra forward work of selective recompute (attention core + softmax)
    a2a_fwd: float = 0.0  # of tp_fwd: MoE and context-parallel all-to-alls / ring sends
    a2a_bwd: float = 0.0


def _kernel(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec) -> str:
    return attention_kernel(model, train, cluster.device.kind)


def _tp_link(cluster: ClusterSpec, plan: Plan) -> tuple[float, float]:
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


def framework_overheads(cluster: ClusterSpec, plan: Plan, f: Factors) -> tuple[float, float]:
    """(seconds per micro-batch per stage, seconds per step) of the runtime beyond the compute
    terms: the factors' microbatch_overhead_s and step_overhead_s, plus a profiled CPU's
    engine probe (planner/specs/step.py framework) of the plan's precision, time-shared by
    the oversubscription like compute; on 2 or more processes the 2-process probe's (Parallel):
    under a pipeline its pipe schedule's cost per micro-batch replaces the framework's, else
    its concurrency cost per micro-batch adds to it; with data parallelism (ZeRO 0-2) its
    per-step cost adds to the step's, under ZeRO-3 its ZeRO-3 costs per micro-batch and step."""
    fw = cluster.device.step.framework.get(plan.precision)
    if fw is None:
        return f.microbatch_overhead_s, f.step_overhead_s
    k = cluster.device.oversubscription(cluster.gpus_per_node)
    mb, step = fw.microbatch_s, fw.step_s
    par = parallel_probe(cluster, plan)
    if par is not None:
        if plan.pp > 1:  # DeepSpeed's pipe schedule per micro-batch, sends included (p2p_times: none then)
            mb = par.pipe_microbatch_s
        else:  # ranks computing at once
            mb += par.microbatch_s
        if plan.dp > 1 and plan.zero < 3:
            step += par.dp_step_s
        if plan.dp > 1 and plan.zero == 3:
            mb, step = mb + par.zero3_microbatch_s, step + par.zero3_step_s
    return f.microbatch_overhead_s + mb * k, f.step_overhead_s + step * k


def parallel_probe(cluster: ClusterSpec, plan: Plan):
    """The profiled CPU's 2-process engine probe of the plan's precision (planner/specs/step.py
    Parallel) when the plan runs more than one process, or None."""
    if plan.world_size < 2 or cluster.device.kind != "cpu":
        return None
    return cluster.device.step.parallel.get(plan.precision)


def block_probe(cluster: ClusterSpec, plan: Plan):
    """The profiled CPU's block probe for the plan's precision (planner/specs/step.py), or None."""
    dev = cluster.device
    return dev.step.block_for(plan.precision if dev.supports(plan.precision) else "fp32")


def _block_times(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, plan: Plan,
                 f: Factors, ctx: tuple[int, str] = (1, "ulysses"), probe: bool = True) -> _BlockTimes:
    """One block's times for a cp-free plan (planner.cost.longctx.local); `ctx` = the original
    plan's (cp, cp_kind): its attention core is cp times a block's at s/cp, plus the
    context-parallel communication. MoE blocks' FFN, router and all-to-alls are weighted in by
    their share of the blocks (planner.cost.moe).

    On a profiled CPU (`probe`, planner/specs/step.py) the compute terms compose as the
    executor's block measured: scale x (GEMMs + core + element-wise) + overhead_s per block
    forward + backward, 1/3 of it forward and 2/3 backward (its operators run once forward and
    twice backward), the overhead stretched by the oversubscription like the rest."""
    dev = cluster.device
    prec = plan.precision if dev.supports(plan.precision) else "fp32"
    s, b, t, e = train.seq_len, plan.micro_batch, plan.tp, activation_bytes(plan.precision)
    kernel = _kernel(model, cluster, train)
    rt = get_runtime(plan.runtime)
    bc = compute.block_compute_times(model, dev, s, b, t, prec, compute_scale=f.compute_scale,
                                     attention_scale=f.attention_scale, kernel=kernel,
                                     attention=attention_kernel_of(rt, train))
    gemm_f, gemm_b, core_f = bc.gemm_fwd, bc.gemm_bwd, bc.core_fwd
    # the attention core's backward beyond 2x its forward (flash: the recomputed Q K^T)
    rec_f = bc.core_bwd - 2.0 * core_f
    hbm = dev.hbm_bytes_per_s
    elem = compute.block_elementwise_bytes(model, s, b, t, e, plan.sequence_parallel, kernel)
    no_scores = compute.block_elementwise_bytes(model, s, b, t, e, plan.sequence_parallel, "flash")
    elem_f = elem / hbm * f.elementwise_scale
    scores_f = (elem - no_scores) / hbm * f.elementwise_scale
    tp_fwd, tp_bwd = tp_block_comm(model, s, b, t, e, plan.sequence_parallel, _tp_link(cluster, plan),
                                   f.comm_efficiency)
    if plan.sequence_parallel and rt.tp_comm_overlap:
        tp_fwd, tp_bwd = overlapped_tp(tp_fwd, tp_bwd, gemm_f, gemm_b)
    cp, kind = ctx
    a2a_f = a2a_b = 0.0
    if cp > 1:  # a rank's share of the s x s core: cp x a block's at s/cp (flash only: validate)
        core_f, rec_f = core_f * longctx.core_factor(cp), rec_f * longctx.core_factor(cp)
        cf, cb = longctx.block_comm(model, cluster, t, b, cp, kind, s, e, f.comm_efficiency, core_f,
                                    2.0 * core_f + rec_f)
        a2a_f, a2a_b = cf, cb
    w = moe.share(model)
    if w:
        moe_t = moe.ffn_time(model, dev, s, b, t, plan.ep, prec, f.compute_scale)
        dense = compute.weight_gemm_times(model, dev, s, b, t, prec)[2:]  # the FFN a MoE block replaces
        gemm_f += w * (moe_t - sum(x[0] for x in dense) * f.compute_scale)
        gemm_b += w * (2.0 * moe_t - sum(x[1] for x in dense) * f.compute_scale)
        moe_e, dense_e = moe.ffn_elementwise_bytes(model, s, b, t, e)
        elem_f += w * (moe_e - dense_e) / hbm * f.elementwise_scale
        af, ab = moe.alltoall_comm(model, cluster, plan, s, e, f.comm_efficiency)
        a2a_f, a2a_b = a2a_f + w * af, a2a_b + w * ab
    fwd = gemm_f + core_f + elem_f
    bwd = gemm_b + 2.0 * core_f + rec_f + 2.0 * elem_f
    selective = core_f + scores_f
    bp = block_probe(cluster, plan) if probe else None
    if bp is not None:
        over = bp.overhead_s * dev.oversubscription(cluster.gpus_per_node)
        fwd, bwd = bp.scale * fwd + over / 3.0, bp.scale * bwd + 2.0 * over / 3.0
        selective *= bp.scale
    return _BlockTimes(forward=fwd, backward=bwd, tp_fwd=tp_fwd + a2a_f,
                       tp_bwd=tp_bwd + a2a_b, selective=selective, a2a_fwd=a2a_f, a2a_bwd=a2a_b)


def attention_kernel_of(rt, train: TrainSpec) -> compute.AttentionKernel:
    """The flash kernel families the plan's runtime runs, in order: the one its environment names
    (TrainSpec.attention_backend, e.g. Transformer Engine with NVTE_FUSED_ATTN=0 runs
    FlashAttention-2, not cuDNN) first, then the runtime's own preference (profiles/runtimes/*.json
    "attention_kernels"), so a profile without the named family falls back as the runtime would."""
    fams = tuple(rt.attention_kernels)
    if train.attention_backend:
        fams = (train.attention_backend,) + tuple(f for f in fams if f != train.attention_backend)
    return compute.AttentionKernel(fams, rt.causal_attention)


def block_compute_time(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, plan: Plan) -> float:
    """Forward + backward seconds of one block's compute terms (GEMMs, attention core,
    element-wise; no communication, no step probe): what the profiler's block probe is
    measured against (planner/profiler/write.py)."""
    train = runtime_train(train, plan)
    f = cluster_factors(cluster, plan.runtime)
    plan, train = longctx.local(plan, train)
    bt = _block_times(model, cluster, train, plan, f, probe=False)
    return bt.forward + bt.backward


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


def runtime_train(train: TrainSpec, plan: Plan) -> TrainSpec:
    """The training spec as the plan's runtime runs it: Megatron-Core (Transformer Engine) and
    FSDP (llm-foundry, attn_impl=flash) always run flash attention (profiles/runtimes/*.json
    "attention"); DeepSpeed runs the kernel TrainSpec.attention names."""
    kernel = get_runtime(plan.runtime).attention
    if kernel == "plan" or kernel == train.attention:
        return train
    return dataclasses.replace(train, attention=kernel)


def layer_costs(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, plan: Plan) -> LayerCosts:
    """Per-block costs of `plan`, computed for its cp-free equivalent (planner.cost.longctx.local)."""
    train = runtime_train(train, plan)
    f = cluster_factors(cluster, plan.runtime)
    ctx = (plan.cp, plan.cp_kind)
    plan, train = longctx.local(plan, train)
    return _layer_costs(model, cluster, train, plan, f, _block_times(model, cluster, train, plan, f, ctx))


def _layer_costs(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, plan: Plan, f: Factors,
                 bt: _BlockTimes) -> LayerCosts:
    dev = cluster.device
    s, b, t, e = train.seq_len, plan.micro_batch, plan.tp, activation_bytes(plan.precision)
    prec = plan.precision if dev.supports(plan.precision) else "fp32"
    kernel = _kernel(model, cluster, train)
    hbm = dev.hbm_bytes_per_s
    sbh = s * b * model.hidden
    v_local = model.padded_vocab(t) / t
    base = bt.forward + bt.backward + bt.tp_fwd + bt.tp_bwd
    block_time = base + (bt.selective if plan.recompute == "selective" else 0.0)
    block_full = base + bt.forward + bt.tp_fwd
    first_tp, last_tp = tp_stage_comm(model, s, b, t, e, plan.sequence_parallel, _tp_link(cluster, plan),
                                      f.comm_efficiency)
    # first stage: embedding lookup and its gradient (memory-bound)
    first = 3.0 * 2.0 * sbh * e / hbm * f.elementwise_scale
    # last stage: final norm, output GEMM (2 b s h V_pad / t, backward 2x), cross-entropy in fp32
    last = compute.logits_times(model, dev, s, b, t, compute.bf16_part(prec), f.compute_scale)
    last += (3.0 * s * b * v_local * (e + 8.0) + 6.0 * sbh * e) / hbm * f.elementwise_scale
    bp = block_probe(cluster, plan)
    if bp is not None:  # the same operators as the block's, in the same precision
        first, last = bp.scale * first, bp.scale * last
    act_mode = "selective" if plan.recompute == "selective" else "none"
    kw = dict(sequence_parallel=plan.sequence_parallel, act_bytes=e, kernel=kernel)
    act = memory.block_activation_bytes(model, s, b, t, recompute=act_mode, **kw) * f.activation_scale
    act_none = memory.block_activation_bytes(model, s, b, t, recompute="none", **kw) * f.activation_scale
    if rebuilds_shared_per_block(plan):
        own = memory.shared_bytes(model, s, b, t, act_bytes=e, kernel=kernel, plain=True, recomputed=False)
        act += own if plan.recompute != "selective" else 0.0
        act_none += own
    act_full = memory.block_activation_bytes(model, s, b, t, recompute="full", **kw)
    w = moe.share(model)
    if w:  # MoE blocks keep their router scores and dispatched tokens instead of the dense FFN's
        moe_a, dense_a = moe.ffn_activation_bytes(model, s, b, t, e)
        act += w * (moe_a - dense_a) * f.activation_scale
        act_none += w * (moe_a - dense_a) * f.activation_scale
    in_flight = pipeline.in_flight(plan.pp, plan.grad_accum, plan.interleave)
    first_act, last_act, work = stage_extras(model, s, b, t, plan, e, kernel, in_flight[0])
    # the recomputed block (or attention core) rebuilds what it dropped, next to what it kept
    work += act_none - (act if plan.recompute == "selective" else act_full)
    thr = plan.persistence_elements or params.persistence_threshold(model)
    blk, fst, lst = (params.block_tensors(model, t), params.first_stage_tensors(model, t),
                     params.last_stage_tensors(model, t, plan.pp))
    blk_psi, blk_small, experts = blk.total / model.share_layers, blk.small(thr) / model.share_layers, (0.0,) * 3
    moe_numels: tuple[int, ...] = ()
    if w:  # the mean block: dense blocks and MoE blocks' replicated part; experts in their own group
        mblk = params.moe_block_tensors(model, t)
        blk_psi = (1 - w) * blk.total + w * mblk.total
        blk_small = (1 - w) * blk.small(thr) + w * mblk.small(thr)
        moe_numels = (blk.numels if model.moe.first_dense else ()) + params.expert_tensors(model, plan.ep).numels
        blk = mblk
        experts = tuple(w * x for x in moe_state_bytes(plan, model, resident_memory(dev.kind)))
    return LayerCosts(
        block_time=block_time, block_time_full_recompute=block_full, first_stage_time=first + first_tp,
        last_stage_time=last + last_tp, first_stage_tp=first_tp, last_stage_tp=last_tp,
        block_act_bytes=act, block_act_bytes_full_recompute=act_full,
        block_work_bytes=work, first_stage_act_bytes=first_act, last_stage_act_bytes=last_act,
        # share_layers K: K blocks hold one set of parameters (ModelSpec.share_layers; PP refused)
        block_psi=blk_psi, first_stage_psi=fst.total, last_stage_psi=lst.total,
        block_small=blk_small, first_stage_small=fst.small(thr),
        last_stage_small=lst.small(thr),
        fixed_bytes=f.memory_overhead_gb * GB,
        in_flight=in_flight,
        block_numels=blk.numels, first_stage_numels=fst.numels, last_stage_numels=lst.numels,
        share_layers=model.share_layers, block_expert_bytes=experts, moe_numels=moe_numels,
    )


def moe_state_bytes(plan: Plan, model: ModelSpec, resident: bool) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes of one MoE block's routed experts on one rank: experts /
    ep of them, with the plan's ZeRO stage partitioning over the expert-data-parallel ranks
    (planner.cost.moe.expert_plan), as DeepSpeed's separate MoE parameter groups do."""
    psi = moe.expert_params(model, plan.ep)
    held, back, _ = engines.footprint(moe.expert_plan(plan), resident).evaluate(psi, 0.0)
    return held[0] + back[0], held[1] + back[1], held[2] + back[2]


def rebuilds_shared_per_block(plan: Plan) -> bool:
    """Under ZeRO-3 every block builds its own mask and cos/sin: DeepSpeed wraps each module's
    output tensors in an autograd function (deepspeed/runtime/zero/parameter_offload.py
    _post_forward_module_hook -> zero/utils.py apply_to_tensors_only), so the position and
    segment ids reach the next block as new tensor objects and the executor's stage cache,
    keyed by their identity (planner/model/attention.py StageCache), misses. Measured with
    the executor's ActivationRecorder (docs/runtime.md)."""
    return plan.zero == 3 and get_runtime(plan.runtime).executable


def stage_extras(model: ModelSpec, s: int, b: int, t: int, plan: Plan, e: float, kernel: str,
                 flight0: float) -> tuple[float, float, float]:
    """(first stage per in-flight micro-batch, last stage, recompute working set) of the
    activation bytes outside the blocks (planner/cost/memory.py, docs/runtime.md):

    - first stage, per micro-batch in flight: the embedding's ids and flags; with a pipeline
      also the stage's shared tensors (mask, cos/sin), its output message, and its fixed
      buffers (the stage cache's own set beyond what the blocks keep, the pipeline's
      buffers) spread over its `flight0` micro-batches so that the total is exact;
    - last stage (one micro-batch in flight under 1F1B): the head and loss, the transient
      logits, the shared tensors, the stage cache's own set, the pipeline's buffers (received
      message, labels, previous logits). Without a pipeline the one stage is first and last:
      its shared tensors are counted here;
    - where blocks are recomputed: the shared tensors a recompute rebuilds, and the position
      and segment ids the checkpoints hold.

    Which blocks of a stage are recomputed is the search's choice, after these costs (a
    "full" plan that checkpoints nothing is the "none" plan, with the same costs), so the
    shared tensors count as for a stage with plain blocks: exact for a stage with both plain
    and checkpointed blocks; a stage whose blocks are all checkpointed is charged its mask and
    cos/sin per micro-batch instead of once; the checkpoints' ids count once per stage, not per
    micro-batch in flight (16 b s each). Inner pipeline stages (0 < i < p - 1) are not charged
    their shared tensors and pipeline buffers: LayerCosts has no per-stage term the search's
    solvers read (planner/search/checkpoint.py StageModel).
    """
    sp, p, m = plan.sequence_parallel, plan.pp, plan.grad_accum
    plain = plan.recompute != "selective"
    rt = get_runtime(plan.runtime)
    mask = rt.materialises_mask
    kept = memory.shared_bytes(model, s, b, t, act_bytes=e, kernel=kernel, plain=plain, recomputed=False, mask=mask)
    cache = memory.cache_bytes(model, s, b, t, e, mask) - kept  # the cache's set beyond the latest micro-batch's
    if rebuilds_shared_per_block(plan):
        kept = 0.0  # each plain block keeps its own set (block_act_bytes)
    first = memory.embedding_bytes(model, s, b, t)
    last = memory.head_bytes(model, s, b, t, sequence_parallel=sp, act_bytes=e, fused_ce=rt.fused_cross_entropy) \
        + memory.logits_bytes(model, s, b, t, e)
    last += kept + cache
    if p > 1:
        per0, fixed0 = memory.pipeline_bytes(model, s, b, t, sequence_parallel=sp, act_bytes=e, stage=0, p=p, m=m)
        first += kept + per0 + (cache + fixed0) / flight0
        per1, fixed1 = memory.pipeline_bytes(model, s, b, t, sequence_parallel=sp, act_bytes=e, stage=p - 1, p=p,
                                             m=m)
        last += per1 + fixed1
    work = memory.shared_bytes(model, s, b, t, act_bytes=e, kernel=kernel, plain=True, recomputed=True, mask=mask)
    return first, last, work


def stage_bytes(fp: engines.Footprint, plan: Plan, lc: LayerCosts, stage: int, blocks: int, checkpointed: int,
                fragmentation: float) -> tuple[float, float, float, float, float, float, float]:
    """Peak memory of one device of `stage` holding `blocks` blocks, `checkpointed` of them
    fully checkpointed: (params, grads, optimizer, activations, logits, buckets, overhead).

    `fp` is the plan's DeepSpeed engine (planner.cost.engines.footprint). Its buffers held
    from backward through the step count always. On top of them the peak is the larger of the
    backward phase (activations, logits, and the engine's backward-only buffers: full
    gradients before ZeRO-1's epilogue, reduce buckets, ZeRO-3's gathered weights) and the
    optimizer step (its step-only buffers, e.g. fp32 copies of the gradients), when
    activations are freed; a larger step phase shows as extra "buckets".
    """
    p = plan.pp
    psi, small = lc.stage_psi(stage, p, blocks)
    held, back, step_only = fp.evaluate(psi, small, lc.stage_owned(stage, p, blocks, plan.dp) if fp.owned else None)
    k = lc.in_flight[stage]
    acts = k * ((blocks - checkpointed) * lc.block_act_bytes + checkpointed * lc.block_act_bytes_full_recompute)
    if stage == 0:
        acts += k * lc.first_stage_act_bytes
    if checkpointed > 0 or plan.recompute == "selective":
        acts += lc.block_work_bytes
    logits = lc.last_stage_act_bytes if stage == p - 1 else 0.0
    params, grads, opt, buckets = (h + b for h, b in zip(held, back))
    ep_p, ep_g, ep_o = lc.block_expert_bytes  # MoE: the experts' states (their own ZeRO group)
    params, grads, opt = params + blocks * ep_p, grads + blocks * ep_g, opt + blocks * ep_o
    if plan.precision == "fp8":
        params += memory.fp8_bytes(blocks, lc.block_psi, plan.zero == 3)
    backward = acts + logits + sum(back)
    if step_only > backward:
        buckets += step_only - backward
    overhead = lc.fixed_bytes + fragmentation * (acts + logits + buckets)
    return params, grads, opt, acts, logits, buckets, overhead


def resident_memory(device_kind: str) -> bool:
    """Whether memory is measured as resident pages (a CPU process's peak RSS, VmHWM) rather
    than as allocated bytes (a GPU's caching allocator): buffers allocated with torch.empty
    and only partly written count only where written (planner.cost.engines.Sizes.resident)."""
    return device_kind == "cpu"


def stage_memory(plan: Plan, lc: LayerCosts, layers: tuple[int, ...],
                 checkpointed: tuple[int, ...], fragmentation: float, resident: bool) -> list[MemoryBreakdown]:
    """Per-stage peak memory of one device from the shared layer costs."""
    fp = engines.footprint(plan, resident, lc.largest)
    out = []
    for i, (n, r) in enumerate(zip(layers, checkpointed)):
        pa, gr, op, ac, lo, bu, ov = stage_bytes(fp, plan, lc, i, n, r, fragmentation)
        out.append(MemoryBreakdown(params=pa, grads=gr, optimizer=op, activations=ac, logits=lo, buckets=bu,
                                   overhead=ov))
    return out


def stage_times(lc: LayerCosts, layers: tuple[int, ...], checkpointed: tuple[int, ...],
                microbatch_overhead: float) -> list[float]:
    """Forward + backward seconds of one micro-batch on each stage."""
    p = len(layers)
    out = []
    for i, (n, r) in enumerate(zip(layers, checkpointed)):
        t = (n - r) * lc.block_time + r * lc.block_time_full_recompute + microbatch_overhead
        if i == 0:
            t += lc.first_stage_time
        if i == p - 1:
            t += lc.last_stage_time
        out.append(t)
    return out
