"""Structural legality of a plan for a model, cluster and training setup: the one set of plan rules.

These are DeepSpeed's and Megatron's hard rules (DESIGN.md "What DeepSpeed can actually
run"); memory feasibility is the cost model's job. Each rule gives a Problem (planner/specs/
problems.py: field, code, message, fix): the cost model, the search, the CLI, the run's
preflight (planner/runtime/preflight/checks.py) and the report all read these.
- plan_problems: what makes a plan impossible to launch as written;
- runtime_problems: what DeepSpeed 0.19.8 cannot run (estimated for comparison, never chosen);
- executor_problems: what `planner run` on this machine does not execute.
"""
from __future__ import annotations

import math

from planner.specs.cluster import ClusterSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import Plan
from planner.specs.problems import Problem
from planner.specs.train import TrainSpec


def plan_problems(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, plan: Plan) -> list[Problem]:
    """Everything that makes `plan` impossible to launch as written (empty list: legal)."""
    out: list[Problem] = []
    if plan.world_size != cluster.world_size:
        cp = f" x cp {plan.cp}" if plan.cp > 1 else ""
        out.append(Problem("plan.dp/tp/pp", "world-size",
                           f"dp {plan.dp} x tp {plan.tp} x pp {plan.pp}{cp} = {plan.world_size} processes, "
                           f"but the cluster has {cluster.world_size} devices",
                           f"choose degrees whose product is {cluster.world_size}"))
    if plan.tp > cluster.gpus_per_node or cluster.gpus_per_node % plan.tp:
        out.append(Problem("plan.tp", "tp-node", f"tp {plan.tp} must divide the {cluster.gpus_per_node} devices of "
                           "a node (tensor parallelism stays inside a node)"))
    # Megatron TP splits QKV by heads and KV groups and the FFN by columns (the executor's
    # planner/model/parallel/tensor.py); the vocabulary is padded, so it always splits
    divisor = f"use a TP degree dividing {math.gcd(model.heads, model.kv_heads, model.ffn_hidden)}"
    for code, n, what in (("tp-heads", model.heads, f"the {model.heads} attention heads"),
                          ("tp-kv-groups", model.kv_heads, f"the {model.kv_heads} KV groups"),
                          ("tp-ffn", model.ffn_hidden, f"the FFN size {model.ffn_hidden}")):
        if n % plan.tp:
            out.append(Problem("plan.tp", code, f"tp {plan.tp} does not divide {what}", divisor))
    if model.share_layers > 1 and plan.pp > 1:
        out.append(Problem("plan.pp", "pp-shared-layers",
                           f"share-layers {model.share_layers} with pp {plan.pp}: a shared block's parameters would "
                           "have to live on several stages (DeepSpeed's pipeline cannot tie them)", "use pp 1"))
    if plan.pp * plan.interleave > model.layers:
        out.append(Problem("plan.pp", "pp-layers",
                           f"pp {plan.pp} x interleave {plan.interleave} exceeds the {model.layers} layers"))
    if plan.stage_layers:
        if sum(plan.stage_layers) != model.layers:
            out.append(Problem("plan.stage_layers", "stage-layers-sum",
                               f"stage_layers sum to {sum(plan.stage_layers)}, the model has {model.layers} layers"))
        if plan.pp > 1 and any(n == 0 for n in plan.stage_layers):
            out.append(Problem("plan.stage_layers", "stage-empty", "every pipeline stage needs at least one layer"))
    if plan.global_batch != train.global_batch:
        out.append(Problem("plan.micro_batch/grad_accum", "global-batch",
                           f"micro-batch {plan.micro_batch} x accumulation {plan.grad_accum} x dp {plan.dp} = "
                           f"{plan.global_batch}, not the global batch {train.global_batch}"))
    if plan.schedule == "interleaved" and plan.grad_accum % plan.pp:
        out.append(Problem("plan.grad_accum", "interleaved-accumulation",
                           f"the interleaved schedule needs accumulation ({plan.grad_accum}) divisible by pp ({plan.pp})"))
    if train.seq_len > model.max_seq:
        out.append(Problem("train.seq_len", "seq-len",
                           f"sequence length {train.seq_len} exceeds the model's maximum {model.max_seq}"))
    if plan.sequence_parallel and train.seq_len % plan.tp:
        out.append(Problem("plan.sequence_parallel", "sp-seq-len",
                           f"sequence parallel needs seq_len {train.seq_len} divisible by tp {plan.tp}"))
    if plan.precision == "fp8" and not cluster.device.supports("fp8"):
        out.append(Problem("plan.precision", "precision-fp8",
                           f"{cluster.device.name} has no FP8 tensor cores (profile fp8 / peak_tflops.fp8)",
                           "use bf16, or an FP8 GPU (H100, H200, L40S, B200)"))
    elif not cluster.device.supports(plan.precision):
        out.append(Problem("plan.precision", "precision", f"{cluster.device.name} does not support {plan.precision}",
                           "use " + " or ".join(p for p in ("bf16", "fp16", "fp32") if cluster.device.supports(p))))
    if cluster.device.kind == "cpu" and plan.precision == "fp16":
        out.append(Problem("plan.precision", "precision-cpu-fp16", "fp16 does not train on CPU under DeepSpeed",
                           "use bf16 or fp32"))
    out += variant_problems(cluster, plan)
    out += moe_problems(model, plan) + context_problems(model, cluster, train, plan)
    return out


