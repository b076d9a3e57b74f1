"""`planner export RUN_DIR --to TARGET [--out DIR]`: parse -> planner.export.export -> print what was written."""
from __future__ import annotations

from pathlib import Path

import click

TARGET_NAMES = ["hf-trainer", "accelerate", "megatron-deepspeed", "torchrun", "megatron-lm"]


@click.command()
@click.argument("run_dir", metavar="RUN_DIR", type=click.Path(path_type=Path))
@click.option("--to", "target", required=True, type=click.Choice(TARGET_NAMES),
              help="hf-trainer (TrainingArguments + ds_config.json, ZeRO-only plans), accelerate (config YAML, "
                   "ZeRO-only plans), megatron-deepspeed (pretrain_gpt.py arguments, any plan), torchrun "
                   "(the planner's own worker), megatron-lm (Megatron-LM arguments: --runtime megatron-core plans).")
@click.option("--out", "out", default=None, type=click.Path(path_type=Path),
              help="Directory to write (default: RUN_DIR/export/<target>/).")
def export(run_dir: Path, target: str, out: Path | None) -> None:
    """Write the plan in RUN_DIR in the form another training tool reads."""
    from planner.export import export as run_export
    dest, result = run_export(run_dir, target, out)
    click.echo(f"wrote {dest}/: {', '.join(result.files)}")
    for w in result.warnings:
        click.echo(f"note: {w}")
    if result.run:
        click.echo(f"start: {result.run} (from {dest})")
