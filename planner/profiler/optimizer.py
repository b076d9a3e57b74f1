"""The optimizer step as the executor runs it, per parameter, per precision (CPU step probe).

The executor's optimizer is a client torch.optim.AdamW (planner/runtime/train/build.py) that
DeepSpeed wraps: in fp32 it steps the module's own fp32 parameters; in bf16 the wrapper keeps
an fp32 master copy, turns the 16-bit gradients into fp32, steps AdamW on the master, and
copies it back into the 16-bit weights (deepspeed/runtime/bf16_optimizer.py and
fp16/fused_optimizer.py; ZeRO-1/2 the same over its flat partition). This probe times exactly
that sequence on flat tensors of two sizes with the host's per-rank threads, and fits

    step seconds = fixed_s + params x param_s                 (two sizes: the slope)

so the cost model's optimizer time (planner/cost/estimate.py optimizer_time) counts what a
step costs per parameter on this machine instead of the memory-bound ADAM_BYTES / copy
bandwidth (on a CPU the foreach AdamW runs several passes over each tensor and is compute-
bound on a single thread; measured here, not assumed). The fixed part stays in the framework
probe's per-step cost (planner/profiler/engine.py), which is measured minus this slope.
"""
from __future__ import annotations

from typing import Any

from planner.profiler.stats import time_call

SIZES = (2 << 20, 16 << 20)
"""Parameters per probe (2 Mi and 16 Mi): both beyond the last-level cache once the moments are
counted (16 bytes per parameter and more), as the lab's models are (chatglm3-6b tiny ~1.2 M
parameters, small ~38 M); the larger size keeps the slope above the per-call overhead."""

def step_fn(n: int, precision: str):
    """One optimizer step of n parameters as the executor's wrapper runs it (see module doc)."""
    import torch
    from planner.dsconfig import OPTIMIZER
    kw = dict(lr=OPTIMIZER["lr"], betas=tuple(OPTIMIZER["betas"]), eps=OPTIMIZER["eps"],
              weight_decay=OPTIMIZER["weight_decay"])
    master = torch.nn.Parameter(torch.randn(n, dtype=torch.float32) * 0.02)
    opt = torch.optim.AdamW([master], **kw)
    if precision == "fp32":
        master.grad = torch.randn(n, dtype=torch.float32) * 1e-3

        def step() -> None:
            opt.step()
        return step
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    weight = master.detach().to(dtype)
    grad16 = (torch.randn(n) * 1e-3).to(dtype)
    master.grad = torch.empty(n, dtype=torch.float32)

    def step() -> None:
        master.grad.copy_(grad16)           # the 16-bit gradients into the fp32 master's grad
        torch.linalg.vector_norm(master.grad)  # the gradient norm the wrapper clips / checks by
        opt.step()
        weight.copy_(master.detach())        # the master back into the 16-bit weights
    return step


def measure(precisions: list[str], threads: int, quick: bool = False,
            sizes: tuple[int, ...] = SIZES) -> list[dict[str, Any]]:
    """Rows {precision, params, time_s (Sample dict)} per precision and size."""
    import torch
    torch.set_num_threads(threads)
    rows = []
    for prec in precisions:
        for n in sizes:
            t = time_call(step_fn(n, prec), warmup=2, repeats=3 if quick else 7)
            rows.append({"precision": prec, "params": n, "time_s": t.to_dict(), "threads": threads})
    return rows


def fit(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per precision with two or more sizes: {param_s, fixed_s, points} through the smallest and
    largest size's medians (param_s = the slope; fixed_s kept >= 0)."""
    out = {}
    for prec in dict.fromkeys(r["precision"] for r in rows):
        pts = sorted((r["params"], r["time_s"]["median"]) for r in rows if r["precision"] == prec)
        if len(pts) < 2 or pts[-1][0] == pts[0][0]:
            continue
        (n0, t0), (n1, t1) = pts[0], pts[-1]
        slope = (t1 - t0) / (n1 - n0)
        if slope <= 0:
            continue
        out[prec] = {"param_s": slope, "fixed_s": max(t0 - slope * n0, 0.0), "points": len(pts)}
    return out
