"""Megatron-DeepSpeed (deepspeedai/Megatron-DeepSpeed) pretrain_gpt.py arguments for any plan
DeepSpeed runs: TP and PP sizes, micro and global batch, the model's shape, recompute, ZeRO
stage, precision, sequence parallelism, and the DeepSpeed config.

Flag names and semantics are those of megatron/arguments.py and megatron/model/gpt_model.py at
deepspeedai/Megatron-DeepSpeed commit 4efb479d5317ce9b86096b9d8e3e8030b0b5263b (--deepspeed and
--deepspeed_config come from deepspeed.add_config_arguments, which arguments.py calls):

- with DeepSpeed's pipeline (GPTModelPipe) the stage split is PipelineModule(partition_method=
  "type:transformer"), fixed in gpt_model.py: DeepSpeed balances the transformer blocks over the
  stages and no flag sets uneven stages. A plan with another split gets it as a comment.
- GPTModelPipe takes its activation-checkpoint interval from --checkpoint-activations /
  --checkpoint-num-layers or from --recompute-method uniform --recompute-num-layers ("deepspeed's
  pipeline doesn't support the block recompute method"): under PP every block is checkpointed or
  none. The export writes the --recompute-* form only: --checkpoint-activations is the legacy
  flag arguments.py keeps "because DeepSpeed still relies on the old activation checkpointing
  mechanism" (gpt_model.py reads it first, with the same interval). Without PP
  (--no-pipeline-parallel) --recompute-method block --recompute-num-layers K checkpoints the
  first K blocks, as the plan's recompute_layers does.
- Flash attention (the plan's train.attention "flash", which the estimate assumes) is
  --use-flash-attn-v2 (transformer.py FlashSelfAttention with flash_attn_varlen_func).
- The learning-rate schedule is always stated: --lr-decay-style defaults to "linear" (a decay the
  plan does not have), and --train-iters (or --train-samples) is required: the cosine schedule's
  length, else the ${TRAIN_ITERS} the script asks for.
"""
from __future__ import annotations

from typing import Any

from planner.errors import SpecError
from planner.export.common import Export, RunFiles, arg_lines, clip, optimizer_params, plain_ds_config, readme, \
    refuse_runtime, schedule

SOURCE = "deepspeedai/Megatron-DeepSpeed@4efb479d5317ce9b86096b9d8e3e8030b0b5263b"
PLACEHOLDERS = {"DATA_PATH": "a Megatron indexed dataset prefix (PREFIX.bin/.idx, e.g. from planner prepare-data)",
                "TOKENIZER": "a Hugging Face tokenizer directory (--tokenizer-type HFTokenizer)",
                "MEGATRON_DS": "your Megatron-DeepSpeed checkout (holds pretrain_gpt.py)"}
TRAIN_ITERS = {"TRAIN_ITERS": "the optimizer steps to train (--train-iters: the schedule in ds_config.json does not fix them)"}


def _balanced(layers: int, pp: int) -> tuple[int, ...]:
    base, extra = divmod(layers, pp)
    return tuple(base + (1 if i < extra else 0) for i in range(pp))


def _recompute(run: RunFiles) -> tuple[list[str], list[str]]:
    p, layers = run.plan, run.model.layers
    if p.recompute == "none":
        return [], []
    if p.recompute == "selective":
        return ["--recompute-granularity", "selective"], []
    per_stage = p.checkpointed_per_stage(layers)
    stages = p.layers_per_stage(layers)
    if tuple(per_stage) == tuple(stages):          # every block
        return ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
                "--deepspeed-activation-checkpointing"], []
    if p.pp == 1:
        return ["--recompute-granularity", "full", "--recompute-method", "block",
                "--recompute-num-layers", str(per_stage[0])], []
    raise SpecError("--to", f"megatron-deepspeed's pipeline checkpoints every block or none (GPTModelPipe has no "
                    f"block recompute); the plan checkpoints {list(per_stage)} of {list(stages)} blocks per stage",
                    "write a plan with --recompute full on every block (planner estimate ... --recompute full "
                    "--write DIR), or use --to torchrun")


