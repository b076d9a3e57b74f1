"""The rules that move DeepSpeed's buffers (optimizer / parameter offload) select them by kind
(planner/cost/engines.py Kind), never by their display name: relabelling every buffer changes
nothing they decide."""
from __future__ import annotations

import dataclasses

import pytest

from planner.cost import deepspeed_buffers, engines
from planner.cost.engines import Kind


def _relabelled(engine: engines.Engine) -> engines.Engine:
    return dataclasses.replace(engine, buffers=tuple(dataclasses.replace(b, name=f"buffer {i}")
                                                     for i, b in enumerate(engine.buffers)))


@pytest.mark.parametrize("zero,offload_optimizer,offload_params", [(1, "cpu", "none"), (2, "cpu", "none"),
                                                                   (3, "cpu", "cpu"), (3, "nvme", "nvme")])
def test_offload_moves_buffers_by_kind(zero, offload_optimizer, offload_params) -> None:
    base = engines._base_engine(zero, "bf16", False, True)
    args = (zero, 2.0, offload_optimizer, offload_params, False, False, False)
    moved = deepspeed_buffers._with_variants(base, *args)
    again = deepspeed_buffers._with_variants(_relabelled(base), *args)
    assert [(b.kind, b.location, b.phase) for b in moved.buffers] == [(b.kind, b.location, b.phase)
                                                                       for b in again.buffers]
    off = {b.kind for b in moved.buffers if b.location != "device"}
    assert {Kind.MASTER_PARTITION, Kind.ADAM_MOMENTS} <= off
    assert Kind.OWNED_GRAD_PARTITION not in {b.kind for b in moved.buffers}  # straight to the host fp32 grads


def test_the_kinds_are_tagged_where_the_labels_say_so() -> None:
    for zero in (0, 1, 2, 3):
        for b in engines._base_engine(zero, "bf16", False, True).buffers:
            assert (b.kind is Kind.OTHER) == (b.name not in {k.value for k in Kind} | {"fp32 gradient sub-group"}), b
