"""The KV cache of generation, and one cached step through the training blocks.

The model's own forward (GLMModel in glm.py, Block / SelfAttention in block.py) takes an optional `kv`
(a KVStep): with it, each block's attention projects q, k, v and rotates them exactly as in
training, then appends k and v to the cache and attends over every cached token of its
sequence instead of over the micro-batch. Everything else (norms, residuals, DeepNorm, MLP, the
vocab-parallel embedding and output, the TP collectives) is the training code itself.

- KVCache: per layer, K and V of shape [slots, max_len, kv_groups/TP, head_dim] (a padded
  cache, one slot per running sequence, with per-slot lengths); GQA caches only this rank's
  KV groups. No paged blocks here (vLLM's PagedAttention, Kwon et al. 2023): on CPU with a few
  slots the padded cache is simpler and the cost model counts blocks itself. A linear-attention
  model keeps a fixed-size state per slot instead.
- KVStep: b sequences' next s tokens at their absolute positions (rotary at the absolute
  position, learned positions, ALiBi), causal over the cache, masked beyond each slot's length.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from planner.errors import ExecutionError
from planner.model.attention import additive_mask, linear_attention, rotary_angles
from planner.model.parallel.groups import TPGroup
from planner.specs.model import ModelSpec


class KVCache:
    """Per layer K and V: [slots, max_len, kv_groups/TP, head_dim]; `lengths` per slot.

    A linear-attention model (ModelSpec.linear_attention, docs/variants.md) keeps no K and V:
    per layer and slot a fixed-size state instead, `state` [slots, kv_groups/TP, d, d] (the sum
    of phi(k) v^T) and `norm` [slots, kv_groups/TP, d] (the sum of phi(k)), in fp32 as the
    training kernel (planner.model.attention.linear_attention) keeps them: what
    planner/serve/memory.py state_bytes_per_sequence counts, whatever the context length."""

    def __init__(self, spec: ModelSpec, tp: TPGroup, slots: int, max_len: int, dtype: torch.dtype) -> None:
        if max_len > spec.max_seq:
            raise ExecutionError("prompt + output", f"{max_len} tokens exceed the model's context {spec.max_seq}",
                                 "shorten the prompt or the output")
        g, d = spec.kv_heads // tp.size, spec.dim_per_head
        self.spec, self.tp = spec, tp
        self.linear = spec.linear_attention
        if self.linear:
            self.k, self.v = [], []
            self.state = [torch.zeros(slots, g, d, d) for _ in range(spec.layers)]
            self.norm = [torch.zeros(slots, g, d) for _ in range(spec.layers)]
        else:
            shape = (slots, max_len, g, d)
            self.k = [torch.zeros(shape, dtype=dtype) for _ in range(spec.layers)]
            self.v = [torch.zeros(shape, dtype=dtype) for _ in range(spec.layers)]
        self.lengths = [0] * slots
        self.max_len = max_len

    @property
    def slots(self) -> int:
        return len(self.lengths)

    def step(self, slots: list[int], s: int) -> "KVStep":
        """The next s tokens of the sequences in `slots`, appended at each slot's length."""
        return KVStep(self, slots, s)


class KVStep:
    """One cached forward: positions, the mask and rotary angles every block shares, and the
    cache writes and reads of each block's attention (`attend`). `done()` advances the slots."""

    def __init__(self, cache: KVCache, slots: list[int], s: int) -> None:
        starts = torch.tensor([cache.lengths[i] for i in slots])
        if int(starts.max()) + s > cache.max_len:
            raise ExecutionError("KV cache", f"a sequence would grow past {cache.max_len} cached tokens",
                                 "size the cache for prompt + output")
        self.cache, self.slots, self.s = cache, slots, s
        self.pos = starts[:, None] + torch.arange(s)[None, :]  # b s, absolute positions
        self.index = torch.tensor(slots)
        self.keys = int(starts.max()) + s
        self._mask: torch.Tensor | None = None
        self.angles = rotary_angles(cache.spec, self.pos)

    def mask(self, dtype: torch.dtype) -> torch.Tensor:
        """b heads/TP|1 s keys, in the activations' dtype: causal over the cache (and ALiBi's bias);
        built once per step, shared by every block."""
        if self._mask is None or self._mask.dtype != dtype:
            keys = torch.arange(self.keys)
            allowed = keys[None, None, :] <= self.pos[:, :, None]  # b s L: causal over the cache
            self._mask = additive_mask(self.cache.spec, self.cache.tp, self.pos, keys[None], allowed, dtype)
        return self._mask

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of the new tokens (q: b s n d, k and v: b s g d, rotated) over the cache of
        `layer`, after appending k and v to it; b s n d."""
        cache = self.cache
        if cache.linear:
            return self._linear(layer, q, k, v)
        cache.k[layer][self.index[:, None], self.pos] = k
        cache.v[layer][self.index[:, None], self.pos] = v
        mask = self.mask(q.dtype)
        kk, vv = cache.k[layer][self.index, :self.keys], cache.v[layer][self.index, :self.keys]  # b L kv d
        q, kk, vv = q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2)
        out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, enable_gqa=kk.shape[1] != q.shape[1])
        return out.transpose(1, 2)

    def _linear(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Linear attention over the new tokens with each slot's state; b s n d in q's dtype. A
        prompt (s > 1, an empty state) runs the training kernel (linear_attention, chunked) and
        leaves its sums in the state; a decode token adds phi(k) v^T and phi(k) to the state and
        reads out phi(q) S / phi(q) z (Katharopoulos et al. 2020, eq. 6, the recurrent form):
        O(1) per token, no context read."""
        cache, index, pos = self.cache, self.index, self.pos
        b, s, n, d = q.shape
        g = k.shape[2]
        if s > 1 and int(pos[:, 0].max()) > 0:
            raise ExecutionError("prefill", "a linear-attention prompt continues a sequence",
                                 "prefill whole prompts (the engine does)")
        kf, vf = F.elu(k.float()) + 1.0, v.float()                 # b s g d
        keep = (pos[:, 0] > 0).float()                             # a slot starting at 0 is a new sequence
        state = cache.state[layer][index] * keep[:, None, None, None] + torch.einsum("bsgd,bsge->bgde", kf, vf)
        norm = cache.norm[layer][index] * keep[:, None, None] + kf.sum(1)
        cache.state[layer][index], cache.norm[layer][index] = state, norm
        if s > 1:
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            return linear_attention(qt, kt, vt, torch.zeros(b, s, dtype=torch.long)).transpose(1, 2)
        qf = (F.elu(q.float()) + 1.0).reshape(b, g, n // g, d)         # s = 1: the query heads of each group
        out = torch.einsum("bgmd,bgde->bgme", qf, state) / torch.einsum("bgmd,bgd->bgm", qf, norm)[..., None]
        return out.reshape(b, 1, n, d).to(q.dtype)

    def done(self) -> None:
        """The step's tokens are in the cache: advance each slot's length."""
        for i in self.slots:
            self.cache.lengths[i] += self.s


__all__ = ["KVCache", "KVStep"]
