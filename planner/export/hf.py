"""Hugging Face exports for ZeRO-only plans (tp = pp = 1): TrainingArguments for the Trainer,
and an accelerate config. Both hand DeepSpeed the plan's ds_config.json with every number as
the plan has it (no "auto"), so the Trainer's consistency check
(transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig.trainer_config_process) finds
nothing to disagree with.
"""
from __future__ import annotations

from typing import Any

from planner.errors import SpecError
from planner.export.common import (Export, RunFiles, clip, optimizer_params, plain_ds_config, readme, refuse_3d,
                                   refuse_runtime, schedule)

OUTPUT_DIR = "output"
"""TrainingArguments.output_dir, relative to the directory the Trainer is started from."""


def _gradient_checkpointing(run: RunFiles, target: str) -> tuple[bool, list[str]]:
    """HF models checkpoint every block (model.gradient_checkpointing_enable) or none."""
    p, layers = run.plan, run.model.layers
    if p.recompute == "none":
        return False, []
    if p.recompute == "full":
        ck = sum(p.checkpointed_per_stage(layers))
        if ck != layers:
            raise SpecError("--to", f"{target} checkpoints every block or none (activation_checkpointing); the plan "
                            f"checkpoints {ck} of {layers}",
                            "write a plan with --recompute full on every block (planner estimate ... --recompute "
                            "full --write DIR), or use --to torchrun")
        return True, []
    # selective: recompute the attention core. SDPA/flash attention (transformers' default
    # attn_implementation "sdpa") keeps no s x s scores and recomputes them in its backward.
    if run.train.attention != "flash":
        raise SpecError("--to", f"{target} has no selective recompute of the attention core "
                        "(the plan uses eager attention with selective recompute)",
                        "search with --attention flash, or use --to megatron-deepspeed / torchrun")
    return False, ["selective recompute (the attention core) is what SDPA/flash attention does in its "
                   "backward: load the model with attn_implementation=\"sdpa\" (transformers' default); "
                   "activation_checkpointing stays off"]


def training_arguments(run: RunFiles, target: str = "hf-trainer") -> tuple[dict[str, Any], list[str]]:
    """TrainingArguments keyword arguments for the plan, and what differs from it."""
    refuse_runtime(run, target)
    refuse_3d(run, target)
    p = run.plan
    ckpt, warnings = _gradient_checkpointing(run, target)
    opt = optimizer_params(run)
    kw: dict[str, Any] = {
        "output_dir": OUTPUT_DIR,
        "per_device_train_batch_size": p.micro_batch,
        "gradient_accumulation_steps": p.grad_accum,
        "bf16": p.precision == "bf16",
        "fp16": p.precision == "fp16",
        "activation_checkpointing": ckpt,          # transformers 5: gradient_checkpointing is its deprecated alias
        "deepspeed": "ds_config.json",
        "learning_rate": float(opt["lr"]),
        "adam_beta1": float(opt["betas"][0]),
        "adam_beta2": float(opt["betas"][1]),
        "adam_epsilon": float(opt["eps"]),
        "weight_decay": float(opt["weight_decay"]),
        "max_grad_norm": clip(run),
        "optim": "adamw_torch",
    }
    if run.cluster.device.kind == "cpu":
        kw["use_cpu"] = True
    sched = schedule(run)
    if sched.get("kind") == "cosine":
        kw.update(lr_scheduler_type="cosine", warmup_steps=sched["warmup_steps"], max_steps=sched["total_steps"])
        warnings.append(f"the learning rate follows ds_config.json's WarmupCosineLR (DeepSpeed's scheduler, which "
                        f"the Trainer uses when the config has one): floor {sched['min_ratio']:g} x the peak, "
                        "where transformers' own \"cosine\" would decay to 0")
    elif sched.get("kind") == "constant":
        kw.update(lr_scheduler_type="constant_with_warmup" if sched["warmup_steps"] else "constant",
                  warmup_steps=sched["warmup_steps"])
    else:
        kw["lr_scheduler_type"] = "constant"
    return kw, warnings


