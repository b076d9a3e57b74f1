"""One engine's step scheduler: what vLLM, SGLang and the CPU executor run each iteration.

Pure Python (no torch): planner/serve/queue.py simulate drives it with the cost model's step
times, planner/runtime/serve/generate.py Engine with real forwards, so the lab and the model
schedule the same way. Requests carry a prompt and an output length; each step is a list of
prefill chunks (request, tokens, tokens already cached) and a list of decoding requests (one
token each).

Engines (`ENGINES`), each as its source documents it:
- "vllm": vLLM's V1 scheduler (vllm/v1/core/sched/scheduler.py, the default engine since
  v0.8; Kwon et al. 2023 for the paged cache): a token budget per step,
  max_num_batched_tokens; the running requests first, in admission order (a decode takes 1
  token, an unfinished prompt its next chunk, as much as the budget leaves), then waiting
  requests first come first served while the budget, max_num_seqs and the free KV blocks allow
  (chunked prefill is always on: a prompt longer than what the budget leaves gets a chunk).
  Prefill chunks and decodes share one step (SARATHI's mixed batches, Agrawal et al. 2023).
  KV blocks are allocated as tokens are computed; when a running request needs a block and none
  is free, the last-admitted running request is preempted (its blocks freed, put back at the
  head of the queue, recomputed from scratch later: vLLM's recompute preemption), and no new
  request is admitted in that step.
- "sglang": SGLang's scheduler (python/sglang/srt/managers/scheduler.py
  get_next_batch_to_run): a step is either a prefill batch (a chunked request's next chunk,
  then new requests up to chunked_prefill_size tokens) or, when none can start, a decode of
  every running request; prefills and decodes are not mixed (--enable-mixed-chunk is off by
  default); a decode short of memory retracts the last request (recompute).
- "vllm-v0": vLLM's V0 scheduler without chunked prefill (vllm/core/scheduler.py
  _schedule_default: "First, it batches as many prefill requests as possible. And it schedules
  decodes"): a step is the waiting prompts, whole (never cut), up to the token budget, or else a decode of
  the running batch; never mixed. V0 (the default engine before v0.8.0) turned chunked prefill on
  by default only for max_model_len > 32768 (vllm/engine/arg_utils.py create_engine_config) and
  then budgets max(max_model_len, 2048) tokens per step (vllm/config.py SchedulerConfig); the
  caller sets that budget (Deployment.prefill_chunk). The same step rule as "sglang".
- "executor": planner/runtime/serve/generate.py's engine: one whole prompt per prefill step,
  prefills first, else a decode of the running batch (vLLM's V0 default without chunked
  prefill, one prompt at a time).

Prefix caching (vLLM --enable-prefix-caching, on by default in V1; SGLang's radix cache): the
first `prefix_len` prompt tokens are shared by every request (a system prompt); once one
request has computed them, later ones start with the whole blocks of it cached and skip their
compute. The shared blocks are held once, for the rest of the run.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

ENGINES = ("vllm", "sglang", "executor", "vllm-v0")


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    engine: str = "vllm"
    max_num_seqs: int = 256
    max_num_batched_tokens: float = math.inf
    """Tokens per step (vllm: prefill and decode together; sglang: per prefill batch)."""
    block_size: int = 16
    kv_blocks: float = math.inf
    """Blocks of the paged KV cache (math.inf: unbounded, the executor's padded slots)."""
    prefix_len: int = 0
    """Prompt tokens every request shares (0: none), reused only with prefix_caching."""
    prefix_caching: bool = False

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.max_num_seqs < 1 or not self.max_num_batched_tokens >= 1 or self.block_size < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and block_size must be >= 1")


@dataclass(slots=True)
class Step:
    chunks: list[tuple[int, int, int]] = field(default_factory=list)
    """(request, tokens computed this step, tokens it had cached before)."""
    decodes: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.chunks or self.decodes)


