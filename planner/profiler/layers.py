"""Per-layer forward/backward time, recompute cost and saved-activation bytes of a GLM block.

Time: forward and backward of one block (one TP rank's share, no communication) at several
(micro-batch, sequence, TP) points; the same block under activation checkpointing
(torch.utils.checkpoint, reentrant as DeepSpeed's) gives the recompute cost = backward with
checkpointing - backward without.

Memory: bytes the block saves for backward, counted with torch.autograd.graph.saved_tensors_hooks
(every tensor autograd packs; parameters excluded; storages counted once), with and without
checkpointing. On CUDA the allocator's growth over the forward is recorded beside it.
The cost model's figure for the same point (planner.cost.layer_costs, whose activations are
planner.cost.memory.block_activation_bytes: the one formula, never a copy here) is added by
planner.profiler.write.cost_model_point.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from planner.profiler.device import Target
from planner.profiler.gemm import DTYPES
from planner.profiler.stats import Sample, summarize
from planner.specs.model import ModelSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerPoint:
    micro_batch: int
    seq: int
    tp: int
    forward: Sample
    backward: Sample
    forward_ckpt: Sample
    backward_ckpt: Sample
    saved_bytes: int
    saved_bytes_ckpt: int
    allocator_bytes: int | None
    source: str
    precision: str = ""

    @property
    def recompute_s(self) -> float:
        """Extra backward time under checkpointing: the forward recomputed."""
        return max(0.0, self.backward_ckpt.median - self.backward.median)

    def to_dict(self) -> dict[str, Any]:
        return {"micro_batch": self.micro_batch, "seq": self.seq, "tp": self.tp, "precision": self.precision,
                "forward_s": self.forward.to_dict(), "backward_s": self.backward.to_dict(),
                "forward_checkpointed_s": self.forward_ckpt.to_dict(),
                "backward_checkpointed_s": self.backward_ckpt.to_dict(),
                "recompute_s": self.recompute_s,
                "recompute_fraction_of_forward": self.recompute_s / self.forward.median,
                "saved_activation_bytes": self.saved_bytes,
                "saved_activation_bytes_checkpointed": self.saved_bytes_ckpt,
                "allocator_forward_growth_bytes": self.allocator_bytes,
                "block": self.source}


def saved_bytes(fn: Callable[[], Any], params: list[Any]) -> int:
    """Bytes of distinct storages autograd saves for backward while `fn` runs (parameters excluded)."""
    import torch
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def measure_point(model: ModelSpec, b: int, s: int, tp: int, precision: str, target: Target, *,
                  repeats: int, prefer_executor: bool = True) -> LayerPoint:
    import time

    import torch
    from torch.utils.checkpoint import checkpoint

    from planner.profiler.block import make_block

    torch.manual_seed(0)
    dtype = getattr(torch, DTYPES[precision])
    block, source = make_block(model, tp, prefer_executor)
    block = block.to(device=target.device, dtype=dtype)
    params = list(block.parameters())
    x = torch.randn(b, s, model.hidden, device=target.device, dtype=dtype, requires_grad=True)
    grad = torch.randn(b, s, model.hidden, device=target.device, dtype=dtype)

    def run(fwd: Callable[[], torch.Tensor]) -> tuple[Sample, Sample]:
        f, bw = [], []
        for i in range(repeats + 1):  # the first round is warm-up
            target.sync()
            t0 = time.perf_counter()
            out = fwd()
            target.sync()
            t1 = time.perf_counter()
            out.backward(grad)
            target.sync()
            t2 = time.perf_counter()
            x.grad = None
            block.zero_grad(set_to_none=True)
            if i:
                f.append(t1 - t0)
                bw.append(t2 - t1)
        return summarize(f, "s"), summarize(bw, "s")

    plain = lambda: block(x)  # noqa: E731
    ckpt = lambda: checkpoint(block, x, use_reentrant=True)  # noqa: E731
    fwd, bwd = run(plain)
    fwd_c, bwd_c = run(ckpt)
    alloc = None
    if target.kind == "gpu":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = block(x)
        torch.cuda.synchronize()
        alloc = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
        del out
    return LayerPoint(micro_batch=b, seq=s, tp=tp, forward=fwd, backward=bwd, forward_ckpt=fwd_c,
                      backward_ckpt=bwd_c, saved_bytes=saved_bytes(plain, params),
                      saved_bytes_ckpt=saved_bytes(ckpt, params), allocator_bytes=alloc, source=source,
                      precision=precision)
