"""The profiler times one TP rank of the executor's real block (not a stand-in, not AutoTP-narrowed linears)."""
from __future__ import annotations

import pytest

from planner.specs import preset, scale

torch = pytest.importorskip("torch")
from planner.profiler.block import make_block  # noqa: E402


@pytest.mark.parametrize("tp, params", [
    # chatglm3-6b tiny: h 128, 4 heads, 2 KV groups, d 32, f 432 (SwiGLU), QKV bias, RMSNorm.
    # QKV 128 x (128 + 2 x 64) + 256 bias, dense 128 x 128, gate|up 128 x 864, down 432 x 128, norms 2 x 128
    (1, 128 * 256 + 256 + 128 * 128 + 128 * 864 + 432 * 128 + 256),
    # TP 2: every split matrix and the QKV bias halve; the norms stay whole
    (2, 128 * 128 + 128 + 64 * 128 + 128 * 432 + 216 * 128 + 256),
])
def test_profiled_block_is_one_tp_rank_of_the_executor_block(tp: int, params: int) -> None:
    model = scale(preset("chatglm3-6b"), "tiny")
    block, source = make_block(model, tp)
    assert source.startswith("planner.model.block.Block")
    assert sum(p.numel() for p in block.parameters()) == params
    x = torch.randn(2, 16, model.hidden, requires_grad=True)
    block(x).sum().backward()  # runs forward and backward without a process group
    assert x.grad is not None and x.grad.shape == x.shape
