"""Greedy generation on the executor's GLM model: a KV cache and continuous batching.

The model (planner/model/glm.py) is the one training builds, run by its own forward with a KV
cache (planner/model/kvcache.py: KVCache, and a KVStep that each block's attention appends to
and attends over); the TP collectives are the layers' own (Megatron-style, on gloo).

- CachedForward: new tokens of b sequences (prefill: one sequence, its whole prompt; decode:
  one token of each running sequence) through GLMModel.forward(..., kv=step). Logits are
  vocab-parallel: the last position's slices are all-gathered over the TP group and the padded
  rows dropped, so the greedy argmax is the single-process one.
- Engine: continuous batching (Yu et al. 2022, "Orca", iteration-level scheduling); every
  step is decided by planner/serve/scheduler.py's "executor" engine, the scheduler that
  planner/serve/queue.py simulate runs (waiting prefills first, bounded by max_batch
  sequences): arrived requests are queued; if one waits and a slot is free, the step is its
  prefill (one prompt per step); else it is a decode of every running sequence, after which
  finished ones (output_len tokens or eos) leave. Each step
  records its forward seconds (time_s), the engine's own seconds before it since the
  previous step ended (host_s: scheduling, the step broadcast; 0 after an idle wait) and
  whether it is the first step after an idle wait (after_idle: the engine slept for an arrival). Under
  TP, rank 0 schedules and broadcasts each step (op, slots, tokens) to the other ranks, which
  run the same forward.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from planner.errors import ExecutionError
from planner.model.glm import GLMModel
from planner.model.kvcache import KVCache
from planner.model.parallel.groups import SINGLE, TPGroup
from planner.serve.scheduler import Scheduler, SchedulerConfig
from planner.specs.model import ModelSpec


def build_model(spec: ModelSpec, tp: TPGroup = SINGLE, seed: int = 1234,
                dtype: torch.dtype = torch.float32) -> GLMModel:
    """The executor's model in eval mode (no dropout, no checkpointing): TP slices of the same
    seeded weights for every TP degree (parallel/tensor.py seeded_normal)."""
    model = GLMModel(spec, [False] * spec.layers, False, tp=tp, seed=seed)
    return model.to(dtype).eval()


def gather_vocab(local: torch.Tensor, spec: ModelSpec, tp: TPGroup) -> torch.Tensor:
    """Full logits [..., vocab] from this rank's vocab-parallel slice [..., V_pad/T]."""
    if tp.group is not None:
        parts = [torch.empty_like(local) for _ in range(tp.size)]
        dist.all_gather(parts, local.contiguous(), group=tp.group)
        local = torch.cat(parts, dim=-1)
    return local[..., :spec.vocab]


