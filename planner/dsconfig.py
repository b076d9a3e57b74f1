"""Plan -> DeepSpeed config, launch script and hostfile (DESIGN.md "dsconfig" layer).

Every value DeepSpeed would otherwise pick itself ("auto" or a default that matters for
memory) is written out, so the run does exactly what the plan and its estimate assumed.

Optimizer choice (measured, /work/shared/notes/deepspeed-on-cpu.md "One-time compiles"):
- on GPUs the config names AdamW, so DeepSpeed uses its fused CUDA Adam;
- on CPU the config names no optimizer and sets `zero_allow_untested_optimizer`; the
  executor passes a `torch.optim.AdamW` built from `OPTIMIZER` (naming AdamW on CPU would
  JIT-compile DeepSpeed's CPU FusedAdam, ~30 s per fresh machine, for no benefit here).
Both use the same hyperparameters (`OPTIMIZER`).

Tensor parallelism is not a DeepSpeed setting here: the executor's model is built from
Megatron-style tensor-parallel layers (planner/model/parallel/, Shoeybi et al. 2019,
sec. 3) on the groups of DeepSpeed's PipeModelDataParallelTopology, and DeepSpeed is handed
those groups (an mpu, or the PipelineModule's topology). The config therefore has no
"tensor_parallel" block: DeepSpeed must not run AutoTP over layers that are already split.
"""
from __future__ import annotations

import shlex
from typing import Any

from planner.cost.params import persistence_threshold
from planner.specs.cluster import ClusterSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import Plan
from planner.specs.train import TrainSpec

