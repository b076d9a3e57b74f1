"""The serving cost model's step times: a vLLM-style engine's prefill and decode steps, whole
prompts, the memoised step functions of the queueing simulation, and the time a request spends
outside the engine's steps.

The model in four files, one concept each:
- planner/serve/terms.py   factor-free compute, memory and TP terms of one engine step
                           (Pope et al. 2022 [P22]; chunked prefill, SARATHI [SA]);
- planner/serve/factors.py the eight serving factors (SERVE_DEFAULTS) and `combine`, the one
                           formula that turns terms into seconds;
- planner/serve/memory.py  weight and KV-cache bytes and the engine's memory budget
                           (PagedAttention [PA]: Kwon et al. 2023, "Efficient Memory Management
                           for Large Language Model Serving with PagedAttention", SOSP 2023,
                           arXiv 2309.06180);
- this file                the times built from them (terms combined with the profile's factors).
"""
from __future__ import annotations

import math
from typing import Callable

from planner.serve.factors import combine, serve_factors
from planner.serve.memory import engine_budget
from planner.serve.spec import Deployment
from planner.serve.terms import decode_terms, prefill_terms, step_terms
from planner.specs.cluster import ClusterSpec
from planner.specs.model import ModelSpec

__all__ = ["decode_step_time_s", "handover_s", "mixed_fn", "prefill_time_s", "prompt_time_s", "request_overhead_s",
           "step_fns"]


def prefill_time_s(model: ModelSpec, cluster: ClusterSpec, dep: Deployment, tokens: int, context: int = 0) -> float:
    """Seconds of one prefill step (one engine step, overhead included)."""
    return combine(prefill_terms(model, cluster, dep, tokens, context), serve_factors(cluster))


def decode_step_time_s(model: ModelSpec, cluster: ClusterSpec, dep: Deployment, batch: int,
                       context_tokens: int) -> float:
    """Seconds of one decode step of the running batch (one engine step, overhead included)."""
    return combine(decode_terms(model, cluster, dep, batch, context_tokens), serve_factors(cluster), decode=True)


REQUEST_OVERHEAD_S = 0.004
"""Seconds a request spends outside the engine's steps when it is served through the engine's
OpenAI-compatible HTTP server: the request's HTTP handling, tokenization and hand-over to the
engine process (ZeroMQ), and the first token's way back. Measured: vLLM's online (API server)
TTFT was 4 ms above its offline LLM-engine TTFT, 235 vs 231 ms average, batch 32
("HTTP server + ZMQ latency": tenstorrent/tt-inference-server issue #190, 2025-05-08).
Assumed the same for SGLang's server."""


def request_overhead_s(cluster: ClusterSpec, dep: Deployment) -> float:
    """Per-request seconds outside the engine steps (REQUEST_OVERHEAD_S) for vLLM and SGLang,
    the profile's `serve_request_overhead_s` where set; 0 for the CPU executor, whose load
    generator hands requests to the engine in-process."""
    if dep.engine == "executor":
        return 0.0
    return float(cluster.device.factors.get("serve_request_overhead_s", REQUEST_OVERHEAD_S))


TOKENIZE_S_PER_TOKEN = 1e-6
"""Seconds the API server spends tokenizing one prompt token, one request after another:
"In vLLM's API server today, we process each request's tokenization sequentially"; "for
concurrency=1, DGX H100's CPU can do about only about 1k tokens/ms" (vLLM issue #19012,
2025-06-02, the microbatch-tokenization proposal). Assumed the same for SGLang's tokenizer
manager (one process)."""


def handover_s(dep: Deployment, prompt_tokens: float) -> float:
    """Seconds between two requests sent at the same moment reaching the engine: the API
    server tokenizes them in turn (TOKENIZE_S_PER_TOKEN per prompt token). The engine starts a
    step as soon as one request is in (vLLM's engine loop waits for input only while it has no
    work), so a burst sent to an idle engine runs its first prompt alone and the rest in the next
    steps (planner/serve/queue.py simulate). 0 for the CPU executor (requests handed over
    in-process, already tokenized)."""
    if dep.engine == "executor":
        return 0.0
    return prompt_tokens * TOKENIZE_S_PER_TOKEN


def prompt_time_s(model: ModelSpec, cluster: ClusterSpec, dep: Deployment, prompt: int) -> float:
    """Seconds to prefill a whole prompt alone: one step, or ceil(prompt / budget) chunked steps."""
    budget = engine_budget(cluster, dep)
    c = prompt if math.isinf(budget) else int(budget)
    return sum(prefill_time_s(model, cluster, dep, min(c, prompt - s), s) for s in range(0, prompt, c))


def step_fns(model: ModelSpec, cluster: ClusterSpec, dep: Deployment) -> tuple[Callable[[int, int], float],
                                                                               Callable[[int, int], float]]:
    """(prefill(tokens, context), decode(batch, context_tokens)) for the simulation, memoised.
    Where the memory term binds, decode is linear in context_tokens, so only its per-batch parts
    are cached; where the compute floor may bind it is computed exactly."""
    f = serve_factors(cluster)
    pre: dict[tuple[int, int], float] = {}
    parts: dict[int, tuple[float, float, float, float, float, float]] = {}
    exact: dict[tuple[int, int], float] = {}
    one = decode_terms(model, cluster, dep, 1, 1)
    two = decode_terms(model, cluster, dep, 1, 2)
    mem_per_ctx = two["memory_s"] - one["memory_s"]

    def prefill(tokens: int, context: int) -> float:
        key = (tokens, context)
        if key not in pre:
            pre[key] = combine(prefill_terms(model, cluster, dep, tokens, context), f)
        return pre[key]

    def decode(batch: int, context_tokens: int) -> float:
        if batch not in parts:
            d = decode_terms(model, cluster, dep, batch, batch)
            parts[batch] = (d["memory_s"] - batch * mem_per_ctx, d["compute_s"], d["comm_s"], d["tp_steps"],
                            d["serial"], d["fixed_s"])
        mem0, comp, comm, tp_steps, serial, fixed = parts[batch]
        if serial or comp * f["decode_compute_scale"] > 0.5 * (mem0 / f["decode_bw_efficiency"]):
            # the compute floor may bind (always counts where serial), and its attention term is
            # not linear in the context (its GEMM efficiency depends on it): the exact path
            key = (batch, context_tokens)
            if key not in exact:
                exact[key] = combine(decode_terms(model, cluster, dep, batch, context_tokens), f, decode=True)
            return exact[key]
        memory = mem0 + context_tokens * mem_per_ctx
        terms = {"compute_s": comp, "memory_s": memory, "comm_s": comm, "tp_steps": tp_steps,
                 "attn_memory_s": context_tokens * mem_per_ctx, "fixed_s": fixed}
        return combine(terms, f, decode=True)
    return prefill, decode


def mixed_fn(model: ModelSpec, cluster: ClusterSpec, dep: Deployment) -> Callable[[list[tuple[int, int]], int, int], float]:
    """Seconds of any engine step (several prefill chunks beside decodes): step_terms combined."""
    f = serve_factors(cluster)

    def mixed(chunks: list[tuple[int, int]], batch: int, context_tokens: int) -> float:
        return combine(step_terms(model, cluster, dep, chunks, batch, context_tokens), f)
    return mixed
