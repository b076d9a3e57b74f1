"""Plan: the decisions the planner makes. Nothing here is derived from hardware.

Rank layout (one vocabulary, said once): global rank = (pp_index * dp + dp_index) * tp + tp_index,
i.e. torch.arange(world).view(pp, dp, tp) -- tensor parallel fastest, pipeline slowest,
the order of DeepSpeed's PipeModelDataParallelTopology (axes pipe, data, model).
Checkpointed layers: in each stage the first `recompute_layers[i]` blocks are checkpointed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from planner.errors import SpecError
from planner.specs.hardware import PRECISIONS

RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("1f1b", "interleaved")


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    dp: int = 1
    """Data-parallel degree."""
    tp: int = 1
    """Tensor-parallel degree (inside a node). 1 means disabled."""
    pp: int = 1
    """Pipeline-parallel degree (stages). 1 means disabled."""
    zero: int = 0
    """ZeRO stage 0-3 (0-1 only with pp > 1: DeepSpeed's PipelineEngine rule)."""
    micro_batch: int = 1
    """Sequences per micro-batch per data-parallel rank."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (the pipeline's m)."""
    stage_layers: tuple[int, ...] = ()
    """Transformer blocks per pipeline stage; sums to the model's layers; () = uniform."""
    recompute: str = "none"
    """none, selective (attention core only, Korthikanti et al.) or full (whole block)."""
    recompute_layers: tuple[int, ...] = ()
    """Full recompute: checkpointed blocks per stage (the first k of each stage)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism in the TP group (norms/dropout sharded by sequence)."""
    schedule: str = "1f1b"
    """1f1b or interleaved (virtual stages)."""
    interleave: int = 1
    """Virtual chunks per stage v for the interleaved schedule (1 otherwise)."""
    precision: str = "bf16"
    """bf16, fp16 or fp32."""
    overlap_comm: bool = True
    """Overlap the DP gradient reduction with the backward pass (DeepSpeed overlap_comm)."""
    bucket_elements: int = 50_000_000
    """reduce/allgather bucket size in elements (DeepSpeed reduce_bucket_size)."""

    def __post_init__(self) -> None:
        for f in ("dp", "tp", "pp", "micro_batch", "grad_accum", "interleave", "bucket_elements"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise SpecError(f"plan.{f}", f"must be a positive integer, got {v!r}", "give a positive integer")
        if self.zero not in (0, 1, 2, 3):
            raise SpecError("plan.zero", f"ZeRO stage must be 0-3, got {self.zero!r}", "use 0, 1, 2 or 3")
        if self.pp > 1 and self.zero > 1:
            raise SpecError("plan.zero", f"ZeRO-{self.zero} cannot run with pipeline parallelism (pp={self.pp})",
                            "use ZeRO 0 or 1 with pp > 1 (DeepSpeed PipelineEngine)")
        if self.recompute not in RECOMPUTE:
            raise SpecError("plan.recompute", f"unknown value {self.recompute!r}", f"use one of {', '.join(RECOMPUTE)}")
        if self.schedule not in SCHEDULES:
            raise SpecError("plan.schedule", f"unknown value {self.schedule!r}", f"use one of {', '.join(SCHEDULES)}")
        if self.schedule == "1f1b" and self.interleave != 1:
            raise SpecError("plan.interleave", "needs the interleaved schedule", "set schedule=interleaved or interleave=1")
        if self.schedule == "interleaved" and self.pp == 1:
            raise SpecError("plan.schedule", "interleaving needs pp > 1", "use 1f1b")
        if self.precision not in PRECISIONS:
            raise SpecError("plan.precision", f"unknown value {self.precision!r}", f"use one of {', '.join(PRECISIONS)}")
        if self.stage_layers and len(self.stage_layers) != self.pp:
            raise SpecError("plan.stage_layers", f"has {len(self.stage_layers)} stages, pp={self.pp}",
                            "give one layer count per pipeline stage")
        if any(n < 0 for n in self.stage_layers):
            raise SpecError("plan.stage_layers", "counts must be >= 0", "fix the stage boundaries")
        if self.recompute_layers and len(self.recompute_layers) != self.pp:
            raise SpecError("plan.recompute_layers", f"has {len(self.recompute_layers)} entries, pp={self.pp}",
                            "give one checkpointed-layer count per pipeline stage")
        if self.stage_layers and self.recompute_layers and any(
                r < 0 or r > n for r, n in zip(self.recompute_layers, self.stage_layers)):
            raise SpecError("plan.recompute_layers", "must be between 0 and the stage's layer count",
                            "checkpoint at most every layer of a stage")
        if self.sequence_parallel and self.tp == 1:
            raise SpecError("plan.sequence_parallel", "needs tp > 1", "drop --sequence-parallel or raise --tp")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp

    def layers_per_stage(self, layers: int) -> tuple[int, ...]:
        """stage_layers, or the uniform split (earlier stages take the remainder)."""
        if self.stage_layers:
            return self.stage_layers
        base, extra = divmod(layers, self.pp)
        return tuple(base + (1 if i < extra else 0) for i in range(self.pp))

    def checkpointed_per_stage(self, layers: int) -> tuple[int, ...]:
        """Blocks under full recompute in each stage."""
        per_stage = self.layers_per_stage(layers)
        if self.recompute != "full":
            return tuple(0 for _ in per_stage)
        if self.recompute_layers:
            return self.recompute_layers
        return per_stage

    def describe(self) -> str:
        """The plan in words, e.g. "ZeRO-1, TP 4 x PP 8 x DP 24, micro-batch 1, accumulation 176"."""
        rc = {"none": "no recompute", "selective": "selective recompute", "full": "full recompute"}[self.recompute]
        if self.recompute == "full" and self.recompute_layers and self.stage_layers and \
                tuple(self.recompute_layers) != tuple(self.stage_layers):
            rc = f"full recompute of {sum(self.recompute_layers)}/{sum(self.stage_layers)} layers"
        parts = [f"ZeRO-{self.zero}", f"TP {self.tp} x PP {self.pp} x DP {self.dp}",
                 f"micro-batch {self.micro_batch}", f"accumulation {self.grad_accum}", rc, self.precision]
        if self.sequence_parallel:
            parts.append("sequence parallel")
        if self.schedule == "interleaved":
            parts.append(f"interleaved x{self.interleave}")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["stage_layers"] = list(self.stage_layers)
        d["recompute_layers"] = list(self.recompute_layers)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        if not isinstance(data, Mapping):
            raise SpecError("plan", "must be a JSON object", "pass the plan section of plan.json")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise SpecError("plan", f"unknown field(s) {sorted(unknown)}", f"use only {sorted(names)}")
        kw = dict(data)
        for f in ("stage_layers", "recompute_layers"):
            if f in kw:
                if not isinstance(kw[f], (list, tuple)) or any(
                        not isinstance(x, int) or isinstance(x, bool) for x in kw[f]):
                    raise SpecError(f"plan.{f}", "must be a list of integers", "fix plan.json")
                kw[f] = tuple(kw[f])
        return cls(**kw)
