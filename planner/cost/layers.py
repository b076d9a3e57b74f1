"""Per-block and per-stage costs: the numbers the exact solvers and the estimate share."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from planner.cost.params import zero1_owned


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerCosts:
    """Costs of one device for ONE micro-batch, for a given (model, cluster, train, plan).

    Times in seconds, memory in bytes, parameters in elements. "block" is one transformer
    layer on one TP rank.
    """

    block_time: float
    """Forward + backward of one block, with the plan's recompute mode applied to it
    (none or selective); includes its exposed TP communication."""
    block_time_full_recompute: float
    """The same block when fully checkpointed (forward recomputed in backward)."""
    first_stage_time: float
    """Extra forward + backward on the first stage: embedding lookup and its TP all-reduce."""
    last_stage_time: float
    """Extra forward + backward on the last stage: final norm, output layer, loss, their TP
    all-reduces."""
    first_stage_tp: float
    """Of first_stage_time, the TP communication (embedding forward all-reduce)."""
    last_stage_tp: float
    """Of last_stage_time, the TP communication (output-layer backward all-reduce and the
    vocab-parallel cross-entropy's small all-reduces)."""
    block_act_bytes: float
    """What one block keeps for backward (plan's recompute mode, none or selective):
    planner.cost.memory.block_activation_bytes, docs/runtime.md."""
    block_act_bytes_full_recompute: float
    """What a fully checkpointed block keeps: its input (Korthikanti Table 2: 2sbh)."""
    block_work_bytes: float
    """Working set of recomputation, counted once per stage that recomputes: a checkpointed
    block's (or attention core's) tensors besides what it kept, the mask and cos/sin its
    recompute rebuilds, and the position/segment ids the checkpoints hold."""
    first_stage_act_bytes: float
    """Extra bytes on the first stage per micro-batch in flight: the embedding's ids and flags;
    with a pipeline also the stage's shared tensors, its output message and its fixed buffers
    spread over its in-flight micro-batches (planner.cost.model.stage_extras)."""
    last_stage_act_bytes: float
    """Extra bytes on the last stage (one micro-batch in flight): final norm, output-layer
    input, fp32 softmax and loss buffers, the transient logits (b s V_pad/t), the stage's
    shared tensors and cache, DeepSpeed's pipeline buffers (planner.cost.model.stage_extras)."""
    block_psi: int
    """Parameters of one block on one device (planner.cost.params)."""
    first_stage_psi: int
    """Extra parameters on the first stage (embedding)."""
    last_stage_psi: int
    """Extra parameters on the last stage (final norm, output layer or its tied copy)."""
    block_small: int
    """Of block_psi, elements in tensors ZeRO-3 keeps gathered (persistence threshold)."""
    first_stage_small: int
    last_stage_small: int
    fixed_bytes: float
    """Per-device runtime allowance independent of layers (model states and communication
    buffers are per stage and engine: planner.cost.stage.stage_bytes)."""
    in_flight: tuple[float, ...]
    """Micro-batches whose activations a stage holds at its peak (1F1B: p - i on stage i,
    capped at the accumulation steps; interleaving scales it)."""
    block_numels: tuple[int, ...] = ()
    """Element counts of one block's parameter tensors on one device, in module order
    (planner.cost.params.block_tensors); with the two below, what ZeRO-1's owned gradients
    depend on (stage_owned)."""
    first_stage_numels: tuple[int, ...] = ()
    last_stage_numels: tuple[int, ...] = ()
    share_layers: int = 1
    """ModelSpec.share_layers: K consecutive blocks use one set of parameter tensors."""
    block_expert_bytes: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """MoE: (params, grads, optimizer) bytes of one (mean) block's routed experts on one device,
    partitioned over the expert-data-parallel ranks (planner.cost.model.moe_state_bytes); not
    in block_psi."""

    moe_numels: tuple[int, ...] = ()
    """MoE: the tensors one device holds beyond block_numels (the MoE block's): the dense
    blocks' (first_dense) and one block's routed experts (planner.cost.params.expert_tensors);
    read by `largest` only."""

    @property
    def largest(self) -> int:
        """Elements of the model's largest parameter tensor on one device, over every parameter
        group (the size of DeepSpeed's offload staging buffers: stage_1_and_2.py __init__,
        largest_param_numel over bit16_groups, the experts' group included)."""
        return max(self.block_numels + self.first_stage_numels + self.last_stage_numels + self.moe_numels,
                   default=0)

    def stage_psi(self, stage: int, pp: int, blocks: int) -> tuple[int, int]:
        """(parameters, small parameters) of one device of `stage` holding `blocks` blocks."""
        psi, small = blocks * self.block_psi, blocks * self.block_small
        if stage == 0:
            psi, small = psi + self.first_stage_psi, small + self.first_stage_small
        if stage == pp - 1:
            psi, small = psi + self.last_stage_psi, small + self.last_stage_small
        return psi, small

    def stage_owned(self, stage: int, pp: int, blocks: int, dp: int) -> int:
        """ZeRO-1's owned gradient elements on the worst DP rank of `stage`
        (planner.cost.params.zero1_owned) over the tensors DeepSpeed flattens: with
        share_layers K, blocks / K sets (a shared tensor is one parameter of the module)."""
        return _stage_owned(self.block_numels, self.first_stage_numels if stage == 0 else (),
                            self.last_stage_numels if stage == pp - 1 else (), -(-blocks // self.share_layers), dp)


@lru_cache(maxsize=65536)
def _stage_owned(block: tuple[int, ...], first: tuple[int, ...], last: tuple[int, ...], blocks: int, dp: int) -> int:
    return max(zero1_owned(first + block * blocks + last, dp))
