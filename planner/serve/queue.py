"""A seeded discrete-event simulation of one vLLM-style engine under continuous batching.

Requests arrive as a Poisson process (exponential gaps at rate lambda), or from N closed-loop
users (each sends its next request when its previous one finished), with prompt and output
lengths drawn from the Workload (log-normal, or a trace's pairs). The engine runs one step at a
time [Kwon et al. 2023, sec. 4.5; Yu et al. 2022, Orca: iteration-level scheduling], scheduled
by planner/serve/scheduler.py as vLLM's V1 scheduler, SGLang's or the CPU executor's does: a
token budget per step, several prefills and chunked prefills beside the decodes (vLLM), paged KV
blocks allocated as the tokens are computed and recompute preemption when they run out, prefix
caching as an option. A prefill's last chunk yields the first token (TTFT); a request leaves
after its last decode, freeing its blocks.
Times per step come from planner/serve/cost.py. Common random numbers: the same seed gives the
same lengths and the same unit gaps at every rate, so latency is monotone enough in lambda to
bisect on.
"""
from __future__ import annotations

import math
import random
from typing import Any, Callable

import numpy as np

from planner.serve.scheduler import Scheduler, SchedulerConfig
from planner.serve.spec import Target, Workload

StepFn = Callable[[int, int], float]
MixedFn = Callable[[list[tuple[int, int]], int, int], float]
SUSTAINABLE = 0.95
"""Highest share of the saturation throughput a latency target is searched up to."""


def _stats(x: list[float]) -> dict[str, float]:
    if not x:
        return {"mean": math.nan, "p50": math.nan, "p99": math.nan}
    a = np.asarray(x, dtype=float)
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}


