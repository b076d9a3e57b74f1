"""The load generator: seeded requests with Poisson arrivals, run in-process against the engine.

In-process rather than an HTTP server on 127.0.0.1: arrival times are real wall-clock times
(the engine admits a request only once the clock has passed its arrival), and on a 2-core
machine a server thread and a client process would take CPU from the measured forward and
add their own latency to TTFT. What is measured is the engine (scheduling, prefill, decode),
which is what the serving cost model predicts; HTTP framing is not part of it.

Workload: the serving contract's `planner.serve.spec.Workload` (or a dict of its fields).
Lengths and arrivals come from the cost model's own draw, planner/serve/queue.py
draw_requests (what simulate(seed=seed, max_total=max_seq) serves): one random.Random(seed),
first Workload.sample (log-normal lengths around the medians), then exponential gaps of mean
1/rate. A measured run and its simulation therefore see the same requests, and predicted
vs measured differ by the model, not by sampling. Prompt tokens come from a separate stream.
"""
from __future__ import annotations

import math
import random
from typing import Any

import numpy as np

from planner.errors import SpecError
from planner.runtime.serve.generate import Request
from planner.serve.queue import draw_requests
from planner.serve.spec import Workload

WORKLOAD_FIELDS = ("prompt_len", "output_len", "prompt_sigma", "output_sigma", "seed")


def as_workload(workload: Any) -> Workload:
    """A Workload from a Workload or a dict of its fields (Workload checks the values)."""
    if isinstance(workload, Workload):
        return workload
    if not isinstance(workload, dict) or not {"prompt_len", "output_len"} <= set(workload):
        raise SpecError("workload", f"needs prompt_len and output_len, got {workload!r}",
                        "e.g. Workload(prompt_len=32, output_len=16)")
    return Workload(**{k: workload[k] for k in WORKLOAD_FIELDS if k in workload})


def poisson_arrivals(rate_qps: float, n: int, rng: random.Random) -> list[float]:
    """Arrival times (s) of n requests of a Poisson process of rate rate_qps: cumulative sums
    of exponential gaps of mean 1/rate (the first one after a gap, as simulate() draws them)."""
    if not (rate_qps > 0 and math.isfinite(rate_qps)):
        raise SpecError("--rate", f"must be a finite rate > 0 requests/s, got {rate_qps}", "e.g. --rate 2")
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(1.0) / rate_qps
        out.append(t)
    return out


def make_requests(workload: Any, rate_qps: float, n: int, seed: int, vocab: int, max_seq: int) -> list[Request]:
    """n requests: lengths and Poisson arrivals from queue.draw_requests (simulate()'s draw);
    prompt tokens from numpy (workload.seed); prompt + output fit the context `max_seq`."""
    w = as_workload(workload)
    if n < 1:
        raise SpecError("--requests", f"must be >= 1, got {n}", "e.g. --requests 16")
    if w.prompt_len + w.output_len > max_seq:
        raise SpecError("workload", f"prompt {w.prompt_len} + output {w.output_len} tokens exceed the model's "
                        f"context {max_seq}", "shorten the prompt or the output")
    if not (rate_qps > 0 and math.isfinite(rate_qps)):
        raise SpecError("--rate", f"must be a finite rate > 0 requests/s, got {rate_qps}", "e.g. --rate 2")
    lens, arrivals = draw_requests(w, rate_qps, n, seed, max_seq)
    tokens = np.random.default_rng(w.seed)
    return [Request(rid=i, prompt=tokens.integers(0, vocab, size=p).tolist(), output_len=o, arrival_s=arrivals[i])
            for i, (p, o) in enumerate(lens)]
