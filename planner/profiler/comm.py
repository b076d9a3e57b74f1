"""Collective benchmarks as real multi-process jobs (gloo on CPU, NCCL on GPU).

One job per group size n: n processes started with torch.multiprocessing (spawn), each
timing all-reduce, all-gather, reduce-scatter and ring send/recv over a sweep of message
sizes the way nccl-tests does (warm-up, then a timed loop of back-to-back calls; the time of
a call is the slowest rank's). Rank 0 writes the results to a file the parent reads back;
progress comes through a queue. A job that fails or hangs is stopped (only our own child
processes) and reported as one line.
"""
from __future__ import annotations

import json
import os
import queue as queue_mod
import sys
import tempfile
import time
import warnings
from typing import Any, Callable

from planner.errors import PlannerError
from planner.rundir import atomic_write_json
from planner.runtime.procs import free_port
from planner.profiler.fit import OPS, bus_factor, fit_alpha_beta


class ProfilingError(PlannerError):
    """A measurement job failed or hung."""


def group_sizes(procs: int) -> list[int]:
    """Powers of two from 2 up to procs, and procs itself."""
    out, n = [], 2
    while n <= procs:
        out.append(n)
        n *= 2
    if procs >= 2 and procs not in out:
        out.append(procs)
    return out


def message_sizes(quick: bool, kind: str) -> list[int]:
    """Bytes: 4 KB .. 16 MB (quick) or 1 KB .. 256 MB on CPU / 1 GB on GPU, x4 apart."""
    lo, hi = (4 << 10, 16 << 20) if quick else (1 << 10, (256 << 20) if kind == "cpu" else (1 << 30))
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 4
    return out


