"""`planner ladder RUN_DIR`: where the gain comes from, technique by technique (planner.ladder)."""
from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.argument("run_dir", metavar="RUN_DIR", type=click.Path(path_type=Path))
@click.option("--order", default=None, metavar="T1,T2,...",
              help="Another order of the techniques precision, overlap, batching, zero, recompute, layout "
                   "[default: the article's, in that order]; the ones left out follow in the article's order.")
@click.option("--each-alone", is_flag=True, help="Also show every technique applied alone to the baseline.")
@click.option("--measure", is_flag=True,
              help="Run every rung that fits this machine with the executor (same document stream, like "
                   "`planner verify`); the others say why they cannot run.")
@click.option("--steps", type=int, default=6, show_default=True,
              help="--measure: steps of a padded rung (a packed rung runs until it has the baseline's real tokens).")
@click.option("--warmup", type=int, default=2, show_default=True, help="--measure: steps left out of the timing.")
@click.option("--timeout", type=float, default=600.0, show_default=True, help="--measure: seconds before a run counts as hung.")
@click.option("--seed", type=int, default=1234, show_default=True, help="Seeds the synthetic corpus (and the runs).")
@click.option("--data", default="", metavar="PATH", help="A corpus instead of the synthetic one (as `planner run --data`).")
@click.option("--tokenizer", default="", metavar="DIR", help="A tokenizer directory for a text corpus (as `planner run`).")
@click.option("--json", "as_json", is_flag=True, help="Print ladder.json instead of the table.")
def ladder(run_dir: Path, order: str | None, each_alone: bool, measure: bool, steps: int, warmup: int,
           timeout: float, seed: int, data: str, tokenizer: str, as_json: bool) -> None:
    """The ladder from the conventional baseline to the plan in RUN_DIR, one technique a rung:
    predicted tokens/s, step-time and memory breakdowns, padding, each rung's gain, the
    article's figure beside ours; writes RUN_DIR/ladder.json and two waterfall PNGs."""
    import json

    from planner.errors import SpecError
    from planner.ladder import build, parse_order, plots
    from planner.ladder.text import lines
    from planner.rundir import atomic_write_json, load_run
    techniques = parse_order(order)             # bad --order: one line before anything is read
    if steps < 1 or warmup < 0 or warmup >= steps:
        raise SpecError("--steps/--warmup", f"need steps >= 1 and 0 <= warmup < steps, got {steps}/{warmup}",
                        "e.g. --steps 6 --warmup 2")
    plan, model, cluster, train, doc = load_run(run_dir)
    result = build(model, cluster, train, plan, order=techniques, each_alone=each_alone, seed=seed, data=data,
                   tokenizer=tokenizer)
    if measure:
        from planner.ladder.measure import measure as do_measure
        do_measure(run_dir, result, model, cluster, train, doc, steps=steps, warmup=warmup, timeout=timeout,
                   seed=seed, data=data, tokenizer=tokenizer, echo=click.echo)
    out = run_dir if run_dir.is_dir() else run_dir.parent
    atomic_write_json(out / "ladder.json", result)
    pngs = plots.write(out, result)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    for ln in lines(result):
        click.echo(ln)
    click.echo(f"wrote {out / 'ladder.json'}, {', '.join(p.name for p in pngs)}")
