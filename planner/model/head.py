"""The last layers of the executor's model (planner/model/glm.py): the final norm, the
vocab-parallel output layer (or the tied word embedding's), and the language-model loss in
fp32 over real tokens, under tensor and context parallelism."""
from __future__ import annotations

import torch
from torch import nn

from planner.data.batching import IGNORE
from planner.model.embedding import WordEmbedding
from planner.model.norms import make_norm
from planner.model.parallel.groups import SINGLE, TPGroup
from planner.model.parallel.tensor import (INIT_STD, mark_split, parallel_input_linear, reduce_from_tp, seeded_normal,
                                           seq_shard, vocab_parallel_cross_entropy)
from planner.specs.model import ModelSpec


class FinalNorm(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.final_layernorm = make_norm(spec, tp, "head.final_layernorm")

    def forward(self, inputs):
        return (self.final_layernorm(inputs[0]),) + tuple(inputs[1:])


class OutputLayer(nn.Module):
    """Vocab-parallel output layer (V_pad/T columns per rank); returns this rank's logits."""

    def __init__(self, spec: ModelSpec, tp: TPGroup = SINGLE, seed: int = 0) -> None:
        super().__init__()
        self.tp = tp
        padded, name = spec.padded_vocab(tp.size), "head.output_layer.weight"
        n = padded // tp.size
        self.weight = nn.Parameter(seeded_normal(name, (padded, spec.hidden), INIT_STD, seed,
                                                 [range(tp.rank * n, (tp.rank + 1) * n)], real_rows=spec.vocab))
        mark_split(self.weight, 0, (padded,), name)

    def forward(self, inputs) -> torch.Tensor:
        return parallel_input_linear(inputs[0], self.weight, None, self.tp)


def tied_logits(embedding: WordEmbedding, inputs) -> torch.Tensor:
    """forward_fn of the tied embedding on the last pipeline stage (DeepSpeed TiedLayerSpec)."""
    return embedding.logits(inputs[0])


class LMLoss:
    """Mean next-token cross-entropy over real tokens (labels already shifted; IGNORE elsewhere),
    vocab-parallel and in fp32 (parallel/tensor.py).

    Context parallelism (`cp`): the logits are this rank's s/cp tokens and `labels` the whole
    sequence's; the sum over the rank's real tokens is summed over the cp group (all-reduce
    forward, identity backward) and divided by the whole sequence's real tokens, so every cp
    rank holds the micro-batch's loss and its gradient is this rank's share of it: DeepSpeed sums
    the gradients over dp x cp ranks and divides by dp (engine._reduce_non_expert_gradients,
    zero/stage_1_and_2.py average_tensor: world / sequence_parallel_size)."""

    def __init__(self, vocab: int, tp: TPGroup = SINGLE, cp: TPGroup = SINGLE) -> None:
        self.vocab, self.tp, self.cp = vocab, tp, cp

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.cp.size == 1:
            per_token = vocab_parallel_cross_entropy(logits, labels, self.vocab, self.tp)
            real = (labels != IGNORE).float()
            return (per_token * real).sum() / real.sum().clamp(min=1.0)
        total = (labels != IGNORE).float().sum()
        labels = seq_shard(labels, self.cp)
        per_token = vocab_parallel_cross_entropy(logits, labels, self.vocab, self.tp)
        real = (labels != IGNORE).float()
        return reduce_from_tp((per_token * real).sum(), self.cp) / total.clamp(min=1.0)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """LMLoss without tensor parallelism (logits over the whole vocabulary)."""
    return LMLoss(logits.shape[-1])(logits, labels)
