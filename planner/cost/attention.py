"""Which attention kernel runs, and what that means for time and memory.

TrainSpec.attention chooses the kernel the executor runs (README "The cost model"):
- "flash": torch scaled_dot_product_attention with its memory-efficient/flash backend. No
  s x s tensor is kept per head; the softmax and the attention dropout are fused into the
  kernel; its backward recomputes the scores QK^T (Dao et al. 2022, arXiv 2205.14135,
  Algorithm 4), one extra GEMM of the attention core, counted as hardware FLOPs, not model
  FLOPs.
- "eager": softmax(QK^T / sqrt(d) + mask) -> dropout -> @V in plain ops; the softmax, the
  dropout mask and its output are stored per head (Korthikanti et al. 2022, Table 2: the
  5as/h term), and backward reuses them.
- "math": what "flash" becomes on a CPU when the attention dropout is > 0: torch's CPU
  flash kernel has no dropout, so SDPA falls back to its math path, which stores s x s per
  head like eager.

- "linear": causal linear attention (ModelSpec.attention_kind = "linear"; Katharopoulos et
  al. 2020, arXiv 2006.16236), whatever TrainSpec.attention says: the executor's kernel keeps
  only q, k, v and recomputes its chunked forward in backward (like flash), never an s x s
  tensor.

Selective recompute (checkpointing the attention core, Korthikanti et al. 2022, sec. 5)
only saves memory where the scores are stored: eager or math.
"""
from __future__ import annotations

from planner.specs.model import ModelSpec
from planner.specs.train import TrainSpec

KERNELS = ("flash", "eager", "math", "linear")


def attention_kernel(model: ModelSpec, train: TrainSpec, device_kind: str) -> str:
    """The kernel that actually runs: flash, eager, math (the CPU's SDPA fallback) or linear."""
    if model.linear_attention:
        return "linear"
    if train.attention == "eager":
        return "eager"
    if device_kind == "cpu" and model.attention_dropout > 0:
        return "math"
    return "flash"


def stores_scores(kernel: str) -> bool:
    """Whether the kernel keeps an s x s tensor per head for backward."""
    return kernel in ("eager", "math")


def recomputes_scores(kernel: str) -> bool:
    """Whether the kernel's backward recomputes its core forward (flash: QK^T; linear: the
    whole chunked forward)."""
    return kernel in ("flash", "linear")


def selective_saves_memory(model: ModelSpec, train: TrainSpec, device_kind: str) -> bool:
    """Selective recompute is worth offering only when the attention core stores its scores."""
    return stores_scores(attention_kernel(model, train, device_kind))
