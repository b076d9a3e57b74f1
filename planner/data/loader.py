"""The DataLoader of one rank, and how many worker processes, pinned memory and prefetch it gets.

Rule (docs/data.md "Data-loader settings"): measure the time the rank takes to produce one
micro-batch (pack rows, produce their tokens, stack them), and compare it with the compute time of
one micro-batch (the step time / grad-accum steps, predicted by the cost model or measured):
- produced in at most LOADER_SHARE of the compute time: no worker (0). Producing in line costs
  the step little, and a worker costs a process, a copy of the dataset and a pickle per batch.
- otherwise as many workers as keep up (ceil(produce / compute) + 1 for slack), capped by the
  cores a rank can spare (cores per rank - 1 on a GPU host, where the rank's own process needs one
  core; none on a CPU device, where torch's compute threads use every core) and by MAX_WORKERS.
- pin_memory only when the device is CUDA (page-locked host memory for asynchronous copies).
- prefetch_factor 2 (torch's default: each worker keeps two micro-batches ready); 0 without workers.
`starves` says whether the chosen settings still produce slower than the model consumes.
"""
from __future__ import annotations

import copy
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from planner.data.batching import Layout, Rows

LOADER_SHARE = 0.1
"""Production below this share of a micro-batch's compute time stays in the rank's own process."""
MAX_WORKERS = 4
PREFETCH = 2


@dataclass(frozen=True, slots=True)
class LoaderSettings:
    workers: int
    pin_memory: bool
    prefetch_factor: int
    produce_s: float | None = None
    """Measured seconds to produce one micro-batch in the rank's process (None: not measured)."""
    compute_s: float | None = None
    """Seconds of compute per micro-batch the production was compared with."""
    reason: str = ""

    def __post_init__(self) -> None:
        if self.workers < 0 or self.prefetch_factor < 0 or (self.workers > 0 and self.prefetch_factor < 1):
            raise ValueError("workers >= 0, and prefetch_factor >= 1 when there are workers")

    @property
    def starves(self) -> bool | None:
        """The model waits for data: production per micro-batch, shared over the workers, is
        slower than its compute (None when either is unknown)."""
        if self.produce_s is None or not self.compute_s:
            return None
        return self.produce_s / max(1, self.workers) > self.compute_s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "starves": self.starves}


class MicroBatches:
    """Item i = the i-th micro-batch this rank reads: (ids, pos, segments, labels) tensors.
    The rows are packed here (lengths only); their tokens are produced when the item is read,
    in the rank's process or in a worker (the Rows pickles small). `arrays(k)` gives numpy arrays;
    the training runtime's map-style dataset for torch's DataLoader (planner/runtime/train/build.py
    TensorMicroBatches) adds the tensors. No torch here: `planner search` chooses settings without it."""

    def __init__(self, rows: Rows, layout: Layout, batch_ids: list[int], dp_rank: int) -> None:
        self.index = [(b, m) for b in batch_ids for m in range(layout.grad_accum)]
        self.rows_of = [list(layout.rows(b, m, dp_rank)) for b, m in self.index]
        if self.rows_of:
            rows.plan(max(max(r) for r in self.rows_of))
        self.rows = rows

    def __len__(self) -> int:
        return len(self.index)

    def arrays(self, k: int) -> tuple[np.ndarray, ...]:
        parts = [self.rows.tensors(i) for i in self.rows_of[k]]
        return tuple(np.stack(col) for col in zip(*parts))


def measure_production(rows: Rows, layout: Layout, *, micro_batches: int = 3, dp_rank: int = 0) -> float:
    """Median seconds to produce one micro-batch in this process: pack its rows, produce their
    tokens, stack them (after one warm-up micro-batch, which may build caches)."""
    batches = list(range(math.ceil((micro_batches + 1) / layout.grad_accum)))
    ds = MicroBatches(copy.deepcopy(rows), layout, batches, dp_rank)  # a copy: none of the rank's caches
    times = []
    for k in range(min(len(ds), micro_batches + 1)):
        t0 = time.perf_counter()
        ds.arrays(k)
        times.append(time.perf_counter() - t0)
    return float(np.median(times[1:] if len(times) > 1 else times))


def free_cores(device: str, ranks_per_host: int, cores: int | None = None) -> int:
    """Cores a rank can give to loader workers (see the module docstring)."""
    if device != "cuda":
        return 0
    if cores is None:
        cores = os.cpu_count() or 1
    return max(0, cores // max(1, ranks_per_host) - 1)


def choose_loader(rows: Rows, layout: Layout, *, device: str, step_time_s: float | None,
                  ranks_per_host: int = 1, cores: int | None = None, produce_s: float | None = None) -> LoaderSettings:
    """Workers, pinned memory and prefetch for this host and data (the module docstring's rule).
    step_time_s: the plan's step time (predicted or measured); produce_s: a measured production
    time per micro-batch (measured here when None)."""
    if produce_s is None:
        produce_s = measure_production(rows, layout)
    compute = step_time_s / layout.grad_accum if step_time_s else None
    pin = device == "cuda"
    spare = free_cores(device, ranks_per_host, cores)
    if compute is None:
        return LoaderSettings(0, pin, 0, produce_s, None, "no step time to compare with: produced in line")
    if produce_s <= LOADER_SHARE * compute:
        return LoaderSettings(0, pin, 0, produce_s, compute,
                              f"produced in {produce_s / compute:.1%} of a micro-batch's compute: in line")
    if spare == 0:
        return LoaderSettings(0, pin, 0, produce_s, compute,
                              f"produced in {produce_s / compute:.0%} of a micro-batch's compute, but no core to spare "
                              f"({'CPU device' if device != 'cuda' else f'{ranks_per_host} ranks on this host'})")
    want = math.ceil(produce_s / compute) + 1
    workers = min(want, spare, MAX_WORKERS)
    return LoaderSettings(workers, pin, PREFETCH, produce_s, compute,
                          f"produced in {produce_s / compute:.0%} of a micro-batch's compute: {workers} workers "
                          f"(wanted {want}, {spare} spare cores)")


def loader_record(settings: LoaderSettings) -> dict[str, Any]:
    """What plan.json records under "loader"."""
    return settings.to_dict()


def loader_settings(doc: dict, workers: int | None, device: str):
    """The DataLoader settings of a run: --data-workers when given, else what plan.json records
    under "loader" (choose_loader at search time), else one worker."""
    rec = doc.get("loader") if isinstance(doc, dict) else None
    if workers is None and isinstance(rec, dict):
        try:
            return LoaderSettings(int(rec["workers"]), bool(rec["pin_memory"]), int(rec["prefetch_factor"]),
                                  rec.get("produce_s"), rec.get("compute_s"), str(rec.get("reason", "")))
        except (KeyError, TypeError, ValueError):
            pass
    n = 1 if workers is None else workers
    return LoaderSettings(n, device == "cuda", 2 if n else 0, reason="--data-workers" if workers is not None
                          else "plan.json records no loader settings: one worker")
