"""The training loop's one collective per step (planner/runtime/train/loop.py): the step's loss
from the ranks holding it, whether any rank went non-finite, the real and padded tokens, and
each rank's own slot of figures (step time, peak memory, all-reduce time and calls, GPU
utilisation); and the gradient norm and GPU utilisation it reads."""
from __future__ import annotations

import math

import torch

from planner.runtime.observe.measure import peak_bytes


PER_RANK = 5
"""Values each rank contributes to the per-step collective (see the step loop)."""


def gather_step(run, b: int, loss: float, gnorm: float | None, dt: float, ar_s: float,
                ar_n: int) -> tuple[float, bool, int, int, list[dict]]:
    """One collective per step: loss (from ranks holding it), bad flag, real/padded tokens, and
    each rank's own slot: step time, peak memory, time and calls in all-reduce, GPU
    utilisation. Returns (step loss, any rank bad, real tokens, tokens, per-rank figures). `run` is
    the rank's Training (loop.py); sets its holds_loss."""
    plan, world, rank = run.plan, run.world, run.rank
    run.holds_loss = (run.last_stage or not run.pipe) and run.tp_i == 0
    reads = run.pp_i == 0 and run.tp_i == 0 and run.cp_i == 0  # one reader per micro-batch
    real = sum(run.rows.real_tokens(i) for m in range(plan.grad_accum)
               for i in run.layout.rows(b, m, run.dp_i)) if reads else 0
    total = plan.grad_accum * plan.micro_batch * run.trainspec.seq_len if reads else 0
    bad = 0.0 if (math.isfinite(loss) and (gnorm is None or math.isfinite(gnorm))) else 1.0
    vec = torch.zeros(5 + PER_RANK * world, dtype=torch.float64)
    vec[:5] = torch.tensor([loss if (run.holds_loss and not bad) else 0.0, 1.0 if run.holds_loss else 0.0, bad,
                            float(real), float(total)], dtype=torch.float64)
    vec[5 + PER_RANK * rank:5 + PER_RANK * (rank + 1)] = torch.tensor(
        [dt, float(peak_bytes(run.device)), ar_s, float(ar_n), gpu_util(run.device)], dtype=torch.float64)
    run.dist.all_reduce(vec)
    if run.timer is not None:
        run.timer.take()  # not the step's own traffic
    per_rank = [dict(zip(("time_s", "peak_memory_bytes", "allreduce_seconds", "allreduce_calls",
                          "gpu_utilization_percent"), vec[5 + PER_RANK * r:5 + PER_RANK * (r + 1)].tolist()))
                for r in range(world)]
    for m in per_rank:
        if m["gpu_utilization_percent"] < 0:
            m["gpu_utilization_percent"] = None
    return (vec[0].item() / max(vec[1].item(), 1.0), vec[2].item() > 0, int(vec[3].item()), int(vec[4].item()),
            per_rank)


def grad_norm(engine) -> float | None:
    try:
        g = engine.get_global_grad_norm()
    except Exception:  # some optimizer wrappers do not track it
        return None
    if g is None:
        return None
    return float(g.item() if isinstance(g, torch.Tensor) else g)


def gpu_util(device: str) -> float:
    """torch.cuda.utilization() (needs pynvml / amdsmi); -1 where unavailable (CPU runs)."""
    if device != "cuda":
        return -1.0
    try:
        return float(torch.cuda.utilization())
    except Exception:  # no NVML in this environment
        return -1.0