def _flag(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def args_file(kw: dict[str, Any]) -> str:
    """One `--name value` per line: HfArgumentParser.parse_args_into_dataclasses(args_filename=...)
    (or `python train.py $(cat train.args)`) reads it."""
    return "".join(f"--{k} {_flag(v)}\n" for k, v in kw.items())


def hf_trainer(run: RunFiles) -> Export:
    kw, warnings = training_arguments(run)
    files: dict[str, Any] = {"ds_config.json": plain_ds_config(run), "training_args.json": kw,
                             "train.args": args_file(kw)}
    world, nodes = run.cluster.world_size, run.cluster.nodes
    if nodes > 1:                              # the command below names it
        from planner import dsconfig
        files["hostfile"] = dsconfig.hostfile(run.cluster)
    launch = (f"deepspeed {'--hostfile hostfile --num_nodes %d ' % nodes if nodes > 1 else ''}"
              f"--num_gpus {run.cluster.gpus_per_node} your_train.py $(cat train.args)")
    files["README.md"] = readme("Hugging Face Trainer", run, [
        "Files:",
        "- `training_args.json`: TrainingArguments keyword arguments "
        "(`HfArgumentParser(TrainingArguments).parse_json_file(\"training_args.json\")`).",
        "- `train.args`: the same as command-line flags (`HfArgumentParser(...).parse_args_into_dataclasses()`).",
        "- `ds_config.json`: the plan's DeepSpeed config, every value explicit (no \"auto\"): batch sizes, "
        "precision, ZeRO stage and options, clipping, optimizer.",
        *(["- `hostfile`: one line per node for the deepspeed launcher (replace node-<i> with your hosts)."]
          if nodes > 1 else []),
        "",
        f"Start from this directory (the paths are relative) with {world} processes, e.g.:",
        "", f"    {launch}", "",
        "`ds_config.json`'s train_batch_size is the plan's global batch "
        f"({run.plan.global_batch} = {run.plan.micro_batch} x {run.plan.grad_accum} x {world}): "
        f"the Trainer checks it against its own product, so run exactly {world} processes.",
    ], warnings)
    return Export(files=files, warnings=tuple(warnings), run=launch)


def accelerate_config(run: RunFiles) -> dict[str, Any]:
    """accelerate's ClusterConfig for the plan, as the dict `accelerate config` would save."""
    from accelerate.commands.config.config_args import ClusterConfig
    refuse_runtime(run, "accelerate")
    refuse_3d(run, "accelerate")
    c, p = run.cluster, run.plan
    ds: dict[str, Any] = {"deepspeed_config_file": "ds_config.json", "zero3_init_flag": p.zero == 3}
    if c.nodes > 1:
        ds.update(deepspeed_multinode_launcher="standard", deepspeed_hostfile="hostfile")
    cfg = ClusterConfig(
        compute_environment="LOCAL_MACHINE", distributed_type="DEEPSPEED",
        mixed_precision={"bf16": "bf16", "fp16": "fp16"}.get(p.precision, "no"),
        use_cpu=c.device.kind == "cpu", debug=False, num_processes=c.world_size, machine_rank=0,
        num_machines=c.nodes, main_process_ip="127.0.0.1" if c.nodes == 1 else "node-0", main_process_port=29500,
        rdzv_backend="static", same_network=True, main_training_function="main", deepspeed_config=ds,
        downcast_bf16="no")
    out = cfg.to_dict()
    return {k: v for k, v in out.items() if v not in (None, {}) or k == "deepspeed_config"}


def accelerate(run: RunFiles) -> Export:
    import yaml
    doc = accelerate_config(run)
    _, warnings = _gradient_checkpointing(run, "accelerate")
    files: dict[str, Any] = {"ds_config.json": plain_ds_config(run),
                             "accelerate_config.yaml": yaml.safe_dump(doc, sort_keys=False)}
    launch = "accelerate launch --config_file accelerate_config.yaml your_train.py"
    lines = ["Files:",
             "- `accelerate_config.yaml`: `accelerate launch --config_file accelerate_config.yaml` "
             f"starts {run.cluster.world_size} processes on {run.cluster.nodes} machine(s) under DeepSpeed.",
             "- `ds_config.json`: the plan's DeepSpeed config (batch sizes, precision, ZeRO, clipping, optimizer); "
             "with `deepspeed_config_file`, accelerate takes these from the file.", "",
             f"Start from this directory: `{launch}`."]
    if run.plan.recompute != "none" and not warnings:
        lines.append("The plan recomputes every block: call `model.gradient_checkpointing_enable()` in your script.")
    if run.cluster.nodes > 1:
        lines.append("On several machines: run it on each with `--machine_rank i`, set `main_process_ip` "
                     "to machine 0's address, and list your hosts in `hostfile`.")
        from planner import dsconfig
        files["hostfile"] = dsconfig.hostfile(run.cluster)
    files["README.md"] = readme("accelerate", run, lines, warnings)
    return Export(files=files, warnings=tuple(warnings), run=launch)
