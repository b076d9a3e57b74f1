"""Per-block and per-stage costs: the numbers the exact solvers and the estimate share."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerCosts:
    """Costs of one device for ONE micro-batch, for a given (model, cluster, train, plan).

    Times in seconds, memory in bytes. "block" is one transformer layer on one TP rank.
    """

    block_time: float
    """Forward + backward of one block, with the plan's recompute mode applied to it
    (none or selective); includes its exposed TP communication."""
    block_time_full_recompute: float
    """The same block when fully checkpointed (forward recomputed in backward)."""
    first_stage_time: float
    """Extra forward + backward on the first stage: embedding lookup."""
    last_stage_time: float
    """Extra forward + backward on the last stage: final norm, output layer, loss."""
    block_act_bytes: float
    """Activations one block saves for backward (plan's recompute mode, none or selective)."""
    block_act_bytes_full_recompute: float
    """What a fully checkpointed block keeps: its input (Korthikanti Table 2: 2sbh)."""
    block_work_bytes: float
    """Transient working set while one block runs its backward (recomputed activations of a
    checkpointed block, attention scores); counted once per stage, not per micro-batch."""
    first_stage_act_bytes: float
    """Extra saved activations on the first stage (embedding output)."""
    last_stage_act_bytes: float
    """Logits and loss buffers on the last stage (b s V/t, fp32 for the loss)."""
    block_state_bytes: float
    """Parameters + gradients + optimizer states of one block on one device (ZeRO applied)."""
    first_stage_state_bytes: float
    """Extra model states on the first stage (embedding)."""
    last_stage_state_bytes: float
    """Extra model states on the last stage (final norm, untied output layer)."""
    fixed_bytes: float
    """Per-device runtime allowance independent of layers (communication buckets are per
    stage: planner.cost.model.bucket_bytes)."""
    in_flight: tuple[float, ...]
    """Micro-batches whose activations a stage holds at its peak (1F1B: p - i on stage i,
    capped at the accumulation steps; interleaving scales it)."""
