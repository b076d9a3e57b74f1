"""`planner prepare-data`: tokenize text once into a Megatron indexed dataset (PREFIX.bin/.idx)."""
from __future__ import annotations

from pathlib import Path

import click


@click.command("prepare-data")
@click.argument("inputs", nargs=-1, required=True, metavar="INPUT...")
@click.option("--out", "out", required=True, metavar="PREFIX",
              help="Write PREFIX.bin and PREFIX.idx (Megatron-LM's indexed dataset format).")
@click.option("--tokenizer", default="", metavar="DIR", help="A local Hugging Face tokenizer directory.")
@click.option("--train-tokenizer", "train_vocab", type=int, default=None, metavar="N",
              help="Train a byte-level BPE of at most N tokens on the inputs first and save it as "
                   "PREFIX-tokenizer/ (a Hugging Face tokenizer directory); N must not exceed the model's vocab.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show a progress bar.")
def prepare_data(inputs: tuple[str, ...], out: str, tokenizer: str, train_vocab: int | None, progress: bool) -> None:
    """Tokenize INPUT files (.txt: one document per blank-line-separated paragraph; .jsonl: one
    {"text": ...} object per line) with a tokenizer's eos after each document, and write them as
    one Megatron indexed dataset for `planner run --data PREFIX --tokenizer DIR`."""
    from planner.data.prepare import prepare
    from planner.errors import SpecError
    if bool(tokenizer) == (train_vocab is not None):
        raise SpecError("--tokenizer", "give exactly one of --tokenizer DIR and --train-tokenizer N",
                        "--tokenizer for an existing tokenizer, --train-tokenizer N to make one")
    r = prepare([Path(i) for i in inputs], Path(out), tokenizer=tokenizer, train_vocab=train_vocab,
                progress=progress)
    if r["trained_tokenizer"]:
        click.echo(f"tokenizer     {r['tokenizer']} ({r['vocab']} tokens, trained on the inputs)")
    click.echo(f"documents     {r['documents']:,} ({r['tokens']:,} tokens, dtype {r['dtype']}, "
               f"{r['seconds']:.1f} s)")
    click.echo(f"wrote {r['bin']} and {r['idx']}")
    click.echo(f"use           planner run RUN_DIR --data {r['bin']} --tokenizer {r['tokenizer']}")
