"""The engine probe's process (planner/profiler/engine.py runs it as
`python -m planner.runtime.train.probe ARGS_JSON OUT_JSON`): the executor's DeepSpeed engine
(gloo), built exactly as `planner run` builds it (build_engine, ds_config, the client AdamW),
steps timed the way the executor's loop times them (forward, loss, backward, engine.step per
micro-batch; under a pipeline engine.train_batch over the step's micro-batches, as
planner/runtime/train/loop.py runs it).

ARGS_JSON: port, model, b, s, precisions, threads, and optionally world (processes, default 1),
rank, and layouts: [{"name", "dp", "pp", "zero"}] run on those `world` processes (default one layout
"1" of one process). Each step's time is the slowest rank's; rank 0 writes the rows."""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any

ACCUMULATIONS = (1, 4)
STEPS, WARMUP = 4, 2


def run(port: int, model: dict[str, Any], b: int, s: int, precisions: list[str], threads: int, out_path: str,
        world: int = 1, rank: int = 0, layouts: list[dict[str, Any]] | None = None, steps: int = STEPS,
        warmup: int = WARMUP) -> None:
    """Time steps of 1 and 4 micro-batches per layout and precision; rank 0 writes the rows."""
    import statistics

    import torch
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(threads)
    import deepspeed
    import torch.distributed as dist
    deepspeed.init_distributed(dist_backend="gloo")  # as the executor's worker (planner/runtime/train/loop.py)
    from planner.dsconfig import ds_config
    from planner.runtime.train.build import build_engine
    from planner.specs import parse_cluster
    from planner.specs.model import ModelSpec
    from planner.specs.plan import Plan
    from planner.specs.train import TrainSpec
    b0 = b
    cluster = parse_cluster(f"{world}xcpu")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # the config's monitors write under the working directory, as in a run directory
        for lay in layouts or [{"name": "1", "dp": 1, "pp": 1}]:
            # a layout may name another model and micro-batch (the ZeRO-2 probe's second size)
            spec = ModelSpec.from_dict(lay.get("model", model))
            b = lay.get("b", b0)
            for prec in lay.get("precisions", precisions):
                for m in ACCUMULATIONS:
                    plan = Plan(dp=lay.get("dp", 1), pp=lay.get("pp", 1), zero=lay.get("zero", 0), micro_batch=b,
                                grad_accum=m, precision=prec)
                    train = TrainSpec(global_batch=b * m * plan.dp, seq_len=s, precision=prec)
                    engine, _ = build_engine(plan, spec, ds_config(plan, spec, train, cluster))
                    g = torch.Generator().manual_seed(0)
                    ids = torch.randint(0, spec.vocab, (b, s), generator=g)
                    pos = torch.arange(s).expand(b, s).contiguous()
                    seg = torch.ones(b, s, dtype=torch.long)
                    times = []
                    for step in range(warmup + steps):
                        if world > 1:
                            dist.barrier()
                        t0 = time.perf_counter()
                        if plan.pp > 1:
                            engine.train_batch(data_iter=iter([((ids, pos, seg), ids)] * m))
                        else:
                            for _ in range(m):
                                logits = engine(ids, pos, seg)
                                loss = engine.module.loss_fn(logits, ids)
                                del logits
                                engine.backward(loss)
                                engine.step()
                                float(loss.detach())
                        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                        if world > 1:
                            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
                        if step >= warmup:
                            times.append(float(dt.item()))
                    rows.append({"layout": lay["name"], "dp": plan.dp, "pp": plan.pp, "zero": plan.zero,
                                 "processes": world,
                                 "precision": prec, "micro_batch": b, "seq": s, "grad_accum": m,
                                 "step_s": statistics.median(times), "steps": times,
                                 **({"model": spec.name} if "model" in lay else {})})
                    del engine
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump(rows, fh)
    torch.distributed.destroy_process_group()


def main() -> int:
    a = json.loads(sys.argv[1])
    run(a["port"], a["model"], a["b"], a["s"], a["precisions"], a["threads"], sys.argv[2],
        world=a.get("world", 1), rank=a.get("rank", 0), layouts=a.get("layouts"), steps=a.get("steps", STEPS),
        warmup=a.get("warmup", WARMUP))
    return 0


if __name__ == "__main__":
    sys.exit(main())
