"""Plan: the decisions the planner makes. Nothing here is derived from hardware.

Rank layout (one vocabulary, said once in planner/specs/mesh.py; Plan.rank/coords/groups): global
rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index, i.e. torch.arange(world).view(pp,
dp, cp, tp) -- tensor parallel fastest, pipeline slowest, the order of DeepSpeed's
PipeModelDataParallelTopology (axes pipe, data, model) with the context-parallel axis between data
and model (Megatron-Core's order tp-cp-dp-pp; DeepSpeed-Ulysses carves its sequence groups from
consecutive data-parallel ranks). Expert parallelism (ep) groups ep consecutive data-parallel
indices: it adds no processes.
Checkpointed layers: in each stage the first `recompute_layers[i]` blocks are checkpointed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from planner.errors import SpecError
from planner.specs.mesh import Coords, Mesh
from planner.specs.strict import check_fields
from planner.specs.hardware import TRAIN_PRECISIONS

RECOMPUTE = ("none", "selective", "full")
OFFLOAD = ("none", "cpu", "nvme")
DEFAULT_BUCKET = 50_000_000
"""reduce_bucket_size of the Megatron-DeepSpeed recipes (elements)."""
SCHEDULES = ("1f1b", "interleaved")
CP_KINDS = ("ulysses", "ring")
RUNTIMES = ("deepspeed", "megatron-core", "fsdp")
"""The runtimes a plan may run on (profiles/runtimes/<name>.json; planner.cost.runtime); the
first is the default and the only one `planner run` executes."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    dp: int = 1
    """Data-parallel degree."""
    tp: int = 1
    """Tensor-parallel degree (inside a node). 1 means disabled."""
    pp: int = 1
    """Pipeline-parallel degree (stages). 1 means disabled."""
    zero: int = 0
    """ZeRO stage 0-3 (0-1 only with pp > 1: DeepSpeed's PipelineEngine rule)."""
    micro_batch: int = 1
    """Sequences per micro-batch per data-parallel rank."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (the pipeline's m)."""
    stage_layers: tuple[int, ...] = ()
    """Transformer blocks per pipeline stage; sums to the model's layers; () = uniform."""
    recompute: str = "none"
    """none, selective (attention core only, Korthikanti et al.) or full (whole block)."""
    recompute_layers: tuple[int, ...] = ()
    """Full recompute: checkpointed blocks per stage (the first k of each stage)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism in the TP group (norms/dropout sharded by sequence)."""
    ep: int = 1
    """Expert-parallel size: the routed experts of a MoE layer are split over ep data-parallel
    ranks (DeepSpeed-MoE ep_size, Megatron-Core expert_model_parallel_size); ep divides dp and
    the experts. 1 means every rank holds every expert."""
    cp: int = 1
    """Context-parallel degree: ranks that split each sequence (processes = dp x tp x pp x cp).
    1 means disabled."""
    cp_kind: str = "ulysses"
    """ulysses (DeepSpeed-Ulysses: all-to-all to heads / cp around attention; cp divides the
    heads and KV groups) or ring (Megatron-Core context parallelism: KV passed around the cp
    ranks; the sequence divisible by 2 cp)."""
    schedule: str = "1f1b"
    """1f1b or interleaved (virtual stages)."""
    interleave: int = 1
    """Virtual chunks per stage v for the interleaved schedule (1 otherwise)."""
    precision: str = "bf16"
    """bf16, fp16, fp32 or fp8 (planner.specs.hardware.TRAIN_PRECISIONS)."""
    overlap_comm: bool = True
    """Overlap the DP gradient reduction with the backward pass (DeepSpeed overlap_comm)."""
    bucket_elements: int = DEFAULT_BUCKET
    """reduce/allgather bucket size in elements (DeepSpeed reduce_bucket_size,
    allgather_bucket_size; ZeRO-3's sub_group_size)."""
    prefetch_elements: int = 0
    """ZeRO-3: parameters fetched ahead of use (stage3_prefetch_bucket_size); 0 = bucket_elements."""
    live_elements: int = 0
    """ZeRO-3: most gathered parameters alive at once (stage3_max_live_parameters, also
    stage3_max_reuse_distance); 0 = bucket_elements."""
    persistence_elements: int = 0
    """ZeRO-3: tensors up to this many elements stay gathered (stage3_param_persistence_threshold);
    0 = 10 x hidden (planner.cost.params.persistence_threshold)."""
    offload_optimizer: str = "none"
    """ZeRO-Offload / ZeRO-Infinity: fp32 master weights, Adam moments and the fp32 gradient
    partition live on the host (cpu) or on NVMe (nvme, ZeRO-3 only); Adam runs on the CPU."""
    offload_params: str = "none"
    """ZeRO-Infinity (ZeRO-3 only): the 16-bit weight partition lives on the host (cpu) or NVMe."""
    hpz: int = 1
    """ZeRO++ hpZ (ZeRO-3): secondary weight partition over this many ranks inside a node
    (zero_hpz_partition_size); 1 = off."""
    quantized_weights: bool = False
    """ZeRO++ qwZ (ZeRO-3): weights gathered in int8 (zero_quantized_weights)."""
    quantized_gradients: bool = False
    """ZeRO++ qgZ (ZeRO-3): gradients reduced hierarchically in int4 (zero_quantized_gradients)."""
    mics_shard: int = 0
    """MiCS (ZeRO-3): model states sharded over groups of this many ranks, replicated across
    groups (mics_shard_size); 0 = off (shard over the whole data-parallel group)."""
    runtime: str = "deepspeed"
    """The runtime the plan runs on: deepspeed (what `planner run` executes), megatron-core
    (Megatron-LM / NeMo) or fsdp (PyTorch FSDP); see docs/runtimes.md."""

    def __post_init__(self) -> None:
        for f in ("dp", "tp", "pp", "micro_batch", "grad_accum", "interleave", "bucket_elements", "hpz", "ep", "cp"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise SpecError(f"plan.{f}", f"must be a positive integer, got {v!r}", "give a positive integer")
        for f in ("prefetch_elements", "live_elements", "persistence_elements", "mics_shard"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise SpecError(f"plan.{f}", f"must be an integer >= 0, got {v!r}", "give 0 (the default) or more")
        for f in ("quantized_weights", "quantized_gradients", "overlap_comm", "sequence_parallel"):
            if not isinstance(getattr(self, f), bool):
                raise SpecError(f"plan.{f}", f"must be true or false, got {getattr(self, f)!r}", "give a boolean")
        for f in ("offload_optimizer", "offload_params"):
            if getattr(self, f) not in OFFLOAD:
                raise SpecError(f"plan.{f}", f"unknown value {getattr(self, f)!r}", f"use one of {', '.join(OFFLOAD)}")
        if self.zero < 3:
            for f, off in (("offload_params", self.offload_params != "none"), ("hpz", self.hpz > 1),
                           ("quantized_weights", self.quantized_weights),
                           ("quantized_gradients", self.quantized_gradients), ("mics_shard", self.mics_shard > 0)):
                if off:
                    raise SpecError(f"plan.{f}", f"needs ZeRO-3 (plan has ZeRO-{self.zero})",
                                    f"use ZeRO-3, or drop {f}")
            if self.offload_optimizer == "nvme":
                raise SpecError("plan.offload_optimizer", "NVMe offload needs ZeRO-3 (ZeRO-Infinity)",
                                "offload to cpu, or use ZeRO-3")
        if self.offload_optimizer != "none" and self.zero == 0:
            raise SpecError("plan.offload_optimizer", "optimizer offload needs ZeRO 1-3", "use ZeRO 1, 2 or 3")
        if self.mics_shard > 0 and self.hpz > 1:
            raise SpecError("plan.hpz", "ZeRO++ hpZ and MiCS are separate ZeRO-3 variants",
                            "use either hpz or mics_shard")
        if self.mics_shard > 0 and self.dp % self.mics_shard:
            raise SpecError("plan.mics_shard", f"{self.mics_shard} does not divide the data-parallel size {self.dp}",
                            f"use a divisor of {self.dp}")
        if self.hpz > 1 and self.dp % self.hpz:
            raise SpecError("plan.hpz", f"{self.hpz} does not divide the data-parallel size {self.dp}",
                            f"use a divisor of {self.dp}")
        if self.runtime not in RUNTIMES:
            raise SpecError("plan.runtime", f"unknown runtime {self.runtime!r}", f"use one of {', '.join(RUNTIMES)}")
        if self.zero not in (0, 1, 2, 3):
            raise SpecError("plan.zero", f"ZeRO stage must be 0-3, got {self.zero!r}", "use 0, 1, 2 or 3")
        if self.pp > 1 and self.zero > 1:
            raise SpecError("plan.zero", f"ZeRO-{self.zero} cannot run with pipeline parallelism (pp={self.pp})",
                            "use ZeRO 0 or 1 with pp > 1 (DeepSpeed PipelineEngine)")
        if self.recompute not in RECOMPUTE:
            raise SpecError("plan.recompute", f"unknown value {self.recompute!r}", f"use one of {', '.join(RECOMPUTE)}")
        if self.schedule not in SCHEDULES:
            raise SpecError("plan.schedule", f"unknown value {self.schedule!r}", f"use one of {', '.join(SCHEDULES)}")
        if self.schedule == "1f1b" and self.interleave != 1:
            raise SpecError("plan.interleave", "needs the interleaved schedule", "set schedule=interleaved or interleave=1")
        if self.schedule == "interleaved" and self.pp == 1:
            raise SpecError("plan.schedule", "interleaving needs pp > 1", "use 1f1b")
        if self.precision not in TRAIN_PRECISIONS:
            raise SpecError("plan.precision", f"unknown value {self.precision!r}", f"use one of {', '.join(TRAIN_PRECISIONS)}")
        if self.stage_layers and len(self.stage_layers) != self.pp:
            raise SpecError("plan.stage_layers", f"has {len(self.stage_layers)} stages, pp={self.pp}",
                            "give one layer count per pipeline stage")
        if any(n < 0 for n in self.stage_layers):
            raise SpecError("plan.stage_layers", "counts must be >= 0", "fix the stage boundaries")
        if self.recompute_layers and len(self.recompute_layers) != self.pp:
            raise SpecError("plan.recompute_layers", f"has {len(self.recompute_layers)} entries, pp={self.pp}",
                            "give one checkpointed-layer count per pipeline stage")
        if self.stage_layers and self.recompute_layers and any(
                r < 0 or r > n for r, n in zip(self.recompute_layers, self.stage_layers)):
            raise SpecError("plan.recompute_layers", "must be between 0 and the stage's layer count",
                            "checkpoint at most every layer of a stage")
        if self.cp_kind not in CP_KINDS:
            raise SpecError("plan.cp_kind", f"unknown value {self.cp_kind!r}", f"use one of {', '.join(CP_KINDS)}")
        if self.dp % self.ep:
            raise SpecError("plan.ep", f"{self.ep} does not divide the data-parallel size {self.dp}",
                            f"use an expert-parallel size dividing {self.dp}")
        if self.sequence_parallel and self.tp == 1:
            raise SpecError("plan.sequence_parallel", "needs tp > 1", "drop --sequence-parallel or raise --tp")

    @property
    def prefetch(self) -> int:
        """stage3_prefetch_bucket_size in elements."""
        return self.prefetch_elements or self.bucket_elements

    @property
    def live(self) -> int:
        """stage3_max_live_parameters in elements."""
        return self.live_elements or self.bucket_elements

    @property
    def zero_shard(self) -> int:
        """Ranks ZeRO partitions the model states over: the MiCS shard group, else DP."""
        return self.mics_shard or self.dp

    def variant_labels(self) -> tuple[tuple[str, str], ...]:
        """(words, short label) of each of DeepSpeed's ZeRO variants the plan uses, e.g.
        ("ZeRO++ hpZ 8", "hpZ8"); empty for plain ZeRO."""
        out = []
        if self.offload_optimizer != "none":
            out.append((f"optimizer offload to {self.offload_optimizer}", f"off-opt:{self.offload_optimizer}"))
        if self.offload_params != "none":
            out.append((f"parameter offload to {self.offload_params}", f"off-par:{self.offload_params}"))
        if self.hpz > 1:
            out.append((f"ZeRO++ hpZ {self.hpz}", f"hpZ{self.hpz}"))
        if self.quantized_weights:
            out.append(("ZeRO++ qwZ", "qwZ"))
        if self.quantized_gradients:
            out.append(("ZeRO++ qgZ", "qgZ"))
        if self.mics_shard:
            out.append((f"MiCS shard {self.mics_shard}", f"MiCS{self.mics_shard}"))
        return tuple(out)

    @property
    def variants(self) -> tuple[str, ...]:
        """DeepSpeed's ZeRO variants the plan uses, in words (empty: plain ZeRO)."""
        return tuple(words for words, _ in self.variant_labels())

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def mesh(self) -> Mesh:
        """The rank layout (planner/specs/mesh.py)."""
        return Mesh(pp=self.pp, dp=self.dp, cp=self.cp, tp=self.tp)

    def rank(self, pp: int = 0, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        """The global rank at these parallel coordinates."""
        return self.mesh.rank(pp, dp, cp, tp)

    def coords(self, rank: int) -> Coords:
        """(pp, dp, cp, tp) indices of a global rank."""
        return self.mesh.coords(rank)

    def groups(self, axis: str) -> tuple[tuple[int, ...], ...]:
        """Every group of ranks along axis "pp", "dp", "cp" or "tp", stage by stage."""
        return self.mesh.groups(axis)

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same experts (expert data parallelism): dp x cp / ep. Expert
        gradients are reduced, and ZeRO partitions their states, over this group (DeepSpeed
        moe/utils.py split_params_into_different_moe_groups_for_optimizer; Megatron-Core
        expert_data_parallel_size)."""
        return self.dp * self.cp // self.ep

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp

    def layers_per_stage(self, layers: int) -> tuple[int, ...]:
        """stage_layers, or the uniform split (earlier stages take the remainder)."""
        if self.stage_layers:
            return self.stage_layers
        base, extra = divmod(layers, self.pp)
        return tuple(base + (1 if i < extra else 0) for i in range(self.pp))

    def checkpointed_per_stage(self, layers: int) -> tuple[int, ...]:
        """Blocks under full recompute in each stage."""
        per_stage = self.layers_per_stage(layers)
        if self.recompute != "full":
            return tuple(0 for _ in per_stage)
        if self.recompute_layers:
            return self.recompute_layers
        return per_stage

    def describe(self) -> str:
        """The plan in words, e.g. "ZeRO-1, TP 4 x PP 8 x DP 24, micro-batch 1, accumulation 176"."""
        rc = {"none": "no recompute", "selective": "selective recompute", "full": "full recompute"}[self.recompute]
        if self.recompute == "full" and self.recompute_layers and self.stage_layers and \
                tuple(self.recompute_layers) != tuple(self.stage_layers):
            rc = f"full recompute of {sum(self.recompute_layers)}/{sum(self.stage_layers)} layers"
        parts = [f"ZeRO-{self.zero}", f"TP {self.tp} x PP {self.pp} x DP {self.dp}",
                 f"micro-batch {self.micro_batch}", f"accumulation {self.grad_accum}", rc, self.precision]
        if self.sequence_parallel:
            parts.append("sequence parallel")
        if self.cp > 1:
            parts.append(f"{'Ulysses SP' if self.cp_kind == 'ulysses' else 'ring CP'} {self.cp}")
        if self.ep > 1:
            parts.append(f"EP {self.ep}")
        if self.schedule == "interleaved":
            parts.append(f"interleaved x{self.interleave}")
        parts += self.variants
        if self.runtime != RUNTIMES[0]:
            parts.append(f"on {self.runtime}")
        if self.bucket_elements != DEFAULT_BUCKET and (self.zero > 0 or self.dp > 1):
            parts.append(f"buckets of {self.bucket_elements:,} elements")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["stage_layers"] = list(self.stage_layers)
        d["recompute_layers"] = list(self.recompute_layers)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        check_fields(cls, data, "plan", "pass the plan section of plan.json")
        kw = dict(data)
        for f in ("stage_layers", "recompute_layers"):
            if f in kw:
                if not isinstance(kw[f], (list, tuple)) or any(
                        not isinstance(x, int) or isinstance(x, bool) for x in kw[f]):
                    raise SpecError(f"plan.{f}", "must be a list of integers", "fix plan.json")
                kw[f] = tuple(kw[f])
        return cls(**kw)