class Scheduler:
    """Requests 0..n-1 with lengths `lens` [(prompt, output)]; add() when one arrives,
    schedule() -> Step, complete(step) after it ran -> (first-token requests, finished ones)."""

    def __init__(self, cfg: SchedulerConfig, lens: list[tuple[int, int]]) -> None:
        self.cfg = cfg
        self.prompt = [p for p, _ in lens]
        self.out = [o for _, o in lens]
        n = len(lens)
        self.computed = [0] * n   # tokens whose KV is cached
        self.target = [0] * n     # tokens to compute before the next token comes out (prompt + generated)
        self.gen = [0] * n
        self.held = [0] * n       # blocks this request holds (shared prefix blocks not counted)
        self.shared = [0] * n     # cached prefix tokens it reuses
        self.free = cfg.kv_blocks
        self.waiting: deque[int] = deque()
        self.running: list[int] = []
        self.preemptions = 0
        self.prefix_ready = False
        bs = cfg.block_size
        self.prefix_tokens = (cfg.prefix_len // bs) * bs if cfg.prefix_caching else 0
        for i in range(n):
            if math.ceil((self.prompt[i] + self.out[i]) / bs) > cfg.kv_blocks:
                raise ValueError(f"request of {self.prompt[i] + self.out[i]} tokens needs "
                                 f"{math.ceil((self.prompt[i] + self.out[i]) / bs)} KV blocks, the cache has "
                                 f"{cfg.kv_blocks}")

    # --- queue -------------------------------------------------------------------------
    def add(self, i: int) -> None:
        self.target[i] = self.prompt[i]
        self.waiting.append(i)

    def idle(self) -> bool:
        return not self.running and not self.waiting

    def _prefilling(self, i: int) -> bool:
        return self.computed[i] < self.target[i]

    def _blocks(self, i: int, tokens: int) -> int:
        """More blocks request i needs to hold `tokens` more computed tokens."""
        total = math.ceil((self.computed[i] + tokens - self.shared[i]) / self.cfg.block_size)
        return max(0, total - self.held[i])

    def _preempt(self, step: Step) -> int:
        v = self.running.pop()
        self.free += self.held[v]
        self.held[v] = 0
        self.computed[v] = 0
        self.shared[v] = 0
        self.target[v] = self.prompt[v] + self.gen[v]  # recompute prompt and what it generated
        self.waiting.appendleft(v)
        step.preempted.append(v)
        self.preemptions += 1
        return v

    def _admit(self, i: int, budget: float) -> int:
        """Tokens request i (head of the queue) gets when admitted now (0: it cannot be)."""
        cfg = self.cfg
        hit = 0
        if self.prefix_tokens and self.prefix_ready and self.computed[i] == 0:
            hit = min(self.prefix_tokens, ((self.target[i] - 1) // cfg.block_size) * cfg.block_size)
        need = self.target[i] - hit
        if cfg.engine in ("executor", "vllm-v0") and need > budget:  # whole prompts only
            return 0
        n = int(min(need, budget))
        self.shared[i] = hit
        self.computed[i] = hit
        blocks = self._blocks(i, n)
        if blocks > self.free:
            self.shared[i] = self.computed[i] = 0
            return 0
        self.free -= blocks
        self.held[i] += blocks
        return n

    def _take_waiting(self, step: Step, budget: float) -> float:
        cfg = self.cfg
        limit = 1 if cfg.engine == "executor" else math.inf
        while self.waiting and len(self.running) < cfg.max_num_seqs and budget >= 1 and len(step.chunks) < limit:
            i = self.waiting[0]
            n = self._admit(i, budget)
            if n == 0:
                break
            self.waiting.popleft()
            self.running.append(i)
            step.chunks.append((i, n, self.computed[i]))
            budget -= n
        return budget

    # --- one step ------------------------------------------------------------------------
    def schedule(self) -> Step:
        step = Step()
        if self.cfg.engine == "vllm":
            self._mixed(step)
        else:
            self._separate(step)
        return step

    def _mixed(self, step: Step) -> None:
        budget = self.cfg.max_num_batched_tokens
        k = 0
        while k < len(self.running) and budget >= 1:
            i = self.running[k]
            n = int(min(self.target[i] - self.computed[i], budget)) if self._prefilling(i) else 1
            if not self._hold(step, i, n):
                break
            if self._prefilling(i):
                step.chunks.append((i, n, self.computed[i]))
            else:
                step.decodes.append(i)
            budget -= n
            k += 1
        if not step.preempted:
            self._take_waiting(step, budget)

    def _hold(self, step: Step, i: int, n: int) -> bool:
        """Hold the KV blocks running request i needs for n more tokens, preempting the newest
        running requests until they fit; False when i itself had to be preempted."""
        need = self._blocks(i, n)
        while need > self.free and self.running:
            if self._preempt(step) == i:
                break
        if step.preempted and step.preempted[-1] == i:
            return False
        self.free -= need
        self.held[i] += need
        return True

    def _separate(self, step: Step) -> None:
        budget = self.cfg.max_num_batched_tokens
        for i in self.running:  # a chunked prompt's next chunk first
            if self._prefilling(i) and budget >= 1:
                n = int(min(self.target[i] - self.computed[i], budget))
                need = self._blocks(i, n)
                if need > self.free:
                    break
                self.free -= need
                self.held[i] += need
                step.chunks.append((i, n, self.computed[i]))
                budget -= n
        budget = self._take_waiting(step, budget)
        if step.chunks:
            return
        k = 0
        while k < len(self.running):
            i = self.running[k]
            if not self._hold(step, i, 1):
                break
            step.decodes.append(i)
            k += 1

    def finish(self, i: int) -> None:
        """Request i stops early (the engine saw its end-of-sequence token): it leaves, freeing its blocks."""
        self.running.remove(i)
        self.free += self.held[i]
        self.held[i] = 0

    def decode_context(self, step: Step) -> int:
        """Tokens the step's decodes attend to: each one's cached tokens plus its new one."""
        return sum(self.computed[i] + 1 for i in step.decodes)

    def complete(self, step: Step) -> tuple[list[int], list[int]]:
        """Account for a step that ran: (requests whose first token came out, requests done)."""
        first, done = [], []
        for i, n, _ in step.chunks:
            self.computed[i] += n
            if self.prefix_tokens and not self.prefix_ready and self.computed[i] >= self.prefix_tokens:
                # the first copy of the shared prefix: its blocks stay cached (held once, never freed)
                self.prefix_ready = True
                self.shared[i] = self.prefix_tokens
                self.held[i] -= self.prefix_tokens // self.cfg.block_size
            if self.computed[i] >= self.target[i]:
                if self.gen[i] == 0:
                    first.append(i)
                self.gen[i] += 1
        for i in step.decodes:
            self.computed[i] += 1
            self.gen[i] += 1
        for i, *_ in step.chunks:
            if self.gen[i] >= self.out[i] and not self._prefilling(i):
                done.append(i)
        done += [i for i in step.decodes if self.gen[i] >= self.out[i]]
        for i in done:
            self.running.remove(i)
            self.free += self.held[i]
            self.held[i] = 0
        return first, done