OPTIMIZER: dict[str, Any] = {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
"""AdamW hyperparameters (GLM-130B used AdamW, beta2 0.95, weight decay 0.1; Zeng et al. 2022, sec. 3)."""
GRADIENT_CLIPPING = 1.0
"""Global gradient-norm clip (GLM-130B sec. 3: clip 1.0)."""
STEPS_PER_PRINT = 10
MONITOR_DIR = "logs"
"""TensorBoard and CSV monitor output, relative to the run directory (the launch cwd)."""
ENTRY_MODULE = "planner.runtime.train.worker"
"""The training entry the launch script runs (one process per rank)."""


NVME_PATH = "/local_nvme"
"""Where ZeRO-Infinity swaps to (offload device nvme): edit to your NVMe mount."""


def _offload(device: str, gpu: bool) -> dict[str, Any]:
    # pinned host buffers speed PCIe copies on GPUs; a CPU accelerator has nothing to pin for
    block: dict[str, Any] = {"device": device, "pin_memory": gpu}
    if device == "nvme":
        block["nvme_path"] = NVME_PATH
    return block


def _zero_block(plan: Plan, model: ModelSpec, gpu: bool = True) -> dict[str, Any]:
    z: dict[str, Any] = {
        "stage": plan.zero,
        "overlap_comm": bool(plan.overlap_comm),
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "reduce_bucket_size": plan.bucket_elements,
        "allgather_partitions": True,
        "allgather_bucket_size": plan.bucket_elements,
        "round_robin_gradients": False,
    }
    if plan.zero == 3:
        z.update({
            "stage3_prefetch_bucket_size": plan.prefetch,
            # default: HF Trainer's "auto" rule for persistence, 10 x hidden (small params stay whole)
            "stage3_param_persistence_threshold": plan.persistence_elements or persistence_threshold(model),
            "stage3_max_live_parameters": plan.live,
            "stage3_max_reuse_distance": plan.live,
            "stage3_gather_16bit_weights_on_model_save": False,
            "sub_group_size": plan.bucket_elements,
            "zero_hpz_partition_size": plan.hpz,
            "zero_quantized_weights": plan.quantized_weights,
            "zero_quantized_gradients": plan.quantized_gradients,
        })
        if plan.mics_shard:
            z["mics_shard_size"] = plan.mics_shard
            z["mics_hierarchical_params_gather"] = False
        if plan.offload_params != "none":
            z["offload_param"] = _offload(plan.offload_params, gpu)
    if plan.offload_optimizer != "none":
        z["offload_optimizer"] = _offload(plan.offload_optimizer, gpu)
    return z


def ds_config(plan: Plan, model: ModelSpec, train: TrainSpec, cluster: ClusterSpec) -> dict[str, Any]:
    """The DeepSpeed config for `plan`: batch sizes, precision, ZeRO, pipeline, monitor (TP is the
    executor's own layers, see the module docstring)."""
    gpu = cluster.device.kind != "cpu"
    cfg: dict[str, Any] = {
        "train_batch_size": plan.global_batch,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
        "gradient_clipping": GRADIENT_CLIPPING,
        "steps_per_print": STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
        "prescale_gradients": False,
        "bf16": {"enabled": plan.precision == "bf16"},
        "fp16": {"enabled": plan.precision == "fp16", "loss_scale": 0, "initial_scale_power": 16,
                 "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        "zero_optimization": _zero_block(plan, model, gpu),
        "activation_checkpointing": {
            # which blocks are checkpointed is the plan's recompute_layers (executor); these
            # settings say how: plain recompute, activations neither partitioned nor offloaded
            "partition_activations": False, "cpu_checkpointing": False,
            "contiguous_memory_optimization": False, "number_checkpoints": None,
            "synchronize_checkpoint_boundary": False, "profile": False},
        "tensorboard": {"enabled": True, "output_path": MONITOR_DIR, "job_name": "tensorboard"},
        "csv_monitor": {"enabled": True, "output_path": MONITOR_DIR, "job_name": "csv"},
    }
    if gpu:
        cfg["optimizer"] = {"type": "AdamW", "params": dict(OPTIMIZER)}
    else:
        cfg["zero_allow_untested_optimizer"] = True
        if plan.offload_optimizer != "none":
            # offload with the executor's torch AdamW (DeepSpeedCPUAdam would JIT-compile cpu_adam)
            cfg["zero_force_ds_cpu_optimizer"] = False
    if plan.pp > 1:
        # DeepSpeed reads stages/seed/interval here; stage_layers records the plan's explicit
        # boundaries, which the executor's PipelineModule applies (DeepSpeed has no such method)
        cfg["pipeline"] = {"stages": plan.pp, "stage_layers": list(plan.layers_per_stage(model.layers)),
                           "seed_layers": True, "activation_checkpoint_interval": 0,
                           "pipe_partitioned": False, "grad_partitioned": False}
    return cfg


LR_SCHEDULES = ("cosine", "constant")
"""`--lr-schedule`: warmup then cosine decay (DeepSpeed's WarmupCosineLR), or warmup then constant
(DeepSpeed's WarmupLR)."""
COS_MIN_RATIO = 0.1
"""Cosine floor as a share of the peak learning rate (GLM-130B decayed to 10%; Zeng et al. 2022, sec. 3)."""


def lr_scheduler(schedule: str, lr: float, warmup_steps: int, total_steps: int) -> dict[str, Any]:
    """The ds_config "scheduler" block for a run of `total_steps` optimizer steps (DeepSpeed
    0.19.8, deepspeed/runtime/lr_schedules.py). Both schedulers warm up linearly over
    max(2, warmup_steps) steps (DeepSpeed's own floor); with `warmup_steps` 0 the constant
    schedule starts and stays at `lr` (min = max). WarmupCosineLR scales the optimizer's own
    learning rate, so the executor builds the optimizer with `lr` (planner/runtime/train/settings.py configure_lr).

    DeepSpeed steps the scheduler after each optimizer step: the step with index k (from 0)
    uses the rate of scheduler iteration k - 1, and iteration -1 is the warmup's start (0 for
    cosine, the floor for WarmupLR); metrics.json records the rate each step used."""
    if schedule == "cosine":
        return {"type": "WarmupCosineLR", "params": {
            "total_num_steps": int(total_steps), "warmup_min_ratio": 0.0,
            "warmup_num_steps": max(1, int(warmup_steps)), "cos_min_ratio": COS_MIN_RATIO,
            "warmup_type": "linear"}}
    if schedule == "constant":
        return {"type": "WarmupLR", "params": {
            "warmup_min_lr": 0.0 if warmup_steps > 0 else float(lr), "warmup_max_lr": float(lr),
            "warmup_num_steps": max(1, int(warmup_steps)), "warmup_type": "linear"}}
    raise ValueError(f"unknown learning-rate schedule {schedule!r}")


def hostfile(cluster: ClusterSpec) -> str | None:
    """A DeepSpeed hostfile for multi-node clusters (None on one node); edit the host names."""
    if cluster.nodes == 1:
        return None
    lines = ["# one line per node: <hostname> slots=<devices>; replace node-<i> with your hosts"]
    lines += [f"node-{i} slots={cluster.gpus_per_node}" for i in range(cluster.nodes)]
    return "\n".join(lines) + "\n"


def launch_script(plan: Plan, model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, run_dir: str) -> str:
    """A bash script that launches the plan with the deepspeed launcher from its run directory."""
    cpu = cluster.device.kind == "cpu"
    args = ["${DEEPSPEED:-deepspeed}"]
    if cluster.nodes > 1:
        args += ["--hostfile", "hostfile", "--num_nodes", str(cluster.nodes)]
    args += ["--num_gpus", str(cluster.gpus_per_node), "--module", ENTRY_MODULE, "--run-dir", "."]
    env = ["export DS_ACCELERATOR=cpu", "export MALLOC_MMAP_THRESHOLD_=65536"] if cpu else []
    lines = ["#!/usr/bin/env bash",
             f"# {model.name}: {plan.describe()}",
             f"# {cluster.world_size} processes; config: ds_config.json; plan: plan.json (run dir {shlex.quote(str(run_dir))})",
             "# extra arguments go to the training entry, e.g. --steps 20 --warmup 3 --resume, or a trainer's:",
             "#   --data corpus.txt --tokenizer TOK_DIR --lr 3e-4 --lr-warmup-steps 100 --lr-schedule cosine",
             "#   --eval-every 50 --checkpoint-every 200 --metrics-port 9400 --init-hf HF_DIR --save-hf OUT_DIR",
             "# rank 0 prints one progress line per step and writes metrics.json here at the end",
             "# needs `deepspeed` on PATH (or DEEPSPEED=/path/to/deepspeed) and planner importable on every host",
             "set -euo pipefail",
             'cd "$(dirname "$0")"',
             *env,
             " ".join(args) + ' "$@"']
    return "\n".join(lines) + "\n"
