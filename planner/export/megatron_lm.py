"""Megatron-LM (Megatron-Core) pretrain_gpt.py arguments for a plan on the megatron-core runtime
(docs/runtimes.md): TP with sequence parallelism and TP communication overlap, PP with the
interleaved schedule, the distributed optimizer (ZeRO-1) or Megatron-FSDP (ZeRO-3), overlapped
gradient reduction and parameter gather, fp8 through Transformer Engine, the model's shape.

Flag names are those of NVIDIA/Megatron-LM megatron/training/arguments.py (Megatron-Core 0.8 and
later); a plan the runtime cannot express (DeepSpeed's ZeRO-2, its ZeRO variants, offload) is
refused with one line before anything is written.
"""
from __future__ import annotations

from typing import Any

from planner.errors import SpecError
from planner.export.common import Export, RunFiles, arg_lines, clip, optimizer_params, readme
from planner.export.megatron import model_args

SOURCE = "NVIDIA/Megatron-LM megatron/training/arguments.py (Megatron-Core >= 0.8)"
PLACEHOLDERS = {"DATA_PATH": "a Megatron indexed dataset prefix (PREFIX.bin/.idx, e.g. from planner prepare-data)",
                "TOKENIZER": "a Hugging Face tokenizer directory (--tokenizer-type HuggingFaceTokenizer)",
                "MEGATRON_LM": "your Megatron-LM checkout (holds pretrain_gpt.py)"}
ZERO = {0: [], 1: ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
        3: ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
            "--overlap-grad-reduce", "--overlap-param-gather"]}
"""The plan's ZeRO stage as Megatron-Core runs it: DDP, the distributed optimizer, Megatron-FSDP."""


def refuse(run: RunFiles) -> None:
    p = run.plan
    if p.runtime == "fsdp":
        raise SpecError("--to", "megatron-lm does not run PyTorch FSDP plans (plan.runtime fsdp)",
                        "search with --runtime megatron-core, or run the plan with your FSDP trainer")
    if p.zero not in ZERO:
        raise SpecError("--to", f"megatron-lm has no ZeRO-{p.zero} (DDP 0, distributed optimizer 1, Megatron-FSDP 3)",
                        "search with --runtime megatron-core")
    if p.variants:
        raise SpecError("--to", f"megatron-lm has none of DeepSpeed's ZeRO variants ({', '.join(p.variants)})",
                        "search with --runtime megatron-core")


def arguments(run: RunFiles) -> tuple[list[str], list[str]]:
    refuse(run)
    p, m = run.plan, run.model
    warnings: list[str] = []
    args = ["--tensor-model-parallel-size", str(p.tp), "--pipeline-model-parallel-size", str(p.pp)]
    if p.sequence_parallel:
        args += ["--sequence-parallel", "--tp-comm-overlap"]
    if p.schedule == "interleaved":
        args += ["--num-layers-per-virtual-pipeline-stage", str(m.layers // (p.pp * p.interleave))]
    split = tuple(p.layers_per_stage(m.layers))
    if p.pp > 1 and len(set(split)) > 1:
        inner = set(split[1:-1]) or {split[0]}
        if len(inner) == 1 and p.schedule != "interleaved":
            args += ["--decoder-first-pipeline-num-layers", str(split[0]),
                     "--decoder-last-pipeline-num-layers", str(split[-1])]
        else:
            warnings.append(f"the plan's stage split {list(split)} is not expressed (Megatron-LM sets only the first "
                            "and last stage's layers, without interleaving): it runs balanced stages")
    args += ["--micro-batch-size", str(p.micro_batch), "--global-batch-size", str(p.global_batch)]
    margs, missing = model_args(run, core=True)
    args += margs
    args += ZERO[p.zero]
    if p.recompute == "full":
        ks = p.checkpointed_per_stage(m.layers)
        args += ["--recompute-granularity", "full", "--recompute-method", "block",
                 "--recompute-num-layers", str(max(ks) // max(p.interleave, 1) if p.interleave > 1 else max(ks))]
        if len(set(ks)) > 1:
            warnings.append(f"checkpointed blocks per stage {list(ks)}: --recompute-num-layers is one number for "
                            f"every stage, set to the largest")
    elif p.recompute == "selective":
        args += ["--recompute-granularity", "selective"]
    args += ["--transformer-impl", "transformer_engine", "--attention-backend", "flash"]
    if p.precision == "fp8":
        args += ["--bf16", "--fp8-format", "hybrid"]
    elif p.precision in ("bf16", "fp16"):
        args.append(f"--{p.precision}")
    opt = optimizer_params(run)
    args += ["--optimizer", "adam", "--lr", repr(float(opt["lr"])), "--adam-beta1", repr(float(opt["betas"][0])),
             "--adam-beta2", repr(float(opt["betas"][1])), "--adam-eps", repr(float(opt["eps"])),
             "--weight-decay", repr(float(opt["weight_decay"])), "--clip-grad", repr(clip(run)),
             "--data-path", "${DATA_PATH}", "--split", "949,50,1",
             "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "${TOKENIZER}"]
    if missing:
        warnings.append("model features pretrain_gpt.py has no flag for (your model code must provide them): "
                        + "; ".join(missing))
    return args, warnings


def _script(run: RunFiles, args: list[str], warnings: list[str]) -> str:
    p, c = run.plan, run.cluster
    lines = ["#!/usr/bin/env bash",
             f"# Megatron-LM pretrain_gpt.py for {run.model.name}: {p.describe()}",
             f"# {c.world_size} processes ({c.nodes} node(s) x {c.gpus_per_node}); flags as in {SOURCE}",
             "# run on every node with NODE_RANK and MASTER_ADDR set (torchrun's rendezvous)",
             *[f"# set {k}: {v}" for k, v in PLACEHOLDERS.items()],
             *[f"# NOTE: {w}" for w in warnings],
             "set -euo pipefail", 'cd "$(dirname "$0")"',
             *[f': "${{{k}:?set {k} to {v}}}"' for k, v in PLACEHOLDERS.items()],
             "export CUDA_DEVICE_MAX_CONNECTIONS=1  # Megatron-Core's TP/SP overlap needs one",
             "ARGS=(", *arg_lines(args)]
    lines += [")", f"torchrun --nproc-per-node {c.gpus_per_node} --nnodes {c.nodes} "
              '--node-rank "${NODE_RANK:-0}" --master-addr "${MASTER_ADDR:-localhost}" --master-port 29500 '
              '"${MEGATRON_LM}/pretrain_gpt.py" "${ARGS[@]}" "$@"']
    return "\n".join(lines) + "\n"


def megatron_lm(run: RunFiles) -> Export:
    args, warnings = arguments(run)
    files: dict[str, Any] = {"pretrain_gpt.sh": _script(run, args, warnings), "pretrain_gpt_args.json": args}
    files["README.md"] = readme("Megatron-LM", run, [
        "Files:",
        "- `pretrain_gpt.sh`: torchrun running Megatron-LM's pretrain_gpt.py with the plan's arguments.",
        "- `pretrain_gpt_args.json`: the same arguments as a JSON list.", "",
        f"Flag names: {SOURCE}.", "",
        "    DATA_PATH=/data/corpus_text_document TOKENIZER=/models/tok MEGATRON_LM=~/Megatron-LM "
        "./pretrain_gpt.sh --train-iters 1000"], warnings)
    return Export(files=files, warnings=tuple(warnings), run="./pretrain_gpt.sh")
