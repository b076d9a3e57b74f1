"""Activation checkpointing in the executor's model (planner/model/glm.py): DeepSpeed's
checkpoint as the blocks call it (`checkpoint`, looked up at each call so that
saved_for_backward and planner/runtime/observe/measure.py ActivationRecorder see its inputs),
which blocks of each pipeline stage are fully checkpointed (block_flags), and what a layer
keeps for backward (saved_for_backward; docs/runtime.md)."""
from __future__ import annotations

import contextlib

import torch

from planner.specs.model import ModelSpec


@contextlib.contextmanager
def saved_for_backward(params=()):
    """Record the tensors kept for backward while the body runs forward: those autograd nodes
    save (saved-tensor hooks) and the inputs DeepSpeed's activation checkpointing holds (ctx
    attributes, which the hooks do not see). Yields {storage pointer: [tensors]}: views of one
    storage are one allocation; parameters (`params`) are left out."""
    global checkpoint
    skip = {p.untyped_storage().data_ptr() for p in params}
    kept: dict[int, list[torch.Tensor]] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            kept.setdefault(ptr, []).append(t)
        return t

    run_checkpoint = checkpoint

    def checkpoint_keeping_inputs(fn, *args):
        for a in args:
            if torch.is_tensor(a):
                keep(a)
        return run_checkpoint(fn, *args)

    checkpoint = checkpoint_keeping_inputs
    try:
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            yield kept
    finally:
        checkpoint = run_checkpoint


def storage_bytes(kept: dict[int, list[torch.Tensor]]) -> int:
    return sum(ts[0].untyped_storage().nbytes() for ts in kept.values())


def checkpoint(fn, *args):
    import deepspeed
    return deepspeed.checkpointing.checkpoint(fn, *args)


def block_flags(spec: ModelSpec, stage_layers: tuple[int, ...], checkpointed: tuple[int, ...]) -> list[bool]:
    """Per block, whether it is fully checkpointed: the first k blocks of each stage."""
    flags: list[bool] = []
    for n, k in zip(stage_layers, checkpointed):
        flags += [i < k for i in range(n)]
    assert len(flags) == spec.layers, (flags, spec.layers)
    return flags
