"""Held-out evaluation of the training loop (--eval-every, --eval-batches; docs/trainer.md,
"Evaluation")."""
from __future__ import annotations

import torch


def evaluate(engine, eval_loader, plan, device: str, holds_loss: bool, pipe: bool) -> float:
    """Held-out loss over the eval batches, averaged over micro-batches, batches and DP ranks
    (counted on the ranks that hold a loss, like the training loss). No gradients, no update."""
    import deepspeed.comm as dist
    total = 0.0
    n = 0
    stream = iter(eval_loader)
    batches = len(eval_loader) // plan.grad_accum
    for _ in range(batches):
        micro = [next(stream) for _ in range(plan.grad_accum)]
        if pipe:
            it = iter(((ids.to(device), pos.to(device), seg.to(device)), lab.to(device)) for ids, pos, seg, lab in micro)
            total += float(engine.eval_batch(data_iter=it))
            n += 1
        else:
            engine.eval()
            try:
                with torch.no_grad():
                    for ids, pos, seg, lab in micro:
                        logits = engine(ids.to(device), pos.to(device), seg.to(device))
                        total += float(engine.module.loss_fn(logits, lab.to(device)))
                        n += 1
            finally:
                engine.train()
    if pipe:
        engine.train()
    mean = total / max(n, 1)
    vec = torch.tensor([mean if holds_loss else 0.0, 1.0 if holds_loss else 0.0], dtype=torch.float64)
    dist.all_reduce(vec)
    return vec[0].item() / max(vec[1].item(), 1.0)