def model_args(run: RunFiles, core: bool = False) -> tuple[list[str], list[str]]:
    """The model's shape as pretrain_gpt.py flags, and the features no flag sets. `core`: the
    Megatron-LM (Megatron-Core) spelling of the flags that differ from Megatron-DeepSpeed's
    (grouped-query attention, the norm and its epsilon, rotary positions, a QKV-only bias)."""
    m, t = run.model, run.train
    name = "Megatron-LM" if core else "Megatron-DeepSpeed"
    args = ["--num-layers", str(m.layers), "--hidden-size", str(m.hidden), "--ffn-hidden-size", str(m.ffn_hidden),
            "--num-attention-heads", str(m.heads), "--seq-length", str(t.seq_len),
            "--max-position-embeddings", str(m.max_seq)]
    missing = []
    if m.kv_groups and m.kv_groups != m.heads:
        args += ["--group-query-attention", "--num-query-groups"] if core else ["--num-key-value-heads"]
        args.append(str(m.kv_groups))
    if core:
        args += ["--normalization", "RMSNorm" if m.norm == "rmsnorm" else "LayerNorm"]
    elif m.norm == "rmsnorm":
        args += ["--normalization", "rmsnorm"]
    args += ["--norm-epsilon" if core else "--layernorm-epsilon", repr(float(m.norm_eps))]
    if m.activation == "swiglu":
        args.append("--swiglu")
    elif m.activation == "geglu":
        missing.append(f"GeGLU feed-forward ({name} has --swiglu only)")
    if t.attention == "flash" and not core:    # Megatron-LM's flash backend is set by megatron_lm.py
        args.append("--use-flash-attn-v2")
    if m.position == "rotary":
        theta = "--rotary-base" if core else "--rotary-position-embeddings-theta"
        args += ["--position-embedding-type", "rope", "--rotary-percent", repr(float(m.rotary_fraction))] if core \
            else ["--use-rotary-position-embeddings"]
        if float(m.rope_theta).is_integer():
            args += [theta, str(int(m.rope_theta))]
        else:
            missing.append(f"rope theta {m.rope_theta} ({theta} takes an integer)")
    elif m.position == "alibi":
        missing.append("ALiBi positions")
    if not m.tied_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    if not m.linear_bias:
        args.append("--disable-bias-linear")
        if m.qkv_bias and core:
            args.append("--add-qkv-bias")
        elif m.qkv_bias:
            missing.append("a QKV bias without other linear biases (--disable-bias-linear drops both)")
    if m.norm_position != "pre":
        missing.append(f"{m.norm_position} layer norm placement (Megatron's blocks are pre-LN)")
    args += ["--attention-dropout", repr(float(m.attention_dropout)), "--hidden-dropout", repr(float(m.hidden_dropout)),
             "--vocab-size", str(m.vocab), "--make-vocab-size-divisible-by", "128" if core else "1"]
    return args, missing


def arguments(run: RunFiles) -> tuple[list[str], list[str]]:
    """pretrain_gpt.py arguments (data and tokenizer as ${VAR} placeholders) and what differs from the plan."""
    refuse_runtime(run, "megatron-deepspeed")
    p = run.plan
    warnings: list[str] = []
    args = ["--tensor-model-parallel-size", str(p.tp), "--pipeline-model-parallel-size", str(p.pp)]
    if p.pp == 1:
        args.append("--no-pipeline-parallel")
    if p.sequence_parallel:
        args.append("--sequence-parallel")
    args += ["--micro-batch-size", str(p.micro_batch), "--global-batch-size", str(p.global_batch)]
    margs, missing = model_args(run)
    args += margs
    rc, _ = _recompute(run)
    args += rc
    args += ["--zero-stage", str(p.zero)]
    if p.precision in ("bf16", "fp16"):
        args.append(f"--{p.precision}")
    opt = optimizer_params(run)
    args += ["--optimizer", "adam", "--lr", repr(float(opt["lr"])), "--adam-beta1", repr(float(opt["betas"][0])),
             "--adam-beta2", repr(float(opt["betas"][1])), "--adam-eps", repr(float(opt["eps"])),
             "--weight-decay", repr(float(opt["weight_decay"])), "--clip-grad", repr(clip(run))]
    sched = schedule(run)
    if sched.get("kind") == "cosine":
        args += ["--lr-decay-style", "cosine", "--lr-warmup-iters", str(sched["warmup_steps"]),
                 "--train-iters", str(sched["total_steps"]),
                 "--min-lr", repr(float(opt["lr"]) * sched["min_ratio"])]
    else:                                 # constant, or no scheduler in ds_config.json: constant
        args += ["--lr-decay-style", "constant", "--lr-warmup-iters", str(sched.get("warmup_steps", 0)),
                 "--train-iters", "${TRAIN_ITERS}"]
    args += ["--data-path", "${DATA_PATH}", "--data-impl", "mmap", "--split", "949,50,1",
             "--tokenizer-type", "HFTokenizer", "--tokenizer-model", "${TOKENIZER}",
             "--distributed-backend", "gloo" if run.cluster.device.kind == "cpu" else "nccl",
             "--deepspeed", "--deepspeed_config", "ds_config.json"]
    if missing:
        warnings.append("model features pretrain_gpt.py has no flag for (your model code must provide them): "
                        + "; ".join(missing))
    if p.pp > 1:
        split = tuple(p.layers_per_stage(run.model.layers))
        if split != _balanced(run.model.layers, p.pp):
            warnings.append(f"the plan's stage split {list(split)} (blocks per stage) is not set: GPTModelPipe fixes "
                            "partition_method=\"type:transformer\" (DeepSpeed balances the blocks) and no flag "
                            "sets uneven stages; edit megatron/model/gpt_model.py to apply it")
    if p.schedule == "interleaved":       # refused by refuse_runtime; kept for clarity
        warnings.append("interleaved schedule not expressed")
    return args, warnings


