"""Per-stage peak memory and time of one device from the shared LayerCosts
(planner.cost.model.layer_costs): what the estimate reports and the search's exact solvers
bound (planner/search/checkpoint.py StageModel is tested equal to it).

Pure Python (no torch, deepspeed or optuna).
"""
from __future__ import annotations

from planner.cost import engines, memory
from planner.cost.layers import LayerCosts
from planner.specs.estimate import MemoryBreakdown
from planner.specs.plan import Plan


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
        params += memory.fp8_bytes(blocks, lc.block_psi, plan.zero == 3, memory.fp8_param_gather(plan))
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
