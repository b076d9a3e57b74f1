"""Estimate: what the cost model predicts for one plan, with its breakdowns.

Times are seconds per optimizer step; memory is bytes per device (GB = 1e9 bytes in JSON).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from planner.specs.problems import Problem

GB = 1e9


@dataclass(frozen=True, slots=True, kw_only=True)
class TimeBreakdown:
    """Seconds per step on the critical path (the slowest pipeline stage)."""

    forward: float = 0.0
    backward: float = 0.0
    recompute: float = 0.0
    tp_comm: float = 0.0
    """Exposed tensor-parallel all-reduces / reduce-scatters."""
    a2a_comm: float = 0.0
    """Exposed expert-parallel and context-parallel traffic: MoE dispatch/combine all-to-alls,
    DeepSpeed-Ulysses' all-to-alls, ring attention's KV sends not hidden behind the core."""
    pp_comm: float = 0.0
    """Pipeline point-to-point sends on the critical path."""
    bubble: float = 0.0
    """Pipeline fill and drain idle time."""
    dp_sync: float = 0.0
    """Gradient all-reduce / reduce-scatter not hidden behind backward."""
    zero_gather: float = 0.0
    """ZeRO-3 parameter all-gathers not hidden behind compute."""
    optimizer: float = 0.0
    overhead: float = 0.0
    """Fixed per-step runtime overhead (launch, logging, data), from the profile."""

    @property
    def total(self) -> float:
        return (self.forward + self.backward + self.recompute + self.tp_comm + self.a2a_comm + self.pp_comm + self.bubble
                + self.dp_sync + self.zero_gather + self.optimizer + self.overhead)

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryBreakdown:
    """Bytes held by one device of one pipeline stage at its peak."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    """Optimizer states and fp32 master weights."""
    activations: float = 0.0
    """Saved activations of all in-flight micro-batches (+ the working set of one layer)."""
    logits: float = 0.0
    """Output-layer logits and loss buffers (last stage)."""
    buckets: float = 0.0
    """Communication buckets (gradient reduce, ZeRO-3 gather/prefetch)."""
    overhead: float = 0.0
    """Runtime allowance: CUDA context / allocator fragmentation (stated in the profile)."""

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.optimizer + self.activations + self.logits + self.buckets
                + self.overhead)

    def to_gb(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) / GB for f in dataclasses.fields(self)}


TIME_LABELS = {"forward": "forward", "backward": "backward", "recompute": "recompute", "tp_comm": "TP comm",
               "a2a_comm": "EP/CP all-to-all", "pp_comm": "PP send/recv", "bubble": "pipeline bubble",
               "dp_sync": "DP gradient sync", "zero_gather": "ZeRO-3 gathers", "optimizer": "optimizer",
               "overhead": "runtime overhead"}
"""TimeBreakdown fields in words (the report's charts and tables, the CLI)."""
MEMORY_LABELS = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer states",
                 "activations": "activations", "logits": "logits + loss", "buckets": "comm buckets",
                 "overhead": "runtime allowance"}
"""MemoryBreakdown fields in words (the report, and the estimate's memory reason)."""

NEAR_LIMIT = 0.02
"""A plan whose peak (with its headroom) is within this fraction of the capacity is flagged."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Estimate:
    feasible: bool
    problems: tuple[Problem, ...] = ()
    """Why the plan is infeasible (empty when feasible)."""
    step_time_s: float
    time: TimeBreakdown
    tokens_per_s: float
    tflops_per_gpu: float
    """Model FLOPs (no recompute) per device per second, in TFLOP/s."""
    mfu: float
    """Model FLOPs utilisation (fraction of the device's dense peak)."""
    hfu: float
    """Hardware FLOPs utilisation (recompute counted)."""
    stage_memory: tuple[MemoryBreakdown, ...]
    """Per pipeline stage."""
    capacity_bytes: float
    bubble_fraction: float
    model_flops_per_step: float = 0.0
    hardware_flops_per_step: float = 0.0
    stage_times: tuple[tuple[float, float], ...] = ()
    """Per stage, (forward, backward incl. recompute) seconds of one micro-batch."""
    host_memory_bytes: float = 0.0
    """Per rank, model states offloaded to host memory (on a CPU "device" also inside stage_memory)."""
    nvme_bytes: float = 0.0
    """Per rank, model states swapped to NVMe."""
    headroom_bytes: float = 0.0
    """The fixed allowance inside the peak for CUDA context and NCCL buffers (--memory-headroom)."""
    allocated_memory: tuple[MemoryBreakdown, ...] = ()
    """Per stage, the peak of live tensor bytes (what torch.cuda.max_memory_allocated reports):
    every buffer counted whole as allocated, no runtime allowance (overhead 0). stage_memory
    is what the device's peak figure counts: on a GPU this plus the allowance; on a CPU the
    resident set, pages touched plus the process (planner.cost.stage.resident_memory)."""

    @property
    def reasons(self) -> tuple[str, ...]:
        """The problems as sentences (estimate.json "reasons", trials.csv "reason")."""
        return tuple(p.line for p in self.problems)

    @property
    def allocated_peak_bytes(self) -> float:
        return max((m.total for m in self.allocated_memory), default=0.0)

    @property
    def near_limit(self) -> bool:
        """Peak memory (headroom included) within NEAR_LIMIT of the device's capacity."""
        return self.peak_memory_bytes > (1.0 - NEAR_LIMIT) * self.capacity_bytes

    @property
    def peak_stage(self) -> int:
        return max(range(len(self.stage_memory)), key=lambda i: self.stage_memory[i].total)

    @property
    def peak_memory_bytes(self) -> float:
        return self.stage_memory[self.peak_stage].total

    @property
    def peak_memory_gb(self) -> float:
        return self.peak_memory_bytes / GB

    def to_json(self) -> dict[str, Any]:
        return {
            "feasible": self.feasible,
            "reasons": list(self.reasons),
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_gpu": self.tflops_per_gpu,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "peak_memory_gb": self.peak_memory_gb,
            "capacity_gb": self.capacity_bytes / GB,
            "peak_stage": self.peak_stage,
            "memory_breakdown_gb": self.stage_memory[self.peak_stage].to_gb(),
            "stage_memory_gb": [m.to_gb() for m in self.stage_memory],
            "time_breakdown_s": self.time.to_dict(),
            "bubble_fraction": self.bubble_fraction,
            "model_flops_per_step": self.model_flops_per_step,
            "hardware_flops_per_step": self.hardware_flops_per_step,
            "stage_time_s": [{"forward": f, "backward": b} for f, b in self.stage_times],
            "host_memory_gb": self.host_memory_bytes / GB,
            "nvme_gb": self.nvme_bytes / GB,
            "headroom_gb": self.headroom_bytes / GB,
            "near_limit": self.near_limit,
            "allocated_peak_gb": self.allocated_peak_bytes / GB,
            "allocated_memory_gb": [m.to_gb() for m in self.allocated_memory],
        }
