"""Structural legality of a plan for a model, cluster and training setup.

These are DeepSpeed's and Megatron's hard rules (DESIGN.md "What DeepSpeed can actually
run"); memory feasibility is the cost model's job. Each problem is one sentence with the fix.
"""
from __future__ import annotations

import math

from planner.specs.hardware import ClusterSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import Plan
from planner.specs.train import TrainSpec


def plan_problems(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, plan: Plan) -> list[str]:
    """Everything that makes `plan` impossible to launch as written (empty list: legal)."""
    out: list[str] = []
    if plan.world_size != cluster.world_size:
        out.append(f"dp {plan.dp} x tp {plan.tp} x pp {plan.pp} = {plan.world_size} processes, "
                   f"but the cluster has {cluster.world_size} devices: choose degrees whose product is {cluster.world_size}")
    if plan.tp > cluster.gpus_per_node or cluster.gpus_per_node % plan.tp:
        out.append(f"tp {plan.tp} must divide the {cluster.gpus_per_node} devices of a node "
                   "(tensor parallelism stays inside a node)")
    # Megatron TP splits QKV by heads and KV groups and the FFN by columns (the executor's
    # planner/executor/parallel/tensor.py); the vocabulary is padded, so it always splits
    if model.heads % plan.tp:
        out.append(f"tp {plan.tp} does not divide the {model.heads} attention heads: "
                   f"use a TP degree dividing {math.gcd(model.heads, model.kv_heads, model.ffn_hidden)}")
    if model.kv_heads % plan.tp:
        out.append(f"tp {plan.tp} does not divide the {model.kv_heads} KV groups: "
                   f"use a TP degree dividing {math.gcd(model.heads, model.kv_heads, model.ffn_hidden)}")
    if model.ffn_hidden % plan.tp:
        out.append(f"tp {plan.tp} does not divide the FFN size {model.ffn_hidden}: "
                   f"use a TP degree dividing {math.gcd(model.heads, model.kv_heads, model.ffn_hidden)}")
    if model.share_layers > 1 and plan.pp > 1:
        out.append(f"share-layers {model.share_layers} with pp {plan.pp}: a shared block's parameters would "
                   "have to live on several stages (DeepSpeed's pipeline cannot tie them): use pp 1")
    if plan.pp * plan.interleave > model.layers:
        out.append(f"pp {plan.pp} x interleave {plan.interleave} exceeds the {model.layers} layers")
    if plan.stage_layers:
        if sum(plan.stage_layers) != model.layers:
            out.append(f"stage_layers sum to {sum(plan.stage_layers)}, the model has {model.layers} layers")
        if plan.pp > 1 and any(n == 0 for n in plan.stage_layers):
            out.append("every pipeline stage needs at least one layer")
    if plan.global_batch != train.global_batch:
        out.append(f"micro-batch {plan.micro_batch} x accumulation {plan.grad_accum} x dp {plan.dp} = "
                   f"{plan.global_batch}, not the global batch {train.global_batch}")
    if plan.schedule == "interleaved" and plan.grad_accum % plan.pp:
        out.append(f"the interleaved schedule needs accumulation ({plan.grad_accum}) divisible by pp ({plan.pp})")
    if train.seq_len > model.max_seq:
        out.append(f"sequence length {train.seq_len} exceeds the model's maximum {model.max_seq}")
    if plan.sequence_parallel and train.seq_len % plan.tp:
        out.append(f"sequence parallel needs seq_len {train.seq_len} divisible by tp {plan.tp}")
    if plan.precision == "fp8" and not cluster.device.supports("fp8"):
        out.append(f"{cluster.device.name} has no FP8 tensor cores (profile fp8 / peak_tflops.fp8): use bf16, "
                   "or an FP8 GPU (H100, H200, L40S, B200)")
    elif not cluster.device.supports(plan.precision):
        out.append(f"{cluster.device.name} does not support {plan.precision}: use "
                   + " or ".join(p for p in ("bf16", "fp16", "fp32") if cluster.device.supports(p)))
    if cluster.device.kind == "cpu" and plan.precision == "fp16":
        out.append("fp16 does not train on CPU under DeepSpeed: use bf16 or fp32")
    out += variant_problems(cluster, plan)
    return out


def variant_problems(cluster: ClusterSpec, plan: Plan) -> list[str]:
    """The cluster-dependent rules of DeepSpeed's ZeRO variants (the plan-only ones are
    checked when the Plan is built): hpZ's secondary group lives inside a node; offload needs
    the host's numbers; NVMe offload needs an NVMe bandwidth."""
    out = []
    g = cluster.gpus_per_node // plan.tp if cluster.gpus_per_node % plan.tp == 0 else cluster.gpus_per_node
    if plan.hpz > 1 and g % plan.hpz:
        out.append(f"plan.hpz {plan.hpz} does not divide the {g} data-parallel ranks of a node "
                   f"(zero_hpz_partition_size must stay inside a node): use a divisor of {g}")
    host = cluster.host
    gpu = cluster.device.kind != "cpu"
    if not gpu and (plan.quantized_weights or plan.quantized_gradients):
        out.append("ZeRO++ qwZ/qgZ need DeepSpeed's CUDA quantizer kernels (QuantizerBuilder has no CPU op): "
                   "drop quantized_weights/quantized_gradients on a CPU cluster")
    offloads = {plan.offload_optimizer, plan.offload_params} - {"none"}
    if offloads and gpu and not host.can_offload:
        missing = [f for f, v in (("--cpu-mem-gb", host.cpu_memory_gb), ("host.pcie_gbps", host.pcie_gbps),
                                  ("host.cpu_adam_gparams", host.cpu_adam_gparams)) if not v]
        out.append(f"offload needs the host's {', '.join(missing)}, unknown for {cluster.device.name}: "
                   "give them (--cpu-mem-gb, or a profile's host block)")
    if "nvme" in offloads and not host.nvme_gbps:
        out.append("offload to NVMe needs the NVMe bandwidth: pass --nvme-gbps (GB/s per node)")
    return out


def runtime_problems(plan: Plan) -> list[str]:
    """What the executor under DeepSpeed 0.19.8 cannot run: DeepSpeed's PipelineEngine has
    only the plain 1F1B schedule, and MiCS is gone from it. Such plans stay in the space (evaluated, shown with this
    reason) but are only chosen with --megatron-features. Megatron sequence parallelism is
    not here: the executor's own TP layers run it (tests/integration/test_parity.py)."""
    if plan.runtime != "deepspeed":
        return [f"the plan is for the {plan.runtime} runtime (plan.runtime): `planner run` and the DeepSpeed "
                "exports execute DeepSpeed only (estimated for comparison; docs/runtimes.md)"]
    out = []
    if plan.schedule == "interleaved":
        out.append("DeepSpeed's PipelineEngine has no interleaved schedule (Megatron-LM only; "
                   "--megatron-features allows it)")
    if plan.mics_shard:
        out.append("MiCS was removed from DeepSpeed (0.19.8 rejects zero_optimization.mics_shard_size, "
                   "deepspeedai/DeepSpeed#8489): estimated for comparison, never chosen")
    return out
