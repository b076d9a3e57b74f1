"""What the Hugging Face weight tests share (test_weights.py, test_hf_moe.py): one fixed batch,
and the check that the executor's model gives transformers' logits on it."""
from __future__ import annotations

import torch

SEQ = 16
"""Tokens per row of the batch."""


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, positions, segment ids) of two rows of SEQ tokens below 256, seed 3."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (2, SEQ), generator=g)
    return ids, torch.arange(SEQ).expand(2, SEQ), torch.ones_like(ids)


def assert_transformers_logits(model, ref) -> torch.Tensor:
    """The executor's `model` gives the transformers model `ref`'s logits on batch() within
    1e-5; returns ref's."""
    ids, pos, seg = batch()
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = model(ids, pos, seg)
    assert got.shape == want.shape
    assert float((got - want).abs().max()) < 1e-5
    return want
