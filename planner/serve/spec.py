"""Serving value types: the workload, one deployment, a latency/QPS target and the estimate."""
from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field
from typing import Any

from planner.errors import SpecError
from planner.serve.scheduler import ENGINES

WEIGHT_BYTES: dict[str, float] = {
    # bytes per linear-layer weight, group-wise scales included: GPTQ (Frantar et al. 2022) and
    # AWQ (Lin et al. 2023) quantize in groups of 128 weights with an fp16 scale per group (AWQ
    # int4 adds a zero point: counted as a second fp16 per group)
    "bf16": 2.0,
    "int8": 1.0 + 2.0 / 128,
    "int4": 0.5 + 4.0 / 128,
    "fp8": 1.0,   # W8A8 FP8 (vLLM --quantization fp8: per-tensor scales), GPUs with FP8 only
    "fp32": 4.0,  # the executor's CPU runs (planner/runtime/serve/run.py); never searched
}
KV_BYTES: dict[str, float] = {"bf16": 2.0, "fp8": 1.0, "int8": 1.0, "fp32": 4.0}
SEARCH_WEIGHTS = ("bf16", "int8", "int4", "fp8")
SEARCH_KV = ("bf16", "fp8", "int8")
TARGET_KINDS = ("p50", "p99", "qps")
LATENCY_METRICS = ("e2e", "ttft", "tpot")