def draw_requests(workload: Workload, rate_qps: float, n: int, seed: int,
                  max_total: int | None = None) -> tuple[list[tuple[int, int]], list[float]]:
    """The n requests that simulate() serves and planner/runtime/serve/loadgen.py sends: one
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
             prefill_chunk: int = 0, max_total: int | None = None, wake_s: float = 0.0, engine: str = "vllm",
             mixed_fn: MixedFn | None = None, concurrency: int | None = None,
             prefix_caching: bool = False, request_overhead_s: float = 0.0,
             handover_s: float = 0.0) -> dict[str, Any]:
    """Serve `requests` requests arriving at `rate_qps` (math.inf: all at time 0) on one engine
    scheduled as `engine` (planner/serve/scheduler.py: vllm, sglang, executor) with a token
    budget of prefill_chunk per step (0: unbounded) and `kv_blocks` paged blocks (None: unbounded).

    prefill_fn(tokens, context) and decode_fn(batch, context_tokens) give the seconds of a step
    that is one prefill chunk or only decodes (context_tokens: tokens attended by the whole
    batch, each sequence's cached tokens plus its new one); mixed_fn(chunks, batch,
    context_tokens) the seconds of any other step (chunks: [(tokens, context)]; default: the
    sum of the chunks' prefill_fn and the decode_fn). concurrency N: closed loop, N users each
    sending its next request when the previous one finishes (rate_qps unused). wake_s: added to
    the first step after the engine sat idle waiting for an arrival. request_overhead_s: the
    client's request reaching the engine and its tokens coming back (HTTP, tokenization, IPC:
    cost.request_overhead_s), added to each client-side TTFT and end-to-end latency; in the closed
    loop a user's next request reaches the engine that long after its last one finished, so it
    waits for the step already under way. handover_s: requests a closed loop's users send at the
    same moment (all N at the start, or several whose last requests ended in one step) reach the
    engine one after another, handover_s apart (the server's one event loop hands them over in
    turn: cost.HANDOVER_S), so an idle engine starts its step with the first alone and the
    others join the next one. Returns mean/p50/p99 of
    ttft_s, tpot_s (per output token after the first), e2e_s and queue_s (arrival to first
    scheduled), the achieved throughput, the steps run, the preemptions and the most KV blocks
    held at once (peak_kv_blocks; 0 with an unbounded cache)."""
    if requests < 1 or not rate_qps > 0:
        raise ValueError(f"need requests >= 1 and rate > 0, got {requests}, {rate_qps}")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"need concurrency >= 1, got {concurrency}")
    closed = concurrency is not None
    lens, arrival = draw_requests(workload, math.inf if closed else rate_qps, requests,
                                  workload.seed if seed is None else seed, max_total)
    # when the client sent it, request_overhead_s before it reaches the engine (arrival)
    sent = [a - request_overhead_s for a in arrival]
    if closed:
        arrival = [i * handover_s if i < concurrency else math.inf for i in range(requests)]
        sent = [-request_overhead_s if i < concurrency else math.inf for i in range(requests)]
    cfg = SchedulerConfig(engine=engine, max_num_seqs=max_batch, block_size=block_size,
                          max_num_batched_tokens=prefill_chunk or math.inf,
                          kv_blocks=math.inf if kv_blocks is None else kv_blocks,
                          prefix_len=workload.prefix_len, prefix_caching=prefix_caching)
    sched = Scheduler(cfg, lens)
    out = [o for _, o in lens]
    first = [math.nan] * requests
    start = [math.nan] * requests
    finish = [math.nan] * requests
    nxt, finished, now, steps, idle, released = 0, 0, 0.0, 0, True, min(requests, concurrency or requests)
    peak = 0
    while finished < requests:
        while nxt < released and arrival[nxt] <= now:
            sched.add(nxt)
            nxt += 1
        step = sched.schedule()
        if kv_blocks is not None:
            peak = max(peak, kv_blocks - sched.free)
        if not step:
            if not sched.idle():
                raise ValueError(f"the engine cannot schedule request {sched.waiting[0]} with an empty batch")
            now = arrival[nxt]
            idle = True
            continue
        steps += 1
        if idle:
            now += wake_s
            idle = False
        began = now
        ctx = sched.decode_context(step)
        chunks = [(n, c) for _, n, c in step.chunks]
        if not step.decodes and len(chunks) == 1:
            now += prefill_fn(*chunks[0])
        elif not chunks:
            now += decode_fn(len(step.decodes), ctx)
        elif mixed_fn is not None:
            now += mixed_fn(chunks, len(step.decodes), ctx)
        else:
            now += sum(prefill_fn(n, c) for n, c in chunks) + (decode_fn(len(step.decodes), ctx) if step.decodes else 0.0)
        for i, _, _ in step.chunks:
            if math.isnan(start[i]):
                start[i] = began
        firsts, done = sched.complete(step)
        for i in firsts:
            first[i] = now
        for k, i in enumerate(done):
            finish[i] = now
            finished += 1
            if closed and released < requests:  # the user sends its next request
                sent[released] = now
                arrival[released] = now + request_overhead_s + k * handover_s
                released += 1
    # client-side, from the moment the client sent it: the overhead once, on the request's way in
    ttft = [f - t for f, t in zip(first, sent)]
    e2e = [f - t for f, t in zip(finish, sent)]
    tpot = [(e - f) / (o - 1) for e, f, o in zip(finish, first, out) if o > 1]
    span = max(finish) - min(arrival)
    return {"requests": requests, "rate_qps": rate_qps, "ttft_s": _stats(ttft), "tpot_s": _stats(tpot),
            "e2e_s": _stats(e2e), "queue_s": _stats([s - a for s, a in zip(start, arrival)]),
            "achieved_qps": requests / span if span > 0 else math.inf,
            "output_tokens_per_s": sum(out) / span if span > 0 else math.inf, "steps": steps,
            "preemptions": sched.preemptions, "peak_kv_blocks": peak}


def replica_runner(model: Any, cluster: Any, dep: Any, workload: Workload, mem: dict[str, Any], *,
                   requests: int = 300, seed: int | None = None) -> Callable[[float], dict[str, Any]]:
    """rate (all replicas) -> simulate() of one replica at rate / replicas (a Poisson stream split
    evenly is Poisson; with Workload.concurrency every finite rate is the closed loop of
    concurrency / replicas users each, rounded up, math.inf all requests at once), scheduled as
    dep.engine with its token budget (cost.engine_budget), with its achieved throughput scaled
    back to all replicas: x replicas, or in a closed loop x N / users (N users, each at the rate a
    user of the simulated replica gets; exact when the replicas divide N, a little low otherwise,
    never the ceil(N / replicas) x replicas users that do not exist)."""
    from planner.serve.cost import handover_s, mixed_fn, request_overhead_s, step_fns
    from planner.serve.factors import serve_factor
    from planner.serve.memory import engine_budget
    prefill, decode = step_fns(model, cluster, dep)
    mixed = mixed_fn(model, cluster, dep)
    wake = serve_factor(cluster, "serve_wake_s")
    budget = engine_budget(cluster, dep)
    overhead = request_overhead_s(cluster, dep)
    handover = handover_s(dep, workload.mean_lengths()[0])
    users = math.ceil(workload.concurrency / dep.replicas) if workload.concurrency else None
    cache: dict[float, dict[str, Any]] = {}

    def run(rate: float) -> dict[str, Any]:
        if rate not in cache:
            r = simulate(prefill, decode, workload, rate / dep.replicas, requests=requests, seed=seed,
                         max_batch=dep.max_batch, kv_blocks=mem["kv_blocks"], block_size=dep.block_size,
                         prefill_chunk=0 if math.isinf(budget) else int(budget), max_total=workload.max_total(),
                         wake_s=wake, engine=dep.engine, mixed_fn=mixed, prefix_caching=dep.prefix_caching,
                         concurrency=users if users and not math.isinf(rate) else None,
                         request_overhead_s=overhead, handover_s=handover)
            r["rate_qps"] = rate
            # all replicas: x replicas for a split stream; a closed loop has only N users, a
            # replica's users each at the simulated replica's per-user rate (x N / users)
            scale = workload.concurrency / users if users and not math.isinf(rate) else dep.replicas
            r["achieved_qps"] *= scale
            r["output_tokens_per_s"] *= scale
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
