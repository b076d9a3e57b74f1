"""Exact stage partition: blocks per pipeline stage minimising the slowest stage, within memory.

All transformer blocks cost the same (planner.cost.LayerCosts), so a partition is a count
per stage; the embedding sits on the first stage and the output layer and loss on the last,
and stage i holds `in_flight[i]` micro-batches of activations (1F1B: p - i). For stage i with
n blocks, its time t_i(n) uses the fewest checkpointed blocks that fit (checkpoint.py); t_i
is non-decreasing in n. Minimising max_i t_i(n_i) subject to sum n_i = L, n_i >= 1 is a
minimax allocation with monotone separable costs, for which the greedy rule "give the next
block to the stage whose time after taking it is smallest" is optimal (Ibaraki & Katoh,
Resource Allocation Problems, MIT Press 1988, ch. 4; the argument: after every step the
current maximum is a lower bound on any allocation with at least as many blocks).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from planner.search.checkpoint import StageModel
from planner.specs.estimate import GB
from planner.specs.problems import MEMORY, Problem


@dataclass(frozen=True, slots=True, kw_only=True)
class Partition:
    """Blocks and checkpointed blocks per stage, with the solver's per-stage numbers."""

    stage_layers: tuple[int, ...]
    checkpointed: tuple[int, ...]
    stage_times: tuple[float, ...]
    """Forward + backward seconds of one micro-batch per stage."""
    stage_bytes: tuple[float, ...]

    @property
    def slowest(self) -> float:
        return max(self.stage_times)


@dataclass(frozen=True, slots=True, kw_only=True)
class NoFit:
    """No partition fits: the tightest stage and the memory it would need at least."""

    stage: int
    needs_bytes: float
    capacity_bytes: float

    @property
    def problem(self) -> Problem:
        return Problem("memory", MEMORY, f"stage {self.stage} needs {self.needs_bytes / GB:.1f} GB > "
                       f"{self.capacity_bytes / GB:.1f} GB even with the best stage split and checkpointing")

    @property
    def reason(self) -> str:
        return self.problem.line


def least_bytes(sm: StageModel, layers: int, checkpoint: bool) -> NoFit:
    """The smallest peak memory any split reaches (every block checkpointed when allowed):
    the same greedy, on memory instead of time."""
    pp = sm.pp
    k = (lambda n: n) if checkpoint else (lambda n: 0)
    if pp == 1:
        return NoFit(stage=0, needs_bytes=sm.bytes(0, layers, k(layers)), capacity_bytes=sm.capacity)
    n = [1] * pp
    heap = [(sm.bytes(i, 2, k(2)), i) for i in range(pp)]
    heapq.heapify(heap)
    for _ in range(layers - pp):
        _, i = heapq.heappop(heap)
        n[i] += 1
        heapq.heappush(heap, (sm.bytes(i, n[i] + 1, k(n[i] + 1)), i))
    per = [sm.bytes(i, n[i], k(n[i])) for i in range(pp)]
    worst = max(range(pp), key=lambda i: per[i])
    return NoFit(stage=worst, needs_bytes=per[worst], capacity_bytes=sm.capacity)


def solve(sm: StageModel, layers: int, checkpoint: bool) -> Partition | NoFit:
    """Optimal blocks per stage (and fewest checkpointed blocks, when `checkpoint`)."""
    pp = sm.pp
    if pp == 1:
        k = sm.fewest_checkpointed(0, layers, checkpoint)
        if k is None:
            return least_bytes(sm, layers, checkpoint)
        return Partition(stage_layers=(layers,), checkpointed=(k,), stage_times=(sm.time(0, layers, k),),
                         stage_bytes=(sm.bytes(0, layers, k),))
    n = [1] * pp
    ks = []
    for i in range(pp):
        k = sm.fewest_checkpointed(i, 1, checkpoint)
        if k is None:
            return least_bytes(sm, layers, checkpoint)
        ks.append(k)
    inf = float("inf")

    def candidate(i: int) -> tuple[float, int, int]:
        k = sm.fewest_checkpointed(i, n[i] + 1, checkpoint)
        if k is None:
            return inf, i, 0
        return sm.time(i, n[i] + 1, k), i, k

    heap = [candidate(i) for i in range(pp)]
    heapq.heapify(heap)
    for _ in range(layers - pp):
        t, i, k = heapq.heappop(heap)
        if t == inf:
            return least_bytes(sm, layers, checkpoint)
        n[i] += 1
        ks[i] = k
        heapq.heappush(heap, candidate(i))
    return Partition(stage_layers=tuple(n), checkpointed=tuple(ks),
                     stage_times=tuple(sm.time(i, n[i], ks[i]) for i in range(pp)),
                     stage_bytes=tuple(sm.bytes(i, n[i], ks[i]) for i in range(pp)))
