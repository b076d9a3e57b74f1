"""A seeded discrete-event simulation of one vLLM-style engine under continuous batching.

Requests arrive as a Poisson process (exponential gaps at rate lambda) with prompt and output
lengths drawn from the Workload. The engine runs one step at a time [Kwon et al. 2023, sec. 4.5;
Yu et al. 2022, Orca: iteration-level scheduling]:
- admission between steps, first come first served, while fewer than max_batch sequences run
  and the free KV blocks hold the request's whole prompt + output (ceil(len / block_size)
  blocks, reserved up front, so no preemption happens);
- a step is either a prefill of one admitted prompt (whole, or its next chunk of
  prefill_chunk tokens) or a decode of every sequence whose prompt is done (one token each).
  Without chunking prefills go first (vLLM's default scheduler); with chunking prefill chunks
  and decode steps alternate, a stand-in for SARATHI's mixed batches (Agrawal et al. 2023);
- the prefill's last step yields the first token (TTFT); a request leaves after its last
  decode, freeing its blocks.
Times per step come from planner/serve/cost.py. Common random numbers: the same seed gives the
same lengths and the same unit gaps at every rate, so latency is monotone enough in lambda to
bisect on.
"""
from __future__ import annotations

import math
import random
from collections import deque
from typing import Any, Callable

import numpy as np

from planner.serve.spec import Target, Workload

StepFn = Callable[[int, int], float]
SUSTAINABLE = 0.95
"""Highest share of the saturation throughput a latency target is searched up to."""


def _stats(x: list[float]) -> dict[str, float]:
    if not x:
        return {"mean": math.nan, "p50": math.nan, "p99": math.nan}
    a = np.asarray(x, dtype=float)
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}


def draw_requests(workload: Workload, rate_qps: float, n: int, seed: int,
                  max_total: int | None = None) -> tuple[list[tuple[int, int]], list[float]]:
    """The n requests that simulate() serves and planner/executor/loadgen.py sends: one
    random.Random(seed), first Workload.sample (n (prompt, output) lengths), then n exponential
    gaps of mean 1/rate_qps summed into arrival times (math.inf: all at 0, the gaps still drawn).
    One function, so a measured run and its simulation serve exactly the same requests."""
    if n < 1 or not rate_qps > 0:
        raise ValueError(f"need n >= 1 and rate > 0, got {n}, {rate_qps}")
    rng = random.Random(seed)
    lens = workload.sample(n, rng, max_total)
    arrival, t = [], 0.0
    for _ in lens:
        gap = rng.expovariate(1.0)
        t += 0.0 if math.isinf(rate_qps) else gap / rate_qps
        arrival.append(t)
    return lens, arrival


