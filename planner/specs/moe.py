"""MoESpec: the mixture-of-experts part of a model (routed experts replacing the dense FFN).

One MoE layer (GShard, Lepikhin et al. 2020, arXiv 2006.16668; DeepSeekMoE, Dai et al. 2024,
arXiv 2401.06066, with shared experts; GLM-4.5, arXiv 2508.06471, sec. 2.1): a router (an
h x E linear) scores every token, the top-k routed experts each run a small FFN of
`expert_ffn` columns on it, `shared_experts` FFNs run on every token, and the outputs are
summed with the router's weights. The first `first_dense` blocks keep the dense FFN
(Hugging Face `first_k_dense_replace`). The expert FFN has the model's activation (SwiGLU
for every MoE family loaded here: three matrices).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from planner.errors import SpecError
from planner.specs.strict import check_fields

ROUTERS = ("softmax", "sigmoid")
IMBALANCE = 1.0
"""Default MoESpec.imbalance: the busiest expert-parallel rank's share of routed tokens over
the mean (1.0 = perfectly balanced). A stated input, never fitted: with an auxiliary-loss or
bias-balanced router (DeepSeek-V3 sec. 2.1.2, GLM-4.5) training runs close to balance;
pass e.g. imbalance=1.2 to plan for a busiest rank 20% over the mean."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MoESpec:
    """Routed experts of a mixture-of-experts model."""

    experts: int
    """Routed experts E per MoE layer (HF n_routed_experts / num_local_experts / num_experts)."""
    top_k: int
    """Routed experts per token k (num_experts_per_tok)."""
    expert_ffn: int
    """FFN inner size of one routed expert (moe_intermediate_size)."""
    shared_experts: int = 0
    """Experts every token runs (n_shared_experts)."""
    shared_ffn: int = 0
    """Inner size of one shared expert; 0 = expert_ffn (GLM-4.5, DeepSeek-V3)."""
    first_dense: int = 0
    """The first blocks that keep the dense FFN (first_k_dense_replace)."""
    router: str = "softmax"
    """softmax (Mixtral, Qwen3-MoE) or sigmoid with a per-expert bias for balancing
    (DeepSeek-V3, GLM-4.5: scoring_func sigmoid, e_score_correction_bias)."""
    routed_scale: float = 1.0
    """Factor on the routed experts' normalised top-k weights (GLM-4.5 and DeepSeek-V3:
    routed_scaling_factor 2.5; transformers' Glm4MoeTopkRouter). Scales the routed output, not
    its cost."""
    capacity_factor: float = 0.0
    """Tokens an expert takes, over the mean k T / E (GShard's capacity; the rest are dropped,
    shortfalls padded); 0 = dropless (every routed token runs: Megatron-Core's default)."""
    imbalance: float = IMBALANCE
    """Dropless only: the busiest rank's routed tokens over the mean (IMBALANCE)."""

    def __post_init__(self) -> None:
        for f in ("experts", "top_k", "expert_ffn"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise SpecError(f"model.moe.{f}", f"must be a positive integer, got {v!r}",
                                f"give the MoE config's {f}")
        for f in ("shared_experts", "shared_ffn", "first_dense"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise SpecError(f"model.moe.{f}", f"must be an integer >= 0, got {v!r}", f"set {f} to 0 or more")
        if self.top_k > self.experts:
            raise SpecError("model.moe.top_k", f"{self.top_k} is larger than the {self.experts} experts",
                            f"use a top-k of at most {self.experts}")
        if self.router not in ROUTERS:
            raise SpecError("model.moe.router", f"unknown value {self.router!r}", f"use one of {', '.join(ROUTERS)}")
        rs = self.routed_scale
        if isinstance(rs, bool) or not isinstance(rs, (int, float)) or not rs > 0:
            raise SpecError("model.moe.routed_scale", f"must be a positive number, got {rs!r}",
                            "use the config's routed_scaling_factor (1 for GLM-4.5-Air, 2.5 for GLM-4.5)")
        cf, imb = self.capacity_factor, self.imbalance
        if isinstance(cf, bool) or not isinstance(cf, (int, float)) or cf < 0:
            raise SpecError("model.moe.capacity_factor", f"must be >= 0, got {cf!r}", "use 0 (dropless) or e.g. 1.25")
        if 0 < cf < 1.0 / self.experts:
            raise SpecError("model.moe.capacity_factor", f"{cf} leaves every expert less than one token slot",
                            "use 0 (dropless) or a factor of at least 1")
        if isinstance(imb, bool) or not isinstance(imb, (int, float)) or imb < 1.0:
            raise SpecError("model.moe.imbalance", f"must be >= 1 (busiest rank over the mean), got {imb!r}",
                            "use 1 for balanced routing or e.g. 1.2")

    @property
    def shared_size(self) -> int:
        return self.shared_ffn or self.expert_ffn

    @property
    def load_factor(self) -> float:
        """Routed tokens the busiest rank computes, over the mean k T / E per expert: the
        capacity factor (GShard: every expert's buffer is filled or padded to capacity) or,
        dropless, the stated imbalance."""
        return float(self.capacity_factor) if self.capacity_factor else float(self.imbalance)

    @property
    def dropped_fraction(self) -> float:
        """Share of routed tokens a capacity below the busiest expert's load drops: with the
        stated imbalance, 1 - capacity / imbalance when positive (0 dropless)."""
        if not self.capacity_factor:
            return 0.0
        return max(0.0, 1.0 - self.capacity_factor / self.imbalance)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> "MoESpec":
        check_fields(cls, data, "model.moe", "give experts, top_k and expert_ffn")
        missing = [f for f in ("experts", "top_k", "expert_ffn") if f not in data]
        if missing:
            raise SpecError(f"model.moe.{missing[0]}", "missing", "a MoE model needs experts, top_k and expert_ffn")
        return cls(**dict(data))
