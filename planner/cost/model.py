"""The cost model's per-layer costs: (model, cluster, train, plan) -> LayerCosts, the numbers
the estimate (planner/cost/estimate.py) and the search's exact solvers share: a block's time
(planner.cost.block), the first and last stages' extra time and TP collectives
(planner.cost.tp), activations (planner.cost.memory), parameters (planner.cost.params) and MoE
experts' states. Per-stage memory and time from them: planner.cost.stage.

Pure Python (no torch, deepspeed or optuna), deterministic, and fast enough for hundreds of
thousands of calls in a search.
"""
from __future__ import annotations

from planner.cost import compute, engines, longctx, memory, moe, params, pipeline
from planner.cost.block import BlockTimes, block_kernel, block_times, runtime_train
from planner.cost.factors import Factors, cluster_factors
from planner.cost.layers import LayerCosts
from planner.cost.probes import block_probe
from planner.cost.runtime import get_runtime
from planner.cost.stage import resident_memory
from planner.cost.tp import tp_link, tp_stage_comm
from planner.specs.estimate import GB
from planner.specs.cluster import ClusterSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import Plan
from planner.specs.train import TrainSpec
from planner.specs.dtypes import activation_bytes


def layer_costs(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, plan: Plan) -> LayerCosts:
    """Per-block costs of `plan`, computed for its cp-free equivalent (planner.cost.longctx.local)."""
    train = runtime_train(train, plan)
    f = cluster_factors(cluster, plan.runtime, plan)
    ctx = (plan.cp, plan.cp_kind)
    plan, train = longctx.local(plan, train)
    return layer_costs_of(model, cluster, train, plan, f, block_times(model, cluster, train, plan, f, ctx))


def layer_costs_of(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, plan: Plan, f: Factors,
                 bt: BlockTimes) -> LayerCosts:
    dev = cluster.device
    s, b, t, e = train.seq_len, plan.micro_batch, plan.tp, activation_bytes(plan.precision)
    prec = plan.precision if dev.supports(plan.precision) else "fp32"
    kernel = block_kernel(model, cluster, train)
    hbm = dev.hbm_bytes_per_s
    sbh = s * b * model.hidden
    v_local = model.padded_vocab(t) / t
    base = bt.forward + bt.backward + bt.tp_fwd + bt.tp_bwd
    block_time = base + (bt.selective if plan.recompute == "selective" else 0.0)
    block_full = base + bt.forward + bt.tp_fwd
    first_tp, last_tp = tp_stage_comm(model, s, b, t, e, plan.sequence_parallel, tp_link(cluster, plan),
                                      f.comm_efficiency)
    # first stage: embedding lookup and its gradient (memory-bound)
    first = 3.0 * 2.0 * sbh * e / hbm * f.elementwise_scale
    # last stage: final norm, output GEMM (2 b s h V_pad / t, backward 2x), cross-entropy in fp32
    logits = compute.logits_times(model, dev, s, b, t, compute.bf16_part(prec), f.compute_scale)
    ce = (3.0 * s * b * v_local * (e + 8.0) + 6.0 * sbh * e) / hbm * f.elementwise_scale
    bp = block_probe(cluster, plan)
    if bp is not None:  # the same operators as the block's, in the same precision, class by class
        gs, _, es = bp.classes
        first, logits, ce = es * first, gs * logits, es * ce
    last = logits + ce
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
