"""Pipeline parallelism: DeepSpeed's PipelineModule cut at the plan's explicit stage boundaries.

The model is a flat layer list (planner/model/glm.py):

    WordEmbedding, [PositionEmbedding], Block x L, FinalNorm, OutputLayer | tied WordEmbedding

The first stage holds the embedding layers and its blocks, the last stage its blocks and the
head. Tied embeddings (GLM-10B): the word embedding is a TiedLayerSpec on the first and last
stage; DeepSpeed all-reduces its gradient between the two copies (one group per (dp, tp)
pair, so each TP rank ties its own vocabulary shard) and counts it once in the gradient norm
(`ds_pipe_replicated`). Only the word embedding is tied: learned positions live in their own
layer on the first stage, so the last stage holds no unused copy.
"""
from __future__ import annotations

from planner.model.block import Block
from planner.model.embedding import PositionEmbedding, WordEmbedding
from planner.model.head import FinalNorm, LMLoss, OutputLayer, tied_logits
from planner.model.attention import StageCache
from planner.model.parallel.groups import Groups
from planner.specs.model import ModelSpec

TIE = {"tied_weight_attr": ["word_embeddings.weight"]}


def _pipeline_class():
    from deepspeed.pipe import PipelineModule

    class PlannedPipeline(PipelineModule):
        """PipelineModule cut at the plan's explicit stage boundaries (DeepSpeed has no such
        partition method; overriding _partition_layers is the measured way, see the CPU notes)."""

        def __init__(self, *args, parts: list[int], **kw) -> None:
            object.__setattr__(self, "_planned_parts", list(parts))
            super().__init__(*args, **kw)

        def _partition_layers(self, method: str = "uniform") -> None:
            self.parts = list(self._planned_parts)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    return PlannedPipeline


def stage_parts(spec: ModelSpec, stage_layers: tuple[int, ...]) -> list[int]:
    """Stage boundaries in the flat layer list: embedding layers on the first stage, head on the last."""
    embed = 2 if spec.position == "learned" else 1
    parts, at = [0], embed
    for n in stage_layers:
        at += n
        parts.append(at)
    parts[-1] = at + 2  # FinalNorm and the output layer
    return parts


def build_pipeline(spec: ModelSpec, groups: Groups, stage_layers: tuple[int, ...], checkpoint_flags: list[bool],
                   selective: bool, attention: str, seed: int):
    from deepspeed.pipe import LayerSpec, TiedLayerSpec
    tp = groups.tp
    cache = StageCache(spec, tp)  # built in this process: shared by this stage's blocks
    if spec.tied_embeddings:
        embed = [TiedLayerSpec("embed", WordEmbedding, spec, tp, seed, **TIE)]
        out = TiedLayerSpec("embed", WordEmbedding, spec, tp, seed, forward_fn=tied_logits, **TIE)
    else:
        embed = [LayerSpec(WordEmbedding, spec, tp, seed)]
        out = LayerSpec(OutputLayer, spec, tp, seed)
    if spec.position == "learned":
        embed.append(LayerSpec(PositionEmbedding, spec, tp, seed))
    blocks = [LayerSpec(Block, spec, i, c, selective, tp=tp, attention=attention, cache=cache, seed=seed)
              for i, c in enumerate(checkpoint_flags)]
    layers = embed + blocks + [LayerSpec(FinalNorm, spec, tp), out]
    parts = stage_parts(spec, stage_layers)
    assert parts[-1] == len(layers), (parts, len(layers))
    # seed_layers=False: every parameter is initialised from its own seed (parallel/tensor.py)
    return _pipeline_class()(layers=layers, topology=groups.topology, loss_fn=LMLoss(spec.vocab, tp), parts=parts,
                             seed_layers=False, activation_checkpoint_interval=0, partition_method="uniform")