def _int(value: Any, name: str, low: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise SpecError(name, f"must be an integer >= {low}, got {value!r}", fix)


def _num(value: Any, name: str, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise SpecError(name, f"must be a number >= 0, got {value!r}", fix)


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """The requests a deployment serves."""

    prompt_len: int
    """Median prompt length, tokens."""
    output_len: int
    """Median generated tokens per request."""
    prompt_sigma: float = 0.0
    """Log-normal sigma of prompt lengths around the median (0: every prompt is prompt_len)."""
    output_sigma: float = 0.0
    """Log-normal sigma of output lengths around the median (0: every output is output_len)."""
    seed: int = 0
    """Seed of the length and arrival draws."""
    trace: tuple[tuple[int, int], ...] = ()
    """(prompt, output) pairs replayed in order, cycling (a trace file); () = the distributions."""
    concurrency: int = 0
    """Closed loop: N users, each sending its next request when its last one finished (0: the
    arrivals are a Poisson stream at the searched rate)."""
    prefix_len: int = 0
    """Prompt tokens every request shares (a system prompt), reusable with prefix caching."""
    mean_output_len: float = 0.0
    """Requests that stop at their end-of-sequence token before output_len (the request's
    max_tokens): their mean generated tokens. Each generated token ends the request with one
    probability p (stop_probability: a constant end-of-sequence hazard, the geometric
    distribution, capped at output_len), so outputs spread and closed-loop users fall out of
    step as they do against a real engine. 0: every request generates its drawn output length
    (a benchmark run with --ignore-eos)."""

    def __post_init__(self) -> None:
        _int(self.prompt_len, "--prompt-len", 1, "give the prompt length in tokens, e.g. 512")
        _int(self.output_len, "--output-len", 1, "give the generated tokens per request, e.g. 256")
        _num(self.prompt_sigma, "--prompt-sigma", "give a log-normal sigma, e.g. 0.5 (0: fixed length)")
        _num(self.output_sigma, "--output-sigma", "give a log-normal sigma, e.g. 0.5 (0: fixed length)")
        _int(self.seed, "--seed", 0, "give a seed >= 0")
        _int(self.concurrency, "--concurrency", 0, "give the number of users, e.g. 32 (0: Poisson arrivals)")
        _int(self.prefix_len, "--prefix-len", 0, "give the shared prompt prefix in tokens, e.g. 256 (0: none)")
        _num(self.mean_output_len, "--mean-output-len",
             "give the mean generated tokens of requests stopping at end-of-sequence, e.g. 100 (0: none stop early)")
        if self.mean_output_len and not 1 <= self.mean_output_len <= self.output_len:
            raise SpecError("--mean-output-len", f"must lie in [1, --output-len {self.output_len}], got "
                            f"{self.mean_output_len:g}", "give the mean generated tokens, at most --output-len")
        if isinstance(self.trace, list):  # from JSON (to_dict writes lists)
            object.__setattr__(self, "trace", tuple(tuple(t) if isinstance(t, list) else t for t in self.trace))
        if not isinstance(self.trace, tuple) or not all(
                isinstance(t, tuple) and len(t) == 2 and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1
                                                           for v in t) for t in self.trace):
            raise SpecError("--trace", "must hold (prompt, output) pairs of integers >= 1",
                            "write one 'prompt_tokens,output_tokens' pair per line")
        if self.trace and self.mean_output_len:
            raise SpecError("--mean-output-len", "a trace already gives each request's output length",
                            "drop --mean-output-len or --trace")

    def sample(self, n: int, rng: random.Random, max_total: int | None = None) -> list[tuple[int, int]]:
        """n (prompt, output) lengths: log-normal around the medians (median of exp(mu + sigma Z)
        is exp(mu)), rounded, at least 1, and clipped so prompt + output <= max_total; with
        mean_output_len each output stops first at a geometric draw of stop_probability."""
        out = []
        stop = self.stop_probability()
        for k in range(n):
            if self.trace:
                p, o = self.trace[k % len(self.trace)]
                if max_total is not None and p + o > max_total:
                    p = max(1, min(p, max_total - 1))
                    o = max(1, max_total - p)
                out.append((p, o))
                continue
            p = max(1, round(self.prompt_len * math.exp(self.prompt_sigma * rng.gauss(0.0, 1.0)))) \
                if self.prompt_sigma > 0 else self.prompt_len
            o = max(1, round(self.output_len * math.exp(self.output_sigma * rng.gauss(0.0, 1.0)))) \
                if self.output_sigma > 0 else self.output_len
            if stop > 0:  # tokens until the end-of-sequence token: geometric, capped at max_tokens
                o = min(o, max(1, math.ceil(math.log1p(-rng.random()) / math.log1p(-stop))))
            if max_total is not None and p + o > max_total:
                p = max(1, min(p, max_total - 1))
                o = max(1, max_total - p)
            out.append((p, o))
        return out

    def stop_probability(self) -> float:
        """Per-token end-of-sequence probability p whose geometric stop, capped at output_len,
        has mean mean_output_len: E[min(G, L)] = (1 - (1 - p)^L) / p (bisection; 0 when no
        request stops early)."""
        m, cap = self.mean_output_len, self.output_len
        if not m or m >= cap:
            return 0.0
        lo, hi = 0.0, 1.0
        for _ in range(200):
            p = 0.5 * (lo + hi)
            if (1.0 - (1.0 - p) ** cap) / p > m:
                lo = p
            else:
                hi = p
        return 0.5 * (lo + hi)

    def max_prompt(self) -> int:
        """Longest prompt drawn: the median when sigma is 0, else its 99.9th percentile (z = 3.09);
        a trace's longest."""
        if self.trace:
            return max(p for p, _ in self.trace)
        return int(math.ceil(self.prompt_len * math.exp(3.09 * self.prompt_sigma)))

    def max_total(self) -> int:
        """Longest prompt + output the deployment must hold: the medians when sigma is 0, else
        the 99.9th percentile of each (z = 3.09); a trace's longest pair. The engine's
        --max-model-len; the KV cache is not reserved at this length for every sequence (blocks
        are allocated as tokens are computed: planner/serve/scheduler.py)."""
        if self.trace:
            return max(p + o for p, o in self.trace)
        p = self.prompt_len * math.exp(3.09 * self.prompt_sigma)
        o = self.output_len * math.exp(3.09 * self.output_sigma)
        return int(math.ceil(p) + math.ceil(o))

    def mean_lengths(self) -> tuple[float, float]:
        """Mean (prompt, output) tokens per request: a trace's, or the log-normals' (median x
        exp(sigma^2 / 2))."""
        if self.trace:
            return (sum(p for p, _ in self.trace) / len(self.trace), sum(o for _, o in self.trace) / len(self.trace))
        out = self.mean_output_len if self.mean_output_len else self.output_len * math.exp(self.output_sigma ** 2 / 2)
        return (self.prompt_len * math.exp(self.prompt_sigma ** 2 / 2), out)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["trace"] = [list(t) for t in self.trace]
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Deployment:
    """One way to serve the model: vLLM's engine settings on tp x replicas GPUs."""

    tp: int = 1
    """Tensor-parallel degree of one replica (vLLM --tensor-parallel-size)."""
    replicas: int = 1
    """Independent engines behind a load balancer; each gets 1/replicas of the traffic."""
    max_batch: int = 1
    """Most sequences decoded together (vLLM --max-num-seqs)."""
    weight_precision: str = "bf16"
    """bf16, weight-only int8 / int4 (activations stay bf16), or fp8 weights and activations."""
    kv_precision: str = "bf16"
    """KV-cache element type: bf16, fp8 (vLLM --kv-cache-dtype fp8) or int8."""
    prefill_chunk: int = 0
    """Tokens per engine step, prefill chunks and decodes together (vLLM --max-num-batched-tokens,
    SGLang --chunked-prefill-size); 0 = the engine's default (engine_budget)."""
    block_size: int = 16
    """Tokens per paged KV block (vLLM --block-size, default 16)."""
    engine: str = "vllm"
    """vllm, sglang, executor (the CPU lab's engine, planner/runtime/serve/generate.py) or vllm-v0
    (vLLM's V0 scheduler without chunked prefill: planner/serve/scheduler.py)."""
    prefix_caching: bool = False
    """Reuse the cached KV of a prompt prefix all requests share (Workload.prefix_len)."""

    def __post_init__(self) -> None:
        _int(self.tp, "deployment.tp", 1, "use a tensor-parallel degree >= 1")
        _int(self.replicas, "deployment.replicas", 1, "use at least one replica")
        _int(self.max_batch, "--max-batch", 1, "use a batch of at least 1 sequence")
        _int(self.prefill_chunk, "--prefill-chunk", 0, "use 0 (whole prompt) or a token count")
        _int(self.block_size, "deployment.block_size", 1, "use vLLM's 16")
        if self.weight_precision not in WEIGHT_BYTES:
            raise SpecError("--weight-precision", f"unknown {self.weight_precision!r}",
                            f"use one of {', '.join(WEIGHT_BYTES)}")
        if self.engine not in ENGINES:
            raise SpecError("--engine", f"unknown {self.engine!r}", f"use one of {', '.join(ENGINES)}")
        if self.kv_precision not in KV_BYTES:
            raise SpecError("--kv-precision", f"unknown {self.kv_precision!r}", f"use one of {', '.join(KV_BYTES)}")

    @property
    def gpus(self) -> int:
        return self.tp * self.replicas

    def describe(self) -> str:
        chunk = f"{self.prefill_chunk} tokens/step" if self.prefill_chunk else "default tokens/step"
        return (f"{self.engine} TP{self.tp} x {self.replicas} replica(s), batch {self.max_batch}, weights {self.weight_precision}, "
                f"KV {self.kv_precision}, {chunk}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """What the deployment must meet: a latency percentile (kind p50 or p99, `value` seconds of
    `metric`) or a throughput (kind qps, `value` requests/s)."""

    kind: str
    value: float
    metric: str = "e2e"
    """e2e (request latency), ttft (time to first token) or tpot (time per output token)."""

    def __post_init__(self) -> None:
        if self.kind not in TARGET_KINDS:
            raise SpecError("target", f"unknown kind {self.kind!r}", f"use one of {', '.join(TARGET_KINDS)}")
        if isinstance(self.value, bool) or not isinstance(self.value, (int, float)) \
                or not math.isfinite(self.value) or self.value <= 0:
            flag = "--target-qps" if self.kind == "qps" else f"--target-{self.kind}-ms"
            raise SpecError(flag, f"must be a positive number, got {self.value!r}", "e.g. 210")
        if self.metric not in LATENCY_METRICS:
            raise SpecError("--latency-metric", f"unknown {self.metric!r}", f"use one of {', '.join(LATENCY_METRICS)}")

    def describe(self) -> str:
        if self.kind == "qps":
            return f"{self.value:g} QPS"
        return f"{self.metric} {self.kind} <= {self.value * 1e3:g} ms"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeEstimate:
    """The predicted behaviour of one deployment. Latencies are per request, seconds; the
    percentiles come from the queueing simulation at `rate_qps` (the QPS at the target, or 80%
    of max_qps without one); ttft_s/tpot_s are the means there, *_alone_s one request alone."""

    deployment: Deployment
    feasible: bool
    reasons: tuple[str, ...] = ()
    ttft_s: float = math.nan
    tpot_s: float = math.nan
    e2e_p50_s: float = math.nan
    e2e_p99_s: float = math.nan
    e2e_mean_s: float = math.nan
    ttft_p50_s: float = math.nan
    ttft_p99_s: float = math.nan
    tpot_p50_s: float = math.nan
    tpot_p99_s: float = math.nan
    ttft_alone_s: float = math.nan
    tpot_alone_s: float = math.nan
    rate_qps: float = 0.0
    """Arrival rate (all replicas) the percentiles were simulated at."""
    qps_at_target: float | None = None
    """Highest arrival rate (all replicas) that meets the target; None without a target."""
    meets_target: bool | None = None
    max_qps: float = 0.0
    """Saturation throughput of all replicas, requests/s."""
    memory_gb: dict[str, float] = field(default_factory=dict)
    """Per GPU, GiB (2^30 bytes, as the engines count): weights, kv_cache, activations, runtime,
    total, capacity (usable)."""
    overloaded: bool = False
    """The rate simulated exceeds max_qps: the queue grows without bound."""
    backlog_growth_qps: float = 0.0
    """How fast the queue grows when overloaded: rate_qps - max_qps requests/s."""
    queue_p99_s: float = math.nan
    """99th percentile of the wait from arrival to the first scheduled step."""
    preemptions: int = 0
    """Requests preempted (KV blocks ran out; recomputed later) in the simulation."""
    memory_in_use_gb: float = math.nan
    """Per GPU, GiB: weights, activations and runtime plus the most KV blocks the simulated load
    held at once (the engine preallocates memory_gb['kv_cache']; this is what the requests use)."""
    kv_capacity_tokens: int = 0
    """Tokens the paged KV cache of one replica holds."""
    batch_limit: int = 0
    """Most sequences of the workload's longest length the KV cache holds at once (<= max_batch)."""

    def to_json(self) -> dict[str, Any]:
        def clean(v: Any) -> Any:
            return None if isinstance(v, float) and not math.isfinite(v) else v
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["deployment"] = self.deployment.to_dict()
        out["reasons"] = list(self.reasons)
        out["memory_gb"] = {k: round(v, 4) for k, v in self.memory_gb.items()}
        return {k: clean(v) for k, v in out.items()}
