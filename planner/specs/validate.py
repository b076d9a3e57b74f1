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
        cp = f" x cp {plan.cp}" if plan.cp > 1 else ""
        out.append(f"dp {plan.dp} x tp {plan.tp} x pp {plan.pp}{cp} = {plan.world_size} processes, "
                   f"but the cluster has {cluster.world_size} devices: choose degrees whose product is {cluster.world_size}")
    if plan.tp > cluster.gpus_per_node or cluster.gpus_per_node % plan.tp:
        out.append(f"tp {plan.tp} must divide the {cluster.gpus_per_node} devices of a node "
                   "(tensor parallelism stays inside a node)")
    # Megatron TP splits QKV by heads and KV groups and the FFN by columns (the executor's
    # planner/model/parallel/tensor.py); the vocabulary is padded, so it always splits
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
    out += moe_problems(model, plan) + context_problems(model, cluster, train, plan)
    return out


def moe_problems(model: ModelSpec, plan: Plan) -> list[str]:
    """Expert parallelism (docs/moe.md): EP needs routed experts and divides them (each EP
    rank holds experts / ep whole experts); it divides dp (checked when the Plan is built:
    DeepSpeed-MoE carves EP groups from the data-parallel ranks)."""
    if model.moe is not None and plan.zero == 3:
        return ["ZeRO-3 with mixture-of-experts layers is not modelled (expert parameter groups under stage 3): "
                "use ZeRO 0-2"]
    if plan.ep == 1:
        return []
    if model.moe is None:
        return [f"plan.ep {plan.ep} needs a mixture-of-experts model ({model.name} is dense): use ep 1"]
    if model.moe.experts % plan.ep:
        return [f"plan.ep {plan.ep} does not divide the {model.moe.experts} experts: use an expert-parallel "
                f"size dividing {math.gcd(model.moe.experts, plan.dp)}"]
    return []


def context_problems(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, plan: Plan) -> list[str]:
    """Context parallelism (docs/long-context.md). Ulysses moves heads: cp x tp divides the
    heads and the KV groups (DeepSpeed sequence/layer.py scatters the head dimension) and cp the
    sequence; ring attention (Megatron-Core) splits each sequence into 2 cp chunks for causal
    load balance, so the sequence must be divisible by 2 cp. Both are modelled with the flash
    kernel only (no s x s scores kept)."""
    c = plan.cp
    if c == 1:
        return []
    out = []
    if plan.cp_kind == "ulysses":
        for what, n in (("attention heads", model.heads), ("KV groups", model.kv_heads)):
            if n % (c * plan.tp):
                g = math.gcd(model.heads, model.kv_heads)
                out.append(f"Ulysses cp {c} x tp {plan.tp} does not divide the {n} {what}: use a cp dividing "
                           f"{g // plan.tp if g % plan.tp == 0 else 1}, or ring cp")
                break
        if train.seq_len % c:
            out.append(f"Ulysses cp {c} needs seq_len {train.seq_len} divisible by {c}")
    elif train.seq_len % (2 * c):
        out.append(f"ring cp {c} needs seq_len {train.seq_len} divisible by 2 x cp = {2 * c} "
                   f"(use a multiple of {2 * c})")
    if model.linear_attention:
        out.append("context parallelism is modelled for softmax attention only: drop --variant linear-attention or use cp 1")
    elif train.attention == "eager" or (cluster.device.kind == "cpu" and model.attention_dropout > 0):
        out.append("context parallelism is modelled with the flash kernel only: use --attention flash "
                   "(and no attention dropout on a CPU)")
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
    if plan.cp > 1 and plan.cp_kind == "ring":
        out.append("ring context parallelism is Megatron-Core's (DeepSpeed has Ulysses only; --megatron-features "
                   "allows it)")
    if plan.mics_shard:
        out.append("MiCS was removed from DeepSpeed (0.19.8 rejects zero_optimization.mics_shard_size, "
                   "deepspeedai/DeepSpeed#8489): estimated for comparison, never chosen")
    return out
