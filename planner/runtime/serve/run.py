"""Measure serving on this machine: the generation engine driven by the load generator.

`run_serving(...)` builds the executor's GLM model (TP 1 in this process; TP > 1 as TP
ranks in separate gloo processes, started like planner/runtime/train/launch.py: one new process
group, killed on timeout), serves seeded requests with Poisson arrivals under continuous
batching, and writes serve_metrics.json atomically (the contract of issue 11):

  ttft_s {mean, p50, p99}, tpot_s {mean, p50, p99}, e2e_s {mean, p50, p99}, achieved_qps,
  requests (finished), requests_offered, rate_qps, deployment {tp, replicas, max_batch,
  precision, prefill_chunk}, model (ModelSpec.to_dict()), workload, decode_steps
  [{batch, context_tokens, time_s, host_s, after_idle}], prefills [{tokens, time_s, host_s,
  after_idle}], wall_s, timed_out.

TTFT runs from a request's arrival to its first token (queueing included); TPOT is
(finish - first token) / (tokens - 1) per request; achieved QPS is finished requests over the
time from the first arrival to the last finish. Times are taken after a warm-up
(warm_up_requests: each prompt length of the run once, and every decode batch size, served and
discarded). Each step also records host_s, the engine's own seconds before it (generate.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from planner.errors import ExecutionError, SpecError
from planner.rundir import atomic_write_json, load_run
from planner.runtime.procs import RankGroup, rank_env
from planner.specs.model import ModelSpec

METRICS_FILE = "serve_metrics.json"
PRECISIONS = {"fp32": "float32", "bf16": "bfloat16"}


def _stats(values: list[float], keys=("mean", "p50", "p99")) -> dict[str, float | None]:
    if not values:
        return {k: None for k in keys}
    a = np.asarray(values, dtype=float)
    every = {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}
    return {k: every[k] for k in keys}


def summarise(finished: list, offered: int, prefills: list[dict], decode_steps: list[dict]) -> dict[str, Any]:
    """The measured figures of one serving run from its finished requests and step timings."""
    ttft = [r.first_token_s - r.arrival_s for r in finished]
    tpot = [(r.finish_s - r.first_token_s) / (len(r.tokens) - 1) for r in finished if len(r.tokens) > 1]
    e2e = [r.finish_s - r.arrival_s for r in finished]
    span = (max(r.finish_s for r in finished) - min(r.arrival_s for r in finished)) if finished else 0.0
    return {"ttft_s": _stats(ttft), "tpot_s": _stats(tpot), "e2e_s": _stats(e2e),
            "achieved_qps": len(finished) / span if span > 0 else 0.0,
            "requests": len(finished), "requests_offered": offered,
            "output_tokens": sum(len(r.tokens) for r in finished),
            "decode_steps": decode_steps, "prefills": prefills}


def _resolve(run_dir_or_model: Any, out_dir: str | Path | None) -> tuple[ModelSpec, Path]:
    if isinstance(run_dir_or_model, ModelSpec):
        if out_dir is None:
            raise SpecError("out_dir", "is needed when serving a ModelSpec rather than a run directory",
                            "pass out_dir=... (or --out)")
        return run_dir_or_model, Path(out_dir)
    run = Path(run_dir_or_model)
    _, model, _, _, _ = load_run(run)
    return model, Path(out_dir) if out_dir is not None else (run if run.is_dir() else run.parent)


def run_serving(run_dir_or_model: Any, *, tp: int = 1, max_batch: int = 1, workload: Any, rate_qps: float,
                requests: int, seed: int = 0, timeout_s: float = 120.0, precision: str = "fp32",
                out_dir: str | Path | None = None, weights_seed: int = 1234,
                threads: int | None = None) -> dict[str, Any]:
    """Serve `requests` seeded requests arriving at `rate_qps` (Poisson) with the model of
    `run_dir_or_model` (a run directory with plan.json, or a ModelSpec with `out_dir`) on `tp`
    TP ranks with `max_batch` cache slots; returns the metrics and writes
    out_dir/serve_metrics.json (default: the run directory). Requests still running at
    `timeout_s` are dropped (timed_out: true). `threads`: torch threads per rank (default: the
    cores over the TP ranks; 1 keeps runs comparable on a machine shared with other work)."""
    from planner.runtime.serve.loadgen import as_workload, make_requests
    spec, out = _resolve(run_dir_or_model, out_dir)
    w = as_workload(workload)
    if tp < 1 or spec.heads % tp or spec.kv_heads % tp or spec.ffn_hidden % tp:
        raise SpecError("--tp", f"TP {tp} must divide the heads ({spec.heads}), KV groups ({spec.kv_heads}) "
                        f"and FFN size ({spec.ffn_hidden})", "use a divisor, e.g. --tp 1 or 2")
    if tp > (os.cpu_count() or 1):
        raise SpecError("--tp", f"TP {tp} needs {tp} processes, this machine has {os.cpu_count()} cores",
                        f"use --tp <= {os.cpu_count()}")
    if precision not in PRECISIONS:
        raise SpecError("--precision", f"unknown precision {precision!r}", f"use one of {', '.join(PRECISIONS)}")
    if max_batch < 1:
        raise SpecError("--max-batch", f"must be >= 1, got {max_batch}", "e.g. --max-batch 4")
    if not timeout_s > 0:
        raise SpecError("--timeout", f"must be > 0 s, got {timeout_s}", "e.g. --timeout 120")
    cores = os.cpu_count() or 1
    threads = threads if threads is not None else max(1, cores // tp)
    if threads < 1 or threads * tp > cores:
        raise SpecError("--threads", f"{threads} threads x TP {tp} do not fit this machine's {cores} cores",
                        f"use --threads <= {max(1, cores // tp)}")
    reqs = make_requests(w, rate_qps, requests, seed, spec.vocab, spec.max_seq)  # checks before any work
    cfg = {"model": spec.to_dict(), "tp": tp, "max_batch": max_batch, "workload": w.to_dict(),
           "rate_qps": rate_qps, "requests": requests, "seed": seed, "timeout_s": timeout_s,
           "precision": precision, "weights_seed": weights_seed,
           "threads": threads, "max_len": max(len(r.prompt) + r.output_len for r in reqs)}
    start = time.perf_counter()
    if tp == 1:
        import torch
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            result = serve(cfg)
        finally:
            torch.set_num_threads(before)
    else:
        result = _spawn(cfg)
    metrics = {"status": "ok", **{k: result[k] for k in ("ttft_s", "tpot_s", "e2e_s", "achieved_qps", "requests",
                                                         "requests_offered", "output_tokens")},
               "rate_qps": rate_qps, "timed_out": result["timed_out"],
               "deployment": {"tp": tp, "replicas": 1, "max_batch": max_batch, "precision": precision,
                              "prefill_chunk": 0, "kv_cache": "padded", "threads_per_rank": threads},
               "model": spec.to_dict(), "workload": w.to_dict(), "seed": seed,
               "wall_s": time.perf_counter() - start,
               "decode_steps": result["decode_steps"], "prefills": result["prefills"]}
    atomic_write_json(out / METRICS_FILE, metrics)
    return metrics


def serve(cfg: dict[str, Any], tp_group: Any = None) -> dict[str, Any]:
    """One rank's part: build the TP slice, warm up, serve; rank 0 returns the measurements."""
    import torch

    from planner.runtime.serve.generate import CachedForward, Engine, build_model
    from planner.runtime.serve.loadgen import make_requests
    from planner.model.parallel.groups import SINGLE
    spec = ModelSpec.from_dict(cfg["model"])
    tp = tp_group or SINGLE
    dtype = getattr(torch, PRECISIONS[cfg["precision"]])
    model = build_model(spec, tp, seed=cfg["weights_seed"], dtype=dtype)
    engine = Engine(CachedForward(model, spec, tp), cfg["max_batch"], cfg["max_len"], dtype)
    if tp.rank != 0:
        engine.follow()  # warm-up
        engine.follow()
        return {}
    reqs = make_requests(cfg["workload"], cfg["rate_qps"], cfg["requests"], cfg["seed"], spec.vocab, spec.max_seq)
    engine.run(warm_up_requests(reqs, cfg["max_batch"], cfg["max_len"]))
    engine.prefills.clear()
    engine.decode_steps.clear()
    finished = engine.run(reqs, deadline_s=cfg["timeout_s"])
    out = summarise(finished, len(reqs), engine.prefills, engine.decode_steps)
    out["timed_out"] = len(finished) < len(reqs)
    if cfg.get("record_tokens"):  # the tests compare the generated tokens with the plain model's
        out["outputs"] = {str(r.rid): r.tokens for r in finished}
    return out