def placeholders(args: list[str]) -> dict[str, str]:
    """The environment variables the script needs: the fixed ones, and TRAIN_ITERS when used."""
    return {**PLACEHOLDERS, **(TRAIN_ITERS if "${TRAIN_ITERS}" in args else {})}


def _script(run: RunFiles, args: list[str], warnings: list[str]) -> str:
    p, c = run.plan, run.cluster
    need = placeholders(args)
    launcher = ["${DEEPSPEED:-deepspeed}"]
    if c.nodes > 1:
        launcher += ["--hostfile", "hostfile", "--num_nodes", str(c.nodes)]
    launcher += ["--num_gpus", str(c.gpus_per_node), '"${MEGATRON_DS}/pretrain_gpt.py"']
    lines = ["#!/usr/bin/env bash",
             f"# Megatron-DeepSpeed pretrain_gpt.py for {run.model.name}: {p.describe()}",
             f"# {c.world_size} processes; flags as in {SOURCE} megatron/arguments.py",
             *[f"# set {k}: {v}" for k, v in need.items()]]
    if p.pp > 1:
        lines.append(f"# stage split (blocks per stage): {list(p.layers_per_stage(run.model.layers))}; "
                     "Megatron-DeepSpeed balances blocks itself (partition_method=\"type:transformer\", no flag)")
    lines += [f"# NOTE: {w}" for w in warnings]
    lines += ["set -euo pipefail", 'cd "$(dirname "$0")"',
              *[f': "${{{k}:?set {k} to {v}}}"' for k, v in need.items()]]
    if c.device.kind == "cpu":
        lines.append("export DS_ACCELERATOR=cpu")
    lines += ["ARGS=(", *arg_lines(args)]
    lines += [")", " ".join(launcher) + ' "${ARGS[@]}" "$@"']
    return "\n".join(lines) + "\n"


def megatron_deepspeed(run: RunFiles) -> Export:
    args, warnings = arguments(run)
    files: dict[str, Any] = {"pretrain_gpt.sh": _script(run, args, warnings), "pretrain_gpt_args.json": args,
                             "ds_config.json": plain_ds_config(run)}
    if run.cluster.nodes > 1:
        from planner import dsconfig
        files["hostfile"] = dsconfig.hostfile(run.cluster)
    files["README.md"] = readme("Megatron-DeepSpeed", run, [
        "Files:",
        "- `pretrain_gpt.sh`: the deepspeed launcher running Megatron-DeepSpeed's pretrain_gpt.py with the plan's "
        "arguments (one per line).",
        "- `pretrain_gpt_args.json`: the same arguments as a JSON list (`${DATA_PATH}`, `${TOKENIZER}` are "
        "placeholders the script fills from the environment).",
        "- `ds_config.json`: the plan's DeepSpeed config (ZeRO, precision, batch sizes, clipping).", "",
        f"Flag names: {SOURCE}, megatron/arguments.py.", "",
        "    DATA_PATH=/data/corpus_text_document TOKENIZER=/models/tok MEGATRON_DS=~/Megatron-DeepSpeed "
        + ("TRAIN_ITERS=1000 " if "${TRAIN_ITERS}" in args else "") + "./pretrain_gpt.sh"], warnings)
    return Export(files=files, warnings=tuple(warnings), run="./pretrain_gpt.sh")
