"""The GLM block the profiler times: the executor's model when it is installed, else a
minimal stand-in with the same GEMM shapes (one TP rank's share of the block).

The stand-in follows the GLM family as ModelSpec describes it: LayerNorm or RMSNorm, pre-LN
or post-LN/DeepNorm (Wang et al. 2022, arXiv 2203.00555: x = LN(alpha x + f(x)),
alpha = (2N)^(1/2)), rotary positions (Su et al. 2021, arXiv 2104.09864), grouped-query
attention, GELU or SwiGLU/GeGLU FFN (Shazeer 2020, arXiv 2002.05202). A TP rank holds
heads/t query heads, kv/t KV heads and ffn/t FFN columns (Megatron-LM column/row split).
"""
from __future__ import annotations

import math
from typing import Any

from planner.specs.model import ModelSpec


def executor_block(model: ModelSpec, tp: int, group: Any = None, rank: int = 0) -> tuple[Any, str] | None:
    """One TP rank's share of planner.model.block.Block, taking and returning [b, s, h].

    The block is built with a TP group of `tp` ranks and no process group: its parallel layers
    hold one rank's slices (heads/t, KV groups/t, ffn/t) and skip the collectives, so it times
    exactly one rank's compute. None when the executor's model is not installed.
    """
    try:
        from planner.model.block import Block
        from planner.model.parallel.groups import TPGroup
    except Exception:
        return None
    import torch
    from torch import nn

    block = Block(model, 0, tp=TPGroup(rank=rank, size=tp, group=group))  # group: the in-step probe's (comm.py)

    class OneSequencePerRow(nn.Module):
        """Feeds the block positions 0..s-1 and one document per row (causal mask)."""

        def __init__(self) -> None:
            super().__init__()
            self.block = block

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s = x.shape[:2]
            pos = torch.arange(s, device=x.device).expand(b, s)
            seg = torch.ones(b, s, dtype=torch.long, device=x.device)
            return self.block((x, pos, seg))[0]

    return OneSequencePerRow(), "planner.model.block.Block" + (f" (one rank of TP {tp})" if tp > 1 else "")


def make_block(model: ModelSpec, tp: int = 1, prefer_executor: bool = True) -> tuple[Any, str]:
    """(torch module mapping [b, s, h] -> [b, s, h], where it came from)."""
    if prefer_executor:
        found = executor_block(model, tp)
        if found is not None:
            return found
    return _stand_in(model, tp), "planner.profiler.block stand-in (same GEMM shapes as the executor block)"


def _stand_in(model: ModelSpec, tp: int) -> Any:
    import torch
    from torch import nn
    from torch.nn import functional as F

    h, d = model.hidden, model.dim_per_head
    heads, kv_heads, ffn = model.heads // tp, model.kv_heads // tp, model.ffn_hidden // tp

    def norm() -> nn.Module:
        return nn.LayerNorm(h) if model.norm == "layernorm" else nn.RMSNorm(h)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = norm(), norm()
            self.qkv = nn.Linear(h, (heads + 2 * kv_heads) * d, bias=model.qkv_bias)
            self.dense = nn.Linear(heads * d, h, bias=model.linear_bias)
            self.up = nn.Linear(h, ffn * model.ffn_in_matrices, bias=model.linear_bias)
            self.down = nn.Linear(ffn, h, bias=model.linear_bias)
            self.alpha = math.sqrt(2 * model.layers) if model.norm_position == "deepnorm" else 1.0

        def rotary(self, x: torch.Tensor) -> torch.Tensor:  # x: [b, heads, s, d]
            s, half = x.shape[-2], x.shape[-1] // 2
            inv = 1.0 / (10000 ** (torch.arange(0, half, device=x.device, dtype=torch.float32) / half))
            ang = torch.outer(torch.arange(s, device=x.device, dtype=torch.float32), inv)
            cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
            x1, x2 = x[..., :half], x[..., half:2 * half]
            return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, x[..., 2 * half:]], dim=-1)

        def attention(self, x: torch.Tensor) -> torch.Tensor:
            b, s, _ = x.shape
            q, k, v = self.qkv(x).split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
            q = q.view(b, s, heads, d).transpose(1, 2)
            k = k.view(b, s, kv_heads, d).transpose(1, 2)
            v = v.view(b, s, kv_heads, d).transpose(1, 2)
            if model.position == "rotary":
                q, k = self.rotary(q), self.rotary(k)
            if kv_heads != heads:
                k = k.repeat_interleave(heads // kv_heads, dim=1)
                v = v.repeat_interleave(heads // kv_heads, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.dense(o.transpose(1, 2).reshape(b, s, heads * d))

        def mlp(self, x: torch.Tensor) -> torch.Tensor:
            y = self.up(x)
            if model.activation == "swiglu":
                g, u = y.chunk(2, dim=-1)
                y = F.silu(g) * u
            elif model.activation == "geglu":
                g, u = y.chunk(2, dim=-1)
                y = F.gelu(g) * u
            else:
                y = F.gelu(y)
            return self.down(y)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if model.norm_position == "pre":
                x = x + self.attention(self.norm1(x))
                return x + self.mlp(self.norm2(x))
            x = self.norm1(self.alpha * x + self.attention(x))
            return self.norm2(self.alpha * x + self.mlp(x))

    return Block()
