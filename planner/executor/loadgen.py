"""The load generator: seeded requests with Poisson arrivals, run in-process against the engine.

In-process rather than an HTTP server on 127.0.0.1: arrival times are real wall-clock times
(the engine admits a request only once the clock has passed its arrival), and on a 2-core
machine a server thread and a client process would take CPU from the measured forward and
add their own latency to TTFT. What is measured is the engine (scheduling, prefill, decode),
which is what the serving cost model predicts; HTTP framing is not part of it.

Workload: the serving contract's `planner.serve.spec.Workload` (prompt_len, output_len,
prompt_sigma, output_sigma, seed) or any object/dict with those fields: lengths are
log-normal around the given medians when sigma > 0 (median * exp(sigma * N(0, 1)), rounded,
at least 1), else fixed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from planner.errors import SpecError
from planner.executor.generate import Request

WORKLOAD_FIELDS = ("prompt_len", "output_len", "prompt_sigma", "output_sigma", "seed")


@dataclass(frozen=True, slots=True)
class WorkloadView:
    """The Workload fields the load generator reads (planner.serve.spec.Workload carries them)."""

    prompt_len: int
    output_len: int
    prompt_sigma: float = 0.0
    output_sigma: float = 0.0
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in WORKLOAD_FIELDS}


def as_workload(workload: Any) -> WorkloadView:
    """Read a Workload (or a dict with its fields) and check it."""
    get = workload.get if isinstance(workload, dict) else lambda k, d=None: getattr(workload, k, d)
    try:
        w = WorkloadView(prompt_len=int(get("prompt_len")), output_len=int(get("output_len")),
                         prompt_sigma=float(get("prompt_sigma", 0.0)), output_sigma=float(get("output_sigma", 0.0)),
                         seed=int(get("seed", 0)))
    except (TypeError, ValueError):
        raise SpecError("workload", f"needs integer prompt_len and output_len, got {workload!r}",
                        "e.g. Workload(prompt_len=32, output_len=16)") from None
    if w.prompt_len < 1 or w.output_len < 1 or w.prompt_sigma < 0 or w.output_sigma < 0:
        raise SpecError("workload", f"lengths must be >= 1 and sigmas >= 0, got {w.to_dict()}",
                        "e.g. --prompt-len 32 --output-len 16")
    return w


def poisson_arrivals(rate_qps: float, n: int, seed: int) -> np.ndarray:
    """Arrival times (s) of n requests of a Poisson process of rate rate_qps: cumulative sums
    of exponential gaps of mean 1/rate, the first arrival at t = 0."""
    if not rate_qps > 0:
        raise SpecError("--rate", f"must be > 0 requests/s, got {rate_qps}", "e.g. --rate 2")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate_qps, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def sample_lengths(median: int, sigma: float, n: int, rng: np.random.Generator, cap: int) -> list[int]:
    if sigma == 0:
        return [min(median, cap)] * n
    draws = median * np.exp(sigma * rng.standard_normal(n))
    return [int(min(cap, max(1, round(x)))) for x in draws]


def make_requests(workload: Any, rate_qps: float, n: int, seed: int, vocab: int, max_seq: int) -> list[Request]:
    """n requests: Poisson arrivals (seed), prompt/output lengths and prompt tokens (workload.seed);
    prompt + output fit the context `max_seq`."""
    w = as_workload(workload)
    if n < 1:
        raise SpecError("--requests", f"must be >= 1, got {n}", "e.g. --requests 16")
    if w.prompt_len + w.output_len > max_seq:
        raise SpecError("workload", f"prompt {w.prompt_len} + output {w.output_len} tokens exceed the model's "
                        f"context {max_seq}", "shorten the prompt or the output")
    rng = np.random.default_rng(w.seed)
    prompts = sample_lengths(w.prompt_len, w.prompt_sigma, n, rng, max_seq - 1)
    outputs = sample_lengths(w.output_len, w.output_sigma, n, rng, max_seq - 1)
    arrivals = poisson_arrivals(rate_qps, n, seed)
    out = []
    for i in range(n):
        p = prompts[i]
        o = min(outputs[i], max_seq - p)
        out.append(Request(rid=i, prompt=rng.integers(0, vocab, size=p).tolist(), output_len=o,
                           arrival_s=float(arrivals[i])))
    return out