class CachedForward:
    """The model's own forward over new tokens with a KV cache (GLMModel.forward with a KVStep,
    planner/model/kvcache.py); the logits of each sequence's last new token, whole vocabulary."""

    def __init__(self, model: GLMModel, spec: ModelSpec, tp: TPGroup = SINGLE) -> None:
        self.model, self.spec, self.tp = model, spec, tp

    @torch.no_grad()
    def __call__(self, cache: KVCache, ids: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """ids [b, s] are the next s tokens of the sequences in `slots` (appended at each slot's
        length); returns the full-vocabulary logits of each sequence's last new token [b, vocab]."""
        step = cache.step(slots, ids.shape[1])
        local = self.model(ids, step.pos, torch.zeros_like(step.pos), kv=step)
        step.done()
        return gather_vocab(local[:, 0], self.spec, self.tp)


@torch.no_grad()
def greedy_no_cache(model: GLMModel, spec: ModelSpec, prompt: list[int], steps: int,
                    tp: TPGroup = SINGLE) -> list[int]:
    """The reference: the plain (training) forward over the whole prefix at every step."""
    ids = list(prompt)
    out = []
    for _ in range(steps):
        t = torch.tensor([ids])
        pos = torch.arange(len(ids))[None]
        logits = gather_vocab(model(t, pos, torch.zeros_like(pos))[:, -1], spec, tp)
        nxt = int(logits.argmax(-1))
        out.append(nxt)
        ids.append(nxt)
    return out


def greedy_cached(fwd: CachedForward, prompt: list[int], steps: int, dtype: torch.dtype = torch.float32) -> list[int]:
    """One request alone through the KV cache: prefill, then steps - 1 decode steps."""
    cache = KVCache(fwd.spec, fwd.tp, 1, len(prompt) + steps, dtype)
    nxt = int(fwd(cache, torch.tensor([prompt]), [0]).argmax(-1))
    out = [nxt]
    for _ in range(steps - 1):
        nxt = int(fwd(cache, torch.tensor([[nxt]]), [0]).argmax(-1))
        out.append(nxt)
    return out


# --- continuous batching --------------------------------------------------------------------


@dataclass
class Request:
    """One generation request; times are wall-clock seconds since the engine's start."""

    rid: int
    prompt: list[int]
    output_len: int
    arrival_s: float = 0.0
    tokens: list[int] = field(default_factory=list)
    first_token_s: float | None = None
    finish_s: float | None = None
    slot: int = -1


OP_STOP, OP_PREFILL, OP_DECODE = 0, 1, 2


class StepChannel:
    """Rank 0 -> the other TP ranks: each step's op and batch (slots, tokens), broadcast over
    the TP group as a 3-int header then the payload. A no-op without TP."""

    def __init__(self, tp: TPGroup) -> None:
        self.tp = tp
        self.src = dist.get_global_rank(tp.group, 0) if tp.group is not None else 0

    def send(self, op: int, slots: list[int], tokens: list[int]) -> None:
        if self.tp.group is None:
            return
        dist.broadcast(torch.tensor([op, len(slots), len(tokens)]), self.src, group=self.tp.group)
        if op != OP_STOP:
            dist.broadcast(torch.tensor(slots + tokens, dtype=torch.long), self.src, group=self.tp.group)

    def receive(self) -> tuple[int, list[int], list[int]]:
        head = torch.zeros(3, dtype=torch.long)
        dist.broadcast(head, self.src, group=self.tp.group)
        op, n, m = (int(v) for v in head)
        if op == OP_STOP:
            return op, [], []
        body = torch.zeros(n + m, dtype=torch.long)
        dist.broadcast(body, self.src, group=self.tp.group)
        values = body.tolist()
        return op, values[:n], values[n:]


class Engine:
    """Continuous batching over `max_batch` cache slots (rank 0 drives; see `follow` for the others)."""

    def __init__(self, fwd: CachedForward, max_batch: int, max_len: int, dtype: torch.dtype = torch.float32,
                 eos_id: int | None = None) -> None:
        if max_batch < 1:
            raise ExecutionError("--max-batch", f"must be >= 1, got {max_batch}", "e.g. --max-batch 4")
        self.fwd, self.max_batch, self.eos_id = fwd, max_batch, eos_id
        self.cache = KVCache(fwd.spec, fwd.tp, max_batch, max_len, dtype)
        self.channel = StepChannel(fwd.tp)
        self.prefills: list[dict] = []
        self.decode_steps: list[dict] = []
        self._last_end: float | None = None
        self._idle = True

    def _host_s(self, t0: float) -> float:
        """Seconds since the previous step ended that went to the engine itself (scheduling,
        the step broadcast to the TP ranks, request bookkeeping): 0 after an idle wait."""
        host = 0.0 if self._idle or self._last_end is None else max(0.0, t0 - self._last_end)
        self._idle = False
        return host

    def _prefill(self, req: Request, slot: int) -> int:
        t_host = time.perf_counter()
        self.channel.send(OP_PREFILL, [slot], req.prompt)
        self.cache.lengths[slot] = 0
        t0 = time.perf_counter()
        nxt = int(self.fwd(self.cache, torch.tensor([req.prompt]), [slot]).argmax(-1))
        self._last_end = time.perf_counter()
        idle = self._idle
        self.prefills.append({"tokens": len(req.prompt), "time_s": self._last_end - t0,
                              "host_s": self._host_s(t_host) + (t0 - t_host), "after_idle": idle})
        return nxt

    def _decode(self, running: list[Request]) -> list[int]:
        t_host = time.perf_counter()
        slots, tokens = [r.slot for r in running], [r.tokens[-1] for r in running]
        self.channel.send(OP_DECODE, slots, tokens)
        context = sum(self.cache.lengths[i] + 1 for i in slots)  # tokens attended, the new one included
        t0 = time.perf_counter()
        nxt = self.fwd(self.cache, torch.tensor(tokens)[:, None], slots).argmax(-1).tolist()
        self._last_end = time.perf_counter()
        idle = self._idle
        self.decode_steps.append({"batch": len(slots), "context_tokens": context, "time_s": self._last_end - t0,
                                  "host_s": self._host_s(t_host) + (t0 - t_host), "after_idle": idle})
        return nxt

    def _done(self, req: Request) -> bool:
        return len(req.tokens) >= req.output_len or (self.eos_id is not None and req.tokens[-1] == self.eos_id)

    def run(self, requests: list[Request], *, deadline_s: float = float("inf"),
            clock: Callable[[], float] | None = None) -> list[Request]:
        """Serve `requests` (arrival_s: seconds after the start) in real time; returns the finished
        ones. Stops admitting at deadline_s and drops what is still running then. Each step is
        what planner/serve/scheduler.py's "executor" engine schedules (the policy
        planner/serve/queue.py simulates): one waiting prompt's prefill while a slot is free,
        else a decode of the running batch."""
        start = time.perf_counter()
        now = clock or (lambda: time.perf_counter() - start)
        reqs = sorted(requests, key=lambda r: r.arrival_s)
        sched = Scheduler(SchedulerConfig(engine="executor", max_num_seqs=self.max_batch),
                          [(len(r.prompt), r.output_len) for r in reqs])
        finished: list[Request] = []
        free = list(range(self.max_batch))
        nxt = 0
        self._idle = True
        try:
            while (nxt < len(reqs) or not sched.idle()) and now() < deadline_s:
                while nxt < len(reqs) and reqs[nxt].arrival_s <= now():
                    sched.add(nxt)
                    nxt += 1
                step = sched.schedule()
                if not step:
                    if nxt >= len(reqs):
                        raise ExecutionError("engine", "requests wait that the scheduler cannot start",
                                             "report this: the scheduler and the engine disagree")
                    time.sleep(max(0.0, min(reqs[nxt].arrival_s - now(), deadline_s - now())))
                    self._idle = True
                    continue
                if step.chunks:  # the executor engine: one whole prompt
                    req = reqs[step.chunks[0][0]]
                    req.slot = free.pop(0)
                    req.tokens.append(self._prefill(req, req.slot))
                    req.first_token_s = now()
                else:
                    batch = [reqs[i] for i in step.decodes]
                    for req, tok in zip(batch, self._decode(batch)):
                        req.tokens.append(tok)
                t = now()
                _, done = sched.complete(step)
                for i in list(sched.running):  # an end-of-sequence token: it leaves early
                    if self._done(reqs[i]):
                        sched.finish(i)
                        done.append(i)
                for i in done:
                    self._leave(reqs[i], free, finished, t)
        finally:
            self.channel.send(OP_STOP, [], [])
        return finished

    @staticmethod
    def _leave(req: Request, free: list, finished: list, t: float) -> None:
        req.finish_s = t
        free.append(req.slot)
        free.sort()
        finished.append(req)

    def follow(self) -> None:
        """A TP rank other than 0: run every step rank 0 broadcasts until it stops."""
        while True:
            op, slots, tokens = self.channel.receive()
            if op == OP_STOP:
                return
            if op == OP_PREFILL:
                self.cache.lengths[slots[0]] = 0
                self.fwd(self.cache, torch.tensor([tokens]), slots)
            else:
                self.fwd(self.cache, torch.tensor(tokens)[:, None], slots)