def simulate(prefill_fn: StepFn, decode_fn: StepFn, workload: Workload, rate_qps: float, *, requests: int = 300,
             seed: int | None = None, max_batch: int = 1, kv_blocks: int | None = None, block_size: int = 16,
             prefill_chunk: int = 0, max_total: int | None = None, wake_s: float = 0.0) -> dict[str, Any]:
    """Serve `requests` requests arriving at `rate_qps` (math.inf: all at time 0) on one engine.

    prefill_fn(tokens, context) and decode_fn(batch, context_tokens) give step seconds
    (context_tokens: tokens attended by the whole batch, each sequence's cached tokens plus its
    new one). wake_s: added to the first step after the engine sat idle waiting for an arrival
    (cost.SERVE_DEFAULTS serve_wake_s; the first step of all included). Returns mean/p50/p99 of ttft_s, tpot_s (per output token after the first) and
    e2e_s, the achieved throughput and the steps run."""
    if requests < 1 or not rate_qps > 0:
        raise ValueError(f"need requests >= 1 and rate > 0, got {requests}, {rate_qps}")
    lens, arrival = draw_requests(workload, rate_qps, requests, workload.seed if seed is None else seed, max_total)
    prompt = [p for p, _ in lens]
    out = [o for _, o in lens]
    need = [math.ceil((p + o) / block_size) for p, o in lens]
    free = math.inf if kv_blocks is None else kv_blocks
    done_pre = [0] * requests
    gen = [0] * requests
    first = [math.nan] * requests
    finish = [math.nan] * requests
    waiting: deque[int] = deque()
    prefilling: deque[int] = deque()
    decoding: list[int] = []
    ctx_sum = 0
    nxt, finished, now, last_decode, steps, idle = 0, 0, 0.0, True, 0, True
    while finished < requests:
        while nxt < requests and arrival[nxt] <= now:
            waiting.append(nxt)
            nxt += 1
        while waiting and len(prefilling) + len(decoding) < max_batch and need[waiting[0]] <= free:
            i = waiting.popleft()
            free -= need[i]
            prefilling.append(i)
        if not prefilling and not decoding:
            if waiting:
                raise ValueError(f"request of {prompt[waiting[0]] + out[waiting[0]]} tokens needs "
                                 f"{need[waiting[0]]} KV blocks, the cache has {kv_blocks}")
            now = arrival[nxt]
            idle = True
            continue
        steps += 1
        if idle:
            now += wake_s
            idle = False
        if prefilling and (prefill_chunk == 0 or not decoding or last_decode):
            i = prefilling[0]
            n = prompt[i] - done_pre[i]
            if prefill_chunk:
                n = min(n, prefill_chunk)
            now += prefill_fn(n, done_pre[i])
            done_pre[i] += n
            last_decode = False
            if done_pre[i] == prompt[i]:
                prefilling.popleft()
                first[i], gen[i] = now, 1
                if gen[i] >= out[i]:
                    finish[i], finished, free = now, finished + 1, free + need[i]
                else:
                    decoding.append(i)
                    ctx_sum += prompt[i] + 1
            continue
        now += decode_fn(len(decoding), ctx_sum)
        last_decode = True
        still = []
        for i in decoding:
            gen[i] += 1
            if gen[i] >= out[i]:
                finish[i], finished, free = now, finished + 1, free + need[i]
                ctx_sum -= prompt[i] + gen[i] - 1
            else:
                still.append(i)
                ctx_sum += 1
        decoding = still
    ttft = [f - a for f, a in zip(first, arrival)]
    e2e = [f - a for f, a in zip(finish, arrival)]
    tpot = [(e - f) / (o - 1) for e, f, o in zip(finish, first, out) if o > 1]
    span = max(finish) - min(arrival)
    return {"requests": requests, "rate_qps": rate_qps, "ttft_s": _stats(ttft), "tpot_s": _stats(tpot),
            "e2e_s": _stats(e2e), "achieved_qps": requests / span if span > 0 else math.inf,
            "output_tokens_per_s": sum(out) / span if span > 0 else math.inf, "steps": steps}


def replica_runner(model: Any, cluster: Any, dep: Any, workload: Workload, mem: dict[str, Any], *,
                   requests: int = 300, seed: int | None = None) -> Callable[[float], dict[str, Any]]:
    """rate (all replicas) -> simulate() of one replica at rate / replicas (a Poisson stream split
    evenly is Poisson), with its achieved throughput scaled back to all replicas."""
    from planner.serve.cost import serve_factor, step_fns
    prefill, decode = step_fns(model, cluster, dep)
    wake = serve_factor(cluster, "serve_wake_s")
    cache: dict[float, dict[str, Any]] = {}

    def run(rate: float) -> dict[str, Any]:
        if rate not in cache:
            r = simulate(prefill, decode, workload, rate / dep.replicas, requests=requests, seed=seed,
                         max_batch=min(dep.max_batch, mem["batch_limit"]), kv_blocks=mem["kv_blocks"],
                         block_size=dep.block_size, prefill_chunk=dep.prefill_chunk, max_total=workload.max_total(),
                         wake_s=wake)
            r["rate_qps"] = rate
            r["achieved_qps"] *= dep.replicas
            r["output_tokens_per_s"] *= dep.replicas
            cache[rate] = r
        return cache[rate]
    return run


def saturation_qps(run: Callable[[float], dict[str, Any]]) -> float:
    """Throughput with every request queued at time 0: the most requests/s the engine completes."""
    return run(math.inf)["achieved_qps"]


def metric_value(stats: dict[str, Any], target: Target) -> float:
    return stats[f"{target.metric}_s"][target.kind]


def qps_at_target(run: Callable[[float], dict[str, Any]], target: Target, max_qps: float, *,
                  iters: int = 12) -> float | None:
    """Highest arrival rate (requests/s) meeting `target`, or None when none does.

    Latency targets: bisection on (0, max_qps] of the simulated percentile of the target's
    metric, which grows with the rate (queueing, bigger batches), up to SUSTAINABLE x max_qps (a
    finite simulation at the saturation rate itself looks better than the unbounded queue it
    would build). QPS target: max_qps when it reaches the target."""
    if target.kind == "qps":
        return max_qps if max_qps >= target.value else None
    lo = max_qps * 1e-3
    if metric_value(run(lo), target) > target.value:
        return None
    hi = SUSTAINABLE * max_qps
    if metric_value(run(hi), target) <= target.value:
        return hi
    for _ in range(iters):
        mid = math.sqrt(lo * hi) if hi / lo > 4 else 0.5 * (lo + hi)
        if metric_value(run(mid), target) <= target.value:
            lo = mid
        else:
            hi = mid
    return lo
