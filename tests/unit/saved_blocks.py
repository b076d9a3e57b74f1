"""What the activation-memory tests share (test_cost_activations.py, test_executor_parts.py):
two blocks of a model in bf16 on this CPU under saved-tensor hooks
(planner.model.recompute.saved_for_backward), the second block's own saved tensors apart from
the ones both blocks keep (the stage's shared part: mask, cos/sin, ids)."""
from __future__ import annotations

from typing import Any


def two_blocks_saved(spec: Any, b: int, s: int, attention: str, recompute: str) -> tuple[dict, dict, Any]:
    """(the second block's own saved storages, the storages both blocks keep, its output) for a
    batch of b rows of s tokens; recompute is none, selective or full."""
    import torch

    from planner.model.attention import StageCache
    from planner.model.block import Block
    from planner.model.parallel.groups import TPGroup
    from planner.model.recompute import saved_for_backward
    cache = StageCache(spec, TPGroup())
    blocks = torch.nn.ModuleList(Block(spec, i, recompute == "full", recompute == "selective",
                                       attention=attention, cache=cache) for i in range(2)).to(torch.bfloat16)
    x = torch.randn(b, s, spec.hidden, dtype=torch.bfloat16, requires_grad=True) * 1.0
    pos, seg = torch.arange(s).repeat(b, 1), torch.ones(b, s, dtype=torch.long)
    with saved_for_backward(blocks.parameters()) as first:
        h = blocks[0]((x, pos, seg))
    with saved_for_backward(blocks.parameters()) as second:
        out = blocks[1](h)
    own = {k: v for k, v in second.items() if k not in first}
    shared = {k: v for k, v in second.items() if k in first}
    return own, shared, out