def moe_problems(model: ModelSpec, plan: Plan) -> list[Problem]:
    """Expert parallelism (docs/moe.md): EP needs routed experts and divides them (each EP
    rank holds experts / ep whole experts); it divides dp (checked when the Plan is built:
    DeepSpeed-MoE carves EP groups from the data-parallel ranks)."""
    if model.moe is not None and plan.zero == 3:
        return [Problem("plan.zero", "moe-zero3", "ZeRO-3 with mixture-of-experts layers is not modelled (expert "
                        "parameter groups under stage 3)", "use ZeRO 0-2")]
    if plan.ep == 1:
        return []
    if model.moe is None:
        return [Problem("plan.ep", "ep-dense", f"plan.ep {plan.ep} needs a mixture-of-experts model ({model.name} is "
                        "dense)", "use ep 1")]
    if model.moe.experts % plan.ep:
        return [Problem("plan.ep", "ep-experts", f"plan.ep {plan.ep} does not divide the {model.moe.experts} experts",
                        f"use an expert-parallel size dividing {math.gcd(model.moe.experts, plan.dp)}")]
    return []


def context_problems(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, plan: Plan) -> list[Problem]:
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
                out.append(Problem("plan.cp", "cp-heads", f"Ulysses cp {c} x tp {plan.tp} does not divide the {n} {what}",
                                   f"use a cp dividing {g // plan.tp if g % plan.tp == 0 else 1}, or ring cp"))
                break
        if train.seq_len % c:
            out.append(Problem("plan.cp", "cp-seq-len", f"Ulysses cp {c} needs seq_len {train.seq_len} divisible by {c}"))
    elif train.seq_len % (2 * c):
        out.append(Problem("plan.cp", "cp-seq-len", f"ring cp {c} needs seq_len {train.seq_len} divisible by 2 x cp = "
                           f"{2 * c} (use a multiple of {2 * c})"))
    if model.linear_attention:
        out.append(Problem("plan.cp", "cp-linear", "context parallelism is modelled for softmax attention only",
                           "drop --variant linear-attention or use cp 1"))
    elif train.attention == "eager" or (cluster.device.kind == "cpu" and model.attention_dropout > 0):
        out.append(Problem("plan.cp", "cp-kernel", "context parallelism is modelled with the flash kernel only",
                           "use --attention flash (and no attention dropout on a CPU)"))
    return out


def variant_problems(cluster: ClusterSpec, plan: Plan) -> list[Problem]:
    """The cluster-dependent rules of DeepSpeed's ZeRO variants (the plan-only ones are
    checked when the Plan is built): hpZ's secondary group lives inside a node; offload needs
    the host's numbers; NVMe offload needs an NVMe bandwidth."""
    out = []
    g = cluster.gpus_per_node // plan.tp if cluster.gpus_per_node % plan.tp == 0 else cluster.gpus_per_node
    if plan.hpz > 1 and g % plan.hpz:
        out.append(Problem("plan.hpz", "hpz-node", f"plan.hpz {plan.hpz} does not divide the {g} data-parallel ranks of "
                           "a node (zero_hpz_partition_size must stay inside a node)", f"use a divisor of {g}"))
    host = cluster.host
    gpu = cluster.device.kind != "cpu"
    if not gpu and (plan.quantized_weights or plan.quantized_gradients):
        out.append(Problem("plan.quantized_weights" if plan.quantized_weights else "plan.quantized_gradients",
                           "zeropp-cpu", "ZeRO++ qwZ/qgZ need DeepSpeed's CUDA quantizer kernels",
                           "re-plan without quantized weights/gradients, or run the plan on CUDA GPUs",
                           detail="QuantizerBuilder, which DeepSpeed 0.19.8 does not implement for the CPU accelerator: "
                           "'This op had not been implemented on CPU backend'"))
    offloads = {plan.offload_optimizer, plan.offload_params} - {"none"}
    if offloads and gpu and not host.can_offload:
        missing = [f for f, v in (("--cpu-mem-gb", host.cpu_memory_gb), ("host.pcie_gbps", host.pcie_gbps),
                                  ("host.cpu_adam_gparams", host.cpu_adam_gparams)) if not v]
        out.append(Problem("cluster.host", "offload-host", f"offload needs the host's {', '.join(missing)}, unknown "
                           f"for {cluster.device.name}", "give them (--cpu-mem-gb, or a profile's host block)"))
    if "nvme" in offloads and not host.nvme_gbps:
        out.append(Problem("--nvme-gbps", "offload-nvme", "offload to NVMe needs the NVMe bandwidth",
                           "pass --nvme-gbps (GB/s per node)"))
    return out


