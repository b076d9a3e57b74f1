"""`planner report RUN_DIR`: rebuild RUN_DIR/report.html from the files in the run directory."""
from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.argument("run_dir", metavar="RUN_DIR", type=click.Path(path_type=Path))
@click.option("--price-per-gpu-hour", type=float, default=None, metavar="USD",
              help="Price of one GPU for one hour; the page adds the cost to train (default: the search's price, "
                   "estimate.json bill).")
@click.option("--train-tokens", type=float, default=None, metavar="N",
              help="Tokens to train on, e.g. 4e11 (default: the search's --tokens, estimate.json bill; for an "
                   "older run directory 20 per parameter, Hoffmann et al. 2022).")
def report(run_dir: Path, price_per_gpu_hour: float | None, train_tokens: float | None) -> None:
    """Write RUN_DIR/report.html: one self-contained page that explains the plan."""
    from planner.report import write_report
    out = write_report(run_dir, price_per_gpu_hour=price_per_gpu_hour, train_tokens=train_tokens)
    click.echo(f"wrote {out}")
