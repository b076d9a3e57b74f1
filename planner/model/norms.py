"""Norms of the GLM family that save only their input and per-row statistics for backward:
RMSNorm (Zhang & Sennrich 2019; ChatGLM2/3, GLM-4) and LayerNorm (Ba et al. 2016; GLM-10B,
GLM-130B). Their weights are replicated over the tensor-parallel ranks (parallel/tensor.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from planner.model.parallel.groups import TPGroup
from planner.model.parallel.tensor import copy_to_tp, mark_replicated, replicated
from planner.specs.model import ModelSpec


class _RMSNormFn(torch.autograd.Function):
    """y = x * rsqrt(mean(x^2) + eps) * w, statistics in fp32; saves x and the fp32 rstd (b x s x 1).
    (On CPU, torch's F.rms_norm is a composite that keeps several fp32 copies of x.)"""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.to(rstd.dtype) * rstd
        g = grad.to(rstd.dtype)
        grad_w = (g * xhat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        gx = g * weight.to(rstd.dtype)
        grad_x = rstd * (gx - xhat * (gx * xhat).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_w, None


class RMSNorm(nn.Module):
    """Zhang & Sennrich 2019; ChatGLM2/3 and GLM-4."""

    def __init__(self, hidden: int, tp: TPGroup, name: str, eps: float = 1e-5) -> None:
        super().__init__()
        self.tp, self.eps = tp, eps
        self.weight = nn.Parameter(torch.ones(hidden))
        mark_replicated(self.weight, f"{name}.weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFn.apply(x, replicated(self.weight, self.tp), self.eps)


class HeadRMSNorm(RMSNorm):
    """QK-norm (GLM-4.5's use_qk_norm; transformers' Glm4MoeAttention q_norm / k_norm): an RMSNorm
    over each head's head_dim values, one weight shared by the heads. A TP rank normalises its
    own heads only, so the weight's gradient is partial on each TP rank and is all-reduced over
    TP in backward (copy_to_tp), sequence parallelism or not."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFn.apply(x, copy_to_tp(self.weight, self.tp), self.eps)


class LayerNorm(nn.Module):
    """Ba et al. 2016 (GLM-10B, GLM-130B); torch's kernel saves x, mean and rstd."""

    def __init__(self, hidden: int, tp: TPGroup, name: str, eps: float = 1e-5) -> None:
        super().__init__()
        self.tp, self.eps = tp, eps
        self.weight = nn.Parameter(torch.ones(hidden))
        self.bias = nn.Parameter(torch.zeros(hidden))
        mark_replicated(self.weight, f"{name}.weight")
        mark_replicated(self.bias, f"{name}.bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), replicated(self.weight, self.tp), replicated(self.bias, self.tp),
                            self.eps)


def make_norm(spec: ModelSpec, tp: TPGroup, name: str) -> nn.Module:
    norm = RMSNorm if spec.norm == "rmsnorm" else LayerNorm
    return norm(spec.hidden, tp, name, eps=spec.norm_eps)
