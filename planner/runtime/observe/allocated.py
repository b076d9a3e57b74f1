"""The allocated peak on a CPU rank: live tensor bytes, as a GPU's allocator counts them
(docs/lab.md "Memory as a GPU counts it")."""
from __future__ import annotations

import torch

ALLOCATED_METHOD = {
    "cpu": "peak of live tensor bytes (torch.profiler memory events of the CPU allocator) from the post-init "
           "reset through the warm-up steps (at least two)",
    "cuda": "torch.cuda.max_memory_allocated after reset post-init"}


class AllocatedMeter:
    """The peak of live tensor bytes on a CPU rank: what torch.cuda.max_memory_allocated reports
    on a GPU (every tensor the allocator handed out and has not taken back; not the interpreter,
    libraries, gloo's buffers or freed pages, which peak RSS counts).

    PyTorch's CPU allocator reports each allocation and free to the profiler while one with
    profile_memory runs (c10/core/CPUAllocator.cpp ProfiledCPUMemoryReporter): the profiler is
    started before the model is built, so every tensor of the run is seen from its allocation;
    reset() marks the post-init point (like torch.cuda.reset_peak_memory_stats: the peak starts
    from what is live then), stop() returns the peak since the mark. The profiler costs time
    per operator, so the executor runs it over the warm-up steps (their times are not averaged;
    at least two steps, planner.runtime.train.loop.ALLOCATED_STEPS) and measures peak RSS after it."""

    MARK = "planner::allocated_reset"

    def __init__(self) -> None:
        from torch.profiler import ProfilerActivity, profile
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.start()
        self.running = True

    def reset(self) -> None:
        with torch.profiler.record_function(self.MARK):
            pass

    def stop(self) -> int:
        """Stop the profiler; the peak of live tensor bytes since the last reset (or the start)."""
        self._prof.stop()
        self.running = False
        events = self._prof.profiler.kineto_results.events()
        self._prof = None
        return allocated_peak((e.name(), e.start_ns(), e.nbytes() if e.name() == "[memory]" else 0,
                               str(e.device_type())) for e in events)


def allocated_peak(events) -> int:
    """From (name, start_ns, nbytes, device_type) profiler events: the peak of the running sum
    of CPU "[memory]" events (+ allocation, - free) from the last AllocatedMeter.MARK on, the
    sum at the mark included."""
    evs = sorted(events, key=lambda e: e[1])
    marks = [t for name, t, _, _ in evs if name == AllocatedMeter.MARK]
    mark = marks[-1] if marks else None
    live = peak = 0
    for name, t, nbytes, dev in evs:
        if name != "[memory]" or not dev.endswith("CPU"):
            continue
        live += nbytes
        if mark is None or t >= mark:
            peak = max(peak, live)
        else:
            peak = live  # the sum at the mark: the peak since the reset starts from it
    return int(peak)
