"""A GLM-family transformer in torch, built from a ModelSpec, tensor-parallel by construction.

Faithful to the variants the presets name (ChatGLM/GLM-130B code, THUDM):
- LayerNorm or RMSNorm; pre-LN, post-LN, or DeepNorm (post-LN with residual scaled by
  alpha = (2N)^(1/2), Wang et al. 2022 "DeepNet", as in GLM-130B);
- rotary positions (Su et al. 2021; ChatGLM and GLM rotate half of each head in interleaved
  pairs, llama the whole head with rotate_half: ModelSpec.rotary_fraction, rope_interleaved), learned
  absolute positions, or ALiBi biases (Press et al. 2022);
- GELU MLP or GeGLU/SwiGLU (Shazeer 2020), fused [gate | up] as ChatGLM2's dense_h_to_4h;
- multi-head or grouped/multi-query attention (kv_groups), fused [q | k | v] projection;
- hidden dropout after the attention output and after the FFN output, attention dropout on
  the probabilities (ModelSpec.hidden_dropout / attention_dropout), only while training;
- the what-if variants (docs/variants.md): causal linear attention (attention_kind "linear",
  Katharopoulos et al. 2020; no attention dropout: there are no probabilities), a pruned FFN
  (ffn_size columns) and K consecutive blocks sharing parameters (share_layers).

Every linear is a Megatron-style tensor-parallel layer (planner/model/parallel/tensor.py);
TP = 1 runs the same code with groups of size 1. Attention is TrainSpec.attention: "flash"
(torch scaled_dot_product_attention; no s x s tensor kept) or "eager" (softmax(QK^T/sqrt(d) +
mask) -> dropout -> @V in plain ops, storing the softmax). docs/runtime.md lists, measured,
what each layer saves for backward.

The model is a flat list of layers: WordEmbedding, [PositionEmbedding], Block x L, FinalNorm,
OutputLayer (or, tied, the word embedding again). PipelineModule splits that list at the
plan's boundaries (parallel/pipeline.py); GLMModel runs it whole. Layers pass a tuple
(hidden, position_ids, segment_ids) so pipeline stages can send it. Parameter names are
ChatGLM's; `p.canonical` is each parameter's layout-independent name (its init seed).

Where each part lives: planner/model/block.py (SelfAttention, MLP, Block), embedding.py
(WordEmbedding, PositionEmbedding), head.py (FinalNorm, OutputLayer, LMLoss), recompute.py
(activation checkpointing and what a layer keeps for backward), attention.py, norms.py,
moe.py, kvcache.py and parallel/.
"""
from __future__ import annotations

import torch
from torch import nn

from planner.model.attention import StageCache
from planner.model.block import Block, head_group, share_blocks
from planner.model.embedding import PositionEmbedding, WordEmbedding
from planner.model.head import FinalNorm, LMLoss, OutputLayer, tied_logits
from planner.model.kvcache import KVStep
from planner.model.parallel.groups import SINGLE, TPGroup
from planner.model.parallel.tensor import seq_shard
from planner.specs.model import ModelSpec


class GLMModel(nn.Module):
    """The whole layer list in one process (pp == 1): embedding -> blocks -> norm -> output.
    Context parallelism (`cp`): every cp rank gets the whole micro-batch, embeds its s/cp tokens
    and keeps the whole positions and document ids for the attention core (planner/model/
    attention.py StageCache builds the whole mask); the loss takes the whole labels."""

    def __init__(self, spec: ModelSpec, checkpoint_flags: list[bool], selective: bool, *, tp: TPGroup = SINGLE,
                 attention: str = "flash", seed: int = 0, cp: TPGroup = SINGLE, ep: TPGroup = SINGLE) -> None:
        super().__init__()
        self.cp = cp
        cache = StageCache(spec, head_group(tp, cp))
        self.embedding = WordEmbedding(spec, tp, seed)
        self.position = PositionEmbedding(spec, tp, seed, cp) if spec.position == "learned" else None
        self.layers = nn.ModuleList(Block(spec, i, c, selective, tp=tp, attention=attention, cache=cache, seed=seed,
                                          cp=cp, ep=ep)
                                    for i, c in enumerate(checkpoint_flags))
        share_blocks(list(self.layers), spec.share_layers)
        self.final = FinalNorm(spec, tp)
        self.output = None if spec.tied_embeddings else OutputLayer(spec, tp, seed)
        self.loss_fn = LMLoss(spec.vocab, tp, cp)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, segments: torch.Tensor,
                kv: KVStep | None = None) -> torch.Tensor:
        """This rank's vocab-parallel logits [b, s, V_pad/T]. With `kv` (generation: ids are the
        next tokens of kv's slots at positions kv.pos) only the last new token's, [b, 1, V_pad/T]."""
        if self.cp.size > 1 and kv is None:
            x = self.embedding((seq_shard(ids, self.cp), pos, segments))
        else:
            x = self.embedding((ids, pos, segments))
        if self.position is not None:
            x = self.position(x)
        for layer in self.layers:
            x = layer(x, kv)
        if kv is not None:
            x = (x[0][:, -1:],) + tuple(x[1:])
        x = self.final(x)
        return self.output(x) if self.output is not None else tied_logits(self.embedding, x)
