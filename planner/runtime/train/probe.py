"""The engine probe's process (planner/profiler/engine.py runs it as
`python -m planner.runtime.train.probe ARGS_JSON OUT_JSON`): the executor's DeepSpeed engine on
one process (gloo, world size 1), built exactly as `planner run` builds it (build_engine,
ds_config, the client AdamW), steps timed the way the executor's loop times them (forward,
loss, backward, engine.step per micro-batch)."""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any

ACCUMULATIONS = (1, 4)
STEPS, WARMUP = 4, 2


def run(port: int, model: dict[str, Any], b: int, s: int, precisions: list[str], threads: int, out_path: str) -> None:
    """Time steps of 1 and 4 micro-batches per precision; write the rows to out_path."""
    import statistics

    import torch
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(threads)
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")  # as the executor's worker (planner/runtime/train/loop.py)
    from planner.dsconfig import ds_config
    from planner.runtime.train.build import build_engine
    from planner.specs import parse_cluster
    from planner.specs.model import ModelSpec
    from planner.specs.plan import Plan
    from planner.specs.train import TrainSpec
    spec = ModelSpec.from_dict(model)
    cluster = parse_cluster("1xcpu")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # the config's monitors write under the working directory, as in a run directory
        for prec in precisions:
            for m in ACCUMULATIONS:
                plan = Plan(micro_batch=b, grad_accum=m, precision=prec)
                train = TrainSpec(global_batch=b * m, seq_len=s, precision=prec)
                engine, _ = build_engine(plan, spec, ds_config(plan, spec, train, cluster))
                g = torch.Generator().manual_seed(0)
                ids = torch.randint(0, spec.vocab, (b, s), generator=g)
                pos = torch.arange(s).expand(b, s).contiguous()
                seg = torch.ones(b, s, dtype=torch.long)
                times = []
                for step in range(WARMUP + STEPS):
                    t0 = time.perf_counter()
                    for _ in range(m):
                        logits = engine(ids, pos, seg)
                        loss = engine.module.loss_fn(logits, ids)
                        del logits
                        engine.backward(loss)
                        engine.step()
                        float(loss.detach())
                    if step >= WARMUP:
                        times.append(time.perf_counter() - t0)
                rows.append({"precision": prec, "micro_batch": b, "seq": s, "grad_accum": m,
                             "step_s": statistics.median(times), "steps": times})
                del engine
    with open(out_path, "w") as fh:
        json.dump(rows, fh)
    torch.distributed.destroy_process_group()


def main() -> int:
    args = json.loads(sys.argv[1])
    run(args["port"], args["model"], args["b"], args["s"], args["precisions"], args["threads"], sys.argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main())
