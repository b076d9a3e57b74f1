"""The first layers of the executor's model (planner/model/glm.py): the vocab-parallel word
embedding (which a tied model's output also uses) and learned absolute positions."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from planner.model.parallel.groups import SINGLE, TPGroup
from planner.model.parallel.tensor import (INIT_STD, VocabParallelEmbedding, mark_replicated, parallel_input_linear,
                                           scatter_seq, seeded_normal, seq_shard)
from planner.specs.model import ModelSpec


class WordEmbedding(nn.Module):
    """Vocab-parallel word embedding (first layer). Tied models (GLM-10B) also project the
    output with it: `logits` (the pipeline's last stage holds a copy, DeepSpeed TiedLayerSpec)."""

    def __init__(self, spec: ModelSpec, tp: TPGroup = SINGLE, seed: int = 0) -> None:
        super().__init__()
        self.tp = tp
        self.word_embeddings = VocabParallelEmbedding(spec.vocab, spec.padded_vocab(tp.size), spec.hidden, tp,
                                                      "embedding.word_embeddings", seed,
                                                      scatter=spec.position != "learned")
        self.poison = False
        """Set by the stability test (--inject-nan): makes this micro-batch's activations NaN."""

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]):
        ids, pos, segments = inputs
        h = self.word_embeddings(ids)
        if self.poison:
            h = h * float("nan")
        return h, pos, segments

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return parallel_input_linear(h, self.word_embeddings.weight, None, self.tp)


class PositionEmbedding(nn.Module):
    """Learned absolute positions (GLM-10B), replicated on every TP rank, added on the whole
    sequence; under SP the sum is then split into sequence shards (Megatron-LM's order), so the
    position table's gradient is whole on every TP rank and needs no TP all-reduce. Under
    context parallelism the hidden states are this cp rank's s/cp tokens: their positions."""

    def __init__(self, spec: ModelSpec, tp: TPGroup = SINGLE, seed: int = 0, cp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.tp, self.cp = tp, cp
        name = "embedding.position_embeddings.weight"
        self.weight = nn.Parameter(seeded_normal(name, (spec.max_seq, spec.hidden), INIT_STD, seed,
                                                 [range(spec.max_seq)]))
        mark_replicated(self.weight, name)

    def forward(self, inputs):
        h, pos, segments = inputs
        h = h + F.embedding(seq_shard(pos, self.cp) if self.cp.size > 1 else pos, self.weight)
        return (scatter_seq(h, self.tp) if self.tp.sequence_parallel else h), pos, segments