def runtime_problems(plan: Plan, model: ModelSpec | None = None) -> list[Problem]:
    """What the executor under DeepSpeed 0.19.8 cannot run: DeepSpeed's PipelineEngine has
    only the plain 1F1B schedule, and MiCS is gone from it. Such plans stay in the space (evaluated, shown with this
    reason) but are only chosen with --megatron-features. Megatron sequence parallelism is
    not here: the executor's own TP layers run it (tests/integration/test_parity.py).
    With `model` (the search passes it): the executor's DeepSpeed-MoE and Ulysses layers run
    with pp 1 only (pipeline_layers_problem), and launch.sh starts that executor, so a pp > 1
    MoE or cp plan is no DeepSpeed plan the planner can start either."""
    if plan.runtime != "deepspeed":
        return [Problem("plan.runtime", "runtime-other", f"a {plan.runtime} plan: `planner run` and the DeepSpeed "
                        "exports execute DeepSpeed only", detail="estimated for comparison; docs/runtimes.md")]
    out = []
    if plan.schedule == "interleaved":
        out.append(Problem("plan.schedule", "deepspeed-interleaved", "DeepSpeed's PipelineEngine has no interleaved "
                           "schedule", detail="Megatron-LM only; --megatron-features allows it"))
    if plan.cp > 1 and plan.cp_kind == "ring":
        out.append(Problem("plan.cp_kind", "deepspeed-ring-cp", "ring context parallelism is Megatron-Core's",
                           detail="DeepSpeed has Ulysses only; --megatron-features allows it"))
    if plan.mics_shard:
        out.append(Problem("plan.mics_shard", "deepspeed-mics", "DeepSpeed 0.19.8 removed MiCS",
                           "re-plan without MiCS (plain ZeRO-3, or hpZ for intra-node weight gathers)",
                           detail="its config rejects zero_optimization.mics_shard_size: 'MiCS ZeRO-3 sharding has "
                           "been removed', deepspeedai/DeepSpeed#8489; estimated for comparison, never chosen"))
    if model is not None:
        out += [p for p in (pipeline_layers_problem(model, plan),) if p is not None]
    return out


def pipeline_layers_problem(model: ModelSpec, plan: Plan) -> Problem | None:
    """DeepSpeed-MoE and DeepSpeed-Ulysses run in the executor's GLMModel (planner/model/moe.py,
    block.py SelfAttention), not in its pipeline stages (planner/model/parallel/pipeline.py)."""
    if plan.pp == 1 or (model.moe is None and plan.cp == 1):
        return None
    what = "mixture-of-experts layers" if model.moe is not None else "Ulysses context parallelism"
    return Problem("plan.pp", "executor-layers",
                   f"the executor runs {what} with pp 1 only (docs/moe.md, docs/long-context.md): such "
                   "plans are estimated for comparison, not chosen or run", "run a plan with pp 1")


def vocab_problem(model: ModelSpec, tp: int) -> Problem | None:
    """The executor's vocab-parallel embedding and output layer give each TP rank V_pad/t
    consecutive rows of the vocabulary padded to V_pad = ModelSpec.padded_vocab(t). A rank whose
    rows are all padding (the last rank starts at (t-1) V_pad/t >= V) would hold and compute
    nothing real: a vocabulary TP cannot split. E.g. V 9, t 4: V_pad 12, the last rank's rows
    9-11 are padding."""
    if tp == 1:
        return None
    rows = model.padded_vocab(tp) // tp
    if (tp - 1) * rows < model.vocab:
        return None
    real = -(-model.vocab // rows)  # ranks holding at least one real row
    ok = [t for t in range(1, tp) if not model.heads % t and not model.kv_heads % t and not vocab_problem(model, t)]
    return Problem("plan.tp", "tp-vocab", f"tp {tp} cannot split the vocabulary of {model.vocab} tokens: padded to "
                   f"{model.padded_vocab(tp)}, {rows} row(s) per TP rank, only {real} of the {tp} ranks would hold "
                   "real tokens", f"use tp {' or '.join(map(str, ok[-2:]))}, or re-plan with `planner search`")


def executor_problems(model: ModelSpec, cluster: ClusterSpec, plan: Plan) -> list[Problem]:
    """What `planner run` does not execute on this machine, for a plan legal under DeepSpeed:
    a vocabulary TP cannot split, layers the executor lacks, several nodes."""
    out = [p for p in (vocab_problem(model, plan.tp),) if p is not None]
    out += [p for p in (pipeline_layers_problem(model, plan),) if p is not None]
    if cluster.nodes > 1:
        out.append(Problem("cluster", "executor-nodes", f"{cluster.nodes} nodes: `planner run` launches on this "
                           "machine only", "use launch.sh with a hostfile (deepspeed launcher) for multi-node runs"))
    return out
