"""`planner export RUN_DIR --to TARGET`: a run directory's plan in the form another tool reads.

    hf-trainer          Hugging Face TrainingArguments (args file + JSON) and ds_config.json (ZeRO-only plans)
    accelerate          an accelerate config YAML and ds_config.json (ZeRO-only plans)
    megatron-deepspeed  Megatron-DeepSpeed pretrain_gpt.py arguments as a launch script (any TP/PP/ZeRO plan)
    torchrun            a torchrun launch of the planner's own worker (any plan DeepSpeed runs)
    megatron-lm         Megatron-LM (Megatron-Core) pretrain_gpt.py arguments: plans on --runtime megatron-core

Each target builds every file in memory first; a plan the target cannot express raises
SpecError (one line, exit 2) before anything is written, and each file is then written
through a temporary file and a rename (planner.rundir).
"""
from __future__ import annotations

from pathlib import Path

from planner.errors import SpecError
from planner.export.common import Export, RunFiles, load_files
from planner.rundir import atomic_write_json, atomic_write_text, check_writable

TARGETS = ("hf-trainer", "accelerate", "megatron-deepspeed", "torchrun", "megatron-lm")


def build(run: RunFiles, target: str) -> Export:
    """The files of one target (nothing written)."""
    if target == "hf-trainer":
        from planner.export.hf import hf_trainer
        return hf_trainer(run)
    if target == "accelerate":
        from planner.export.hf import accelerate
        return accelerate(run)
    if target == "megatron-deepspeed":
        from planner.export.megatron import megatron_deepspeed
        return megatron_deepspeed(run)
    if target == "megatron-lm":
        from planner.export.megatron_lm import megatron_lm
        return megatron_lm(run)
    if target == "torchrun":
        from planner.export.torchrun import torchrun
        return torchrun(run)
    raise SpecError("--to", f"unknown export target {target!r}", f"use one of {', '.join(TARGETS)}")


def export(run_dir: str | Path, target: str, out: str | Path | None = None) -> tuple[Path, Export]:
    """Write `target`'s files for the plan in run_dir into `out` (default RUN_DIR/export/<target>/).
    Returns (the output directory, what was written)."""
    run = load_files(run_dir)
    result = build(run, target)
    dest = Path(out) if out is not None else run.run_dir / "export" / target
    if dest.exists() and not dest.is_dir():
        raise SpecError("--out", f"{dest} is not a directory", "give a directory path (it is created)")
    check_writable(dest, "--out")
    for name, content in result.files.items():
        if isinstance(content, str):
            atomic_write_text(dest / name, content, 0o755 if name.endswith(".sh") else None)
        else:
            atomic_write_json(dest / name, content)
    return dest, result


__all__ = ["TARGETS", "Export", "build", "export"]
