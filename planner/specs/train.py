"""TrainSpec: what the user wants trained, independent of how it is parallelised."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from planner.errors import SpecError
from planner.specs.hardware import TRAIN_PRECISIONS

ATTENTION = ("flash", "eager")
ATTENTION_BACKENDS = ("", "fa1", "fa2", "fa3", "cudnn", "triton")
"""Flash-kernel families a runtime can be told to run (profiles' kernels.attention); "" = the
runtime's own preference (profiles/runtimes/<name>.json "attention_kernels")."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainSpec:
    global_batch: int
    """Sequences per optimizer step (micro-batch x accumulation x DP)."""
    seq_len: int
    """Tokens per sequence."""
    precision: str = "bf16"
    """bf16, fp16 (mixed precision with fp32 master weights), fp32, or fp8 (bf16 mixed precision with
    the weight GEMMs in FP8 through Transformer Engine: megatron-core and fsdp on FP8 GPUs)."""
    optimizer: str = "adamw"
    """Adam(W): 12 bytes of fp32 state per parameter in mixed precision (ZeRO, K=12)."""
    attention: str = "flash"
    """Attention kernel: "flash" (torch scaled_dot_product_attention, memory-efficient/flash:
    no s x s tensor is kept, backward recomputes the scores) or "eager" (softmax(QK^T)V in
    plain ops, the softmax and its dropout mask stored: Korthikanti et al. 2022, Table 2)."""
    attention_backend: str = ""
    """The flash kernel family the runtime is configured to run, where its environment overrides
    the runtime's preference: e.g. "fa2" under Transformer Engine with NVTE_FUSED_ATTN=0 (which
    disables cuDNN's fused attention, leaving FlashAttention-2). "" = the runtime's own order
    (profiles/runtimes/<name>.json "attention_kernels")."""

    def __post_init__(self) -> None:
        for f in ("global_batch", "seq_len"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise SpecError(f"--{f.replace('_', '-')}", f"must be a positive integer, got {v!r}",
                                "give a positive integer")
        if self.precision not in TRAIN_PRECISIONS:
            raise SpecError("--precision", f"unknown precision {self.precision!r}", f"use one of {', '.join(TRAIN_PRECISIONS)}")
        if self.attention not in ATTENTION:
            raise SpecError("--attention", f"unknown attention kernel {self.attention!r}",
                            f"use one of {', '.join(ATTENTION)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise SpecError("--attention-backend", f"unknown attention backend {self.attention_backend!r}",
                            f"use one of {', '.join(b for b in ATTENTION_BACKENDS if b)} (or leave it unset)")

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if not self.attention_backend:  # unset: run directories written before the field load as they were
            del d["attention_backend"]
        return d