def _op(name: str, n: int, rank: int, numel: int, device: str) -> Callable[[], None]:
    import torch
    import torch.distributed as dist
    warnings.filterwarnings("ignore", category=FutureWarning)
    if name == "all_reduce":
        x = torch.ones(numel, device=device)
        return lambda: dist.all_reduce(x)
    if name == "all_gather":
        out, x = torch.empty(numel, device=device), torch.ones(numel // n, device=device)
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: fn(out, x)
    if name == "reduce_scatter":
        out, x = torch.empty(numel // n, device=device), torch.ones(numel, device=device)
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: fn(out, x)
    send, recv = torch.ones(numel, device=device), torch.empty(numel, device=device)

    def ring() -> None:  # nccl-tests sendrecv: every rank sends to the next, receives from the previous
        reqs = [dist.isend(send, (rank + 1) % n), dist.irecv(recv, (rank - 1) % n)]
        for r in reqs:
            r.wait()
    return ring


def in_step(rank: int, n: int, block: dict[str, Any], repeats: int, sync: Callable[[], None],
            device: str) -> list[dict[str, Any]]:
    """TP all-reduces as they run inside autograd: the executor's block (planner.model.block.Block)
    of one rank of TP n, forward + backward, with its TP group (2 all-reduces of b s h forward,
    2 backward: planner.cost.tp.tp_block_comm) and without it (group None: the same block,
    no collectives), alternating, each timed as the slowest rank's; the difference / 4 is one
    all-reduce of b s h elements in the step. [] when the model's heads, KV groups or FFN do
    not split n ways."""
    import torch
    import torch.distributed as dist
    from planner.profiler.block import executor_block
    from planner.profiler.gemm import DTYPES
    from planner.specs.model import ModelSpec
    model = ModelSpec.from_dict(block["model"])
    if model.heads % n or model.kv_heads % n or model.ffn_hidden % n:
        return []
    rows = []
    for prec in block["precisions"]:
        dtype = getattr(torch, DTYPES[prec])
        for b, s in block["points"]:
            made = {}
            for with_comm in (False, True):
                torch.manual_seed(0)
                found = executor_block(model, n, group=dist.group.WORLD if with_comm else None, rank=rank)
                if found is None:
                    return []
                made[with_comm] = found[0].to(device=device, dtype=dtype)
            x = torch.randn(b, s, model.hidden, device=device, dtype=dtype, requires_grad=True)
            grad = torch.randn(b, s, model.hidden, device=device, dtype=dtype)
            times: dict[bool, list[float]] = {False: [], True: []}
            for i in range(repeats + 1):  # the first round is warm-up
                for with_comm in (False, True):
                    dist.barrier()
                    t0 = time.perf_counter()
                    made[with_comm](x).backward(grad)
                    sync()
                    tt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
                    dist.all_reduce(tt, op=dist.ReduceOp.MAX)
                    x.grad = None
                    if i:
                        times[with_comm].append(float(tt.item()))
            plain, comm_ = sorted(times[False])[len(times[False]) // 2], sorted(times[True])[len(times[True]) // 2]
            rows.append({"precision": prec, "micro_batch": b, "seq": s, "n": n,
                         "bytes": b * s * model.hidden * torch.finfo(dtype).bits // 8,
                         "block_s": plain, "block_with_tp_s": comm_, "per_all_reduce_s": (comm_ - plain) / 4.0,
                         "all_reduces_per_block": 4})
    return rows


def _worker(rank: int, n: int, port: int, sizes: list[int], repeats: int, window_s: float,
            out_path: str, q: Any, backend: str, block: dict[str, Any] | None = None) -> None:
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
    import datetime
    dist.init_process_group(backend, rank=rank, world_size=n, timeout=datetime.timedelta(seconds=120))
    sync = torch.cuda.synchronize if backend == "nccl" else (lambda: None)
    results: list[dict[str, Any]] = []
    for op in OPS:
        for nbytes in sizes:
            numel = max(n, nbytes // 4 // n * n)  # float32, divisible by n
            fn = _op(op, n, rank, numel, device)
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            sync()
            probe = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
            dist.all_reduce(probe, op=dist.ReduceOp.MAX)
            iters = int(max(1, min(100, window_s / max(float(probe.item()), 1e-6))))
            per_call = []
            for _ in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                sync()
                per_call.append((time.perf_counter() - t0) / iters)
            tt = torch.tensor(per_call, dtype=torch.float64, device=device)
            dist.all_reduce(tt, op=dist.ReduceOp.MAX)  # a collective takes as long as its slowest rank
            if rank == 0:
                results.append({"op": op, "n": n, "bytes": numel * 4, "iters": iters, "times": tt.tolist()})
                q.put((op, n, numel * 4))
            del fn
    steps = in_step(rank, n, block, repeats, sync, device) if block else []
    if rank == 0:  # whole or not at all: the parent reads the file only once it is complete
        atomic_write_json(out_path, {"collectives": results, "in_step": steps})
    dist.barrier()
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: C++ threads of gloo / torch still joinable when static
    # destructors run abort the process ("terminate called without an active exception", seen once in
    # CI on a run whose measurements were complete). The queue is flushed first.
    q.close()
    q.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_group(n: int, sizes: list[int], *, backend: str, repeats: int = 3, window_s: float = 0.05,
              timeout_s: float = 600.0, tick: Callable[[str], None] = lambda _: None,
              block: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run the sweep on n processes; returns rank 0's raw results: {"collectives": [...],
    "in_step": [...]} (in_step: the TP all-reduce inside autograd, when `block` = {"model":
    ModelSpec dict, "points": [(b, s)], "precisions": [...]} is given)."""
    import torch.multiprocessing as mp
    ctx_mp = mp.get_context("spawn")
    q = ctx_mp.Queue()
    fd, out_path = tempfile.mkstemp(prefix="planner-comm-", suffix=".json")
    os.close(fd)
    try:
        ctx = mp.start_processes(_worker, args=(n, free_port(), sizes, repeats, window_s, out_path, q, backend, block),
                                 nprocs=n, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=0.2):
                _drain(q, tick)
                if time.monotonic() > deadline:
                    raise ProfilingError(f"collectives on {n} processes", f"did not finish in {timeout_s:.0f} s",
                                         "run with --quick or fewer --procs")
        except mp.ProcessRaisedException as exc:
            last = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise ProfilingError(f"collectives on {n} processes", f"a rank failed: {last}",
                                 "check that the backend works (gloo on CPU, NCCL on GPU)") from None
        except mp.ProcessExitedException as exc:
            done = _read_results(out_path)
            if done is None:
                raise ProfilingError(f"collectives on {n} processes", f"rank {exc.error_index} exited ({exc.exit_code})",
                                     "check memory and the backend") from None
            # rank 0 wrote every measurement before the final barrier: a rank that died in the
            # teardown after it did not spoil them (the note says so in the profile)
            done["teardown"] = f"rank {exc.error_index} exited ({exc.exit_code}) after the measurements were written"
            return done
        finally:
            for p in ctx.processes:  # only our own children
                if p.is_alive():
                    p.terminate()
                    p.join(5)
        _drain(q, tick)
        done = _read_results(out_path)
        if done is None:
            raise ProfilingError(f"collectives on {n} processes", "every rank exited but rank 0 wrote no results",
                                 "check memory and the backend")
        return done
    finally:
        os.unlink(out_path)


def _read_results(path: str) -> dict[str, Any] | None:
    """Rank 0's results, or None when it never wrote them (the file stays empty until then)."""
    try:
        with open(path) as fh:
            text = fh.read()
        return json.loads(text) if text else None
    except (OSError, ValueError):
        return None


def _drain(q: Any, tick: Callable[[str], None]) -> None:
    while True:
        try:
            op, n, nbytes = q.get_nowait()
        except (queue_mod.Empty, OSError, ValueError):
            return
        tick(f"{op} n={n} {nbytes >> 10} KiB")


def fit_in_step(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The in-step all-reduce as a link: all-reduce time = bytes x 2(n-1)/n / busbw + steps x
    latency (planner/cost/comm.py allreduce_time; steps = allreduce_steps(n)), an alpha-beta fit
    over the measured (bytes, per-all-reduce seconds); None with fewer than two sizes."""
    from planner.cost.comm import allreduce_steps
    pts = [(r["bytes"], r["per_all_reduce_s"]) for r in rows if r["per_all_reduce_s"] > 0]
    if len({b for b, _ in pts}) < 2:
        return None
    n = rows[0]["n"]
    fit = fit_alpha_beta("all_reduce", n, [b for b, _ in pts], [t for _, t in pts])
    return {"busbw_gbps": fit.busbw_gbps, "latency_us": fit.alpha_s * 1e6 / allreduce_steps(n),
            "points": fit.points, "max_rel_error": fit.max_rel_error}


def summarize_group(raw: list[dict[str, Any]] | dict[str, Any]) -> dict[str, Any]:
    """Per collective: points with median/min/max time, algbw and busbw, and the alpha-beta fit;
    "in_step": the TP all-reduce measured inside autograd, its rows and fit."""
    from planner.profiler.stats import summarize
    out: dict[str, Any] = {}
    if isinstance(raw, dict):
        steps = raw.get("in_step") or []
        if steps:
            out["in_step"] = {"rows": steps, "fit": fit_in_step(steps)}
        raw = raw["collectives"]
    for op in OPS:
        rows = [r for r in raw if r["op"] == op]
        if not rows:
            continue
        n = rows[0]["n"]
        points = []
        for r in rows:
            t = summarize(r["times"], "s")
            alg = r["bytes"] / t.median / 1e9
            points.append({"bytes": r["bytes"], "iters": r["iters"], "time_s": t.to_dict(),
                           "algbw_gbps": alg, "busbw_gbps": alg * bus_factor(op, n)})
        fit = fit_alpha_beta(op, n, [p["bytes"] for p in points], [p["time_s"]["median"] for p in points])
        for p in points:
            p["predicted_s"] = fit.predict(p["bytes"])
        out[op] = {"points": points, "fit": fit.to_dict()}
    return out