def warm_up_requests(reqs: list, max_batch: int, max_len: int) -> list:
    """Requests served and discarded before the timed run: one per distinct prompt length of
    `reqs`, all at time 0, with 2, 3, ... max_batch + 1 output tokens, so every prefill shape
    and every decode batch size the run will meet has been executed once (the CPU kernels
    build per shape on first use, as vLLM captures a CUDA graph per batch size at start-up)."""
    from planner.runtime.serve.generate import Request
    lengths = sorted({len(r.prompt) for r in reqs})
    return [Request(rid=-1 - i, prompt=[1] * p, output_len=max(1, min(2 + i % max_batch, max_len - p)))
            for i, p in enumerate(lengths)]


def _spawn(cfg: dict[str, Any]) -> dict[str, Any]:
    """TP ranks as processes (torchrun's env, gloo), in one new process group killed on timeout."""
    tp = cfg["tp"]
    with tempfile.TemporaryDirectory(prefix="planner-serve-") as tmp:
        cfg_file, result_file = Path(tmp) / "config.json", Path(tmp) / "result.json"
        atomic_write_json(cfg_file, cfg)
        env = rank_env(tp, OMP_NUM_THREADS=str(cfg.get("threads", 1)))
        cmd = [sys.executable, "-m", "planner.runtime.serve.run", "--config", str(cfg_file),
               "--result", str(result_file)]
        group = RankGroup()
        procs = group.procs
        logs = [open(Path(tmp) / f"rank{r}.log", "w+") for r in range(tp)]
        try:
            for r in range(tp):
                group.start(cmd, r, env, logs[r])
            deadline = time.monotonic() + cfg["timeout_s"] + 120  # build and warm-up come on top
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                if any(p.poll() not in (None, 0) for p in procs):
                    break
                time.sleep(0.1)
        finally:
            group.stop()
        codes = [p.poll() for p in procs]
        if codes != [0] * tp or not result_file.exists():
            bad = next((r for r, c in enumerate(codes) if c != 0), 0)
            logs[bad].seek(0)
            tail = " | ".join(ln for ln in logs[bad].read().splitlines() if ln.strip())[-400:]
            for f in logs:
                f.close()
            what = "did not finish in time" if codes[bad] is None or codes[bad] < 0 else f"exited with {codes[bad]}"
            raise ExecutionError(f"serving rank {bad}", f"{what}: {tail}", "see the message; raise --timeout if slow")
        for f in logs:
            f.close()
        return json.loads(result_file.read_text())


def _worker(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    from planner.errors import PlannerError
    from planner.model.parallel.groups import TPGroup
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--result", required=True)
    args = p.parse_args(argv)
    cfg = json.loads(Path(args.config).read_text())
    dist.init_process_group("gloo")
    try:
        rank, size = dist.get_rank(), dist.get_world_size()
        tp = TPGroup(rank=rank, size=size, group=dist.new_group(list(range(size))))
        out = serve(cfg, tp)
        if rank == 0:
            atomic_write_json(args.result, out)
    except PlannerError as exc:
        print(exc.line(), file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_worker())
