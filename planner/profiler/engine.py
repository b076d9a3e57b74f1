"""The framework's own costs per micro-batch and per optimizer step, as the executor runs them.

One process (gloo, world size 1) builds the executor's DeepSpeed engine for the profiled model
(planner.runtime.train.build.build_engine with planner.dsconfig.ds_config: the same module,
config and client AdamW as `planner run`) in each precision, with 1 and 4 micro-batches per step,
and times whole steps the way the executor's loop does (forward, loss, backward, engine.step per
micro-batch). Per precision:

    per micro-batch = (step with 4 - step with 1) / 3,  per step = step with 1 - per micro-batch,

and what the cost model's terms leave of them (planner.profiler.write.step_section): the
micro-batch's blocks (through the block probe), embedding and head, and the optimizer's
memory-bound update are subtracted; the rest is step.framework.<precision> (planner/specs/step.py).
No communication: one process. A failure is reported as a note; the profile is written without it.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

from planner.errors import PlannerError
from planner.runtime.procs import free_port

ACCUMULATIONS = (1, 4)
STEPS, WARMUP = 4, 2


def _worker(rank: int, port: int, model: dict[str, Any], b: int, s: int, precisions: list[str], threads: int,
            out_path: str) -> None:
    import statistics

    import torch
    import torch.distributed as dist
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
    dist.destroy_process_group()


def measure(model: dict[str, Any], b: int, s: int, precisions: list[str], threads: int,
            timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """Run the engine probe in a spawned process; its rows (one per precision and accumulation)."""
    import torch.multiprocessing as mp
    fd, out_path = tempfile.mkstemp(prefix="planner-engine-", suffix=".json")
    os.close(fd)
    try:
        ctx = mp.start_processes(_worker, args=(free_port(), model, b, s, precisions, threads, out_path), nprocs=1,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=0.2):
                if time.monotonic() > deadline:
                    raise PlannerError("engine probe", f"did not finish in {timeout_s:.0f} s",
                                       "profile without it (--quick on a loaded machine)")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            last = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise PlannerError("engine probe", f"the process failed: {last}", "check that DeepSpeed runs on this "
                               "machine (planner run of a 1xcpu plan)") from None
        finally:
            for p in ctx.processes:  # only our own child
                if p.is_alive():
                    p.terminate()
                    p.join(5)
        with open(out_path) as fh:
            return json.load(fh)
    finally:
        os.unlink(out_path)


def split(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per precision: measured seconds per micro-batch and per step (fixed part), from the
    steps with 1 and 4 micro-batches (ACCUMULATIONS)."""
    out = {}
    for prec in dict.fromkeys(r["precision"] for r in rows):
        by_m = {r["grad_accum"]: r["step_s"] for r in rows if r["precision"] == prec}
        lo, hi = min(by_m), max(by_m)
        if lo == hi:
            continue
        per_mb = (by_m[hi] - by_m[lo]) / (hi - lo)
        out[prec] = {"microbatch_s": per_mb, "step_s": by_m[lo] - lo * per_mb}
    return out
