"""`planner run` and `planner verify`: thin wrappers over planner.runtime.train (launch, verify)."""
from __future__ import annotations

from pathlib import Path

import click

from planner.cli.common import SCALE_CHOICES
from planner.data.batching import BATCHING
from planner.dsconfig import LR_SCHEDULES


def _check_scale(run_dir: str, size: str | None) -> None:
    """--scale on run/verify names the size the plan must have been made at: the executor never
    re-plans, so a mismatch is one line asking for a new search, not a silent shrink."""
    if size is None:
        return
    from planner.errors import SpecError
    from planner.rundir import load_run
    *_, doc = load_run(run_dir)
    planned = doc["inputs"].get("scale") or "full"
    if planned != size:
        raise SpecError("--scale", f"{run_dir} was planned at scale {planned}, not {size}",
                        f"re-plan with `planner search ... --scale {size}` and run that directory")


def _scale_option(f):
    return click.option("--scale", type=click.Choice(SCALE_CHOICES), default=None,
                        help="Assert the model size the plan was made for (plan.json records the exact spec).")(f)


def _fmt(x, unit: str = "", nd: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{nd}g}{unit}"


def _err(e) -> str:
    return "n/a" if e is None else f"{e:+.0%}"


@click.command()
@click.argument("run_dir", type=click.Path(file_okay=True, dir_okay=True))
@click.option("--steps", type=int, default=10, show_default=True, help="Optimizer steps to run.")
@click.option("--warmup", type=int, default=2, show_default=True, help="Steps left out of the timing.")
@click.option("--resume", is_flag=True, help="Continue from the latest checkpoint in RUN_DIR/checkpoints "
              "(refused when there is none).")
@click.option("--resume-if-present", is_flag=True,
              help="Continue from the latest checkpoint if there is one, else start at step 1 and say so.")
@click.option("--timeout", type=float, default=600.0, show_default=True, help="Seconds before a run counts as hung.")
@click.option("--batching", type=click.Choice(sorted(BATCHING)), default="dynamic", show_default=True,
              help="Packed token-budget batches, or one padded sequence per row.")
@click.option("--checkpoint-every", type=int, default=0, show_default=True,
              help="Save a DeepSpeed checkpoint every K steps (0: never); needed for NaN rollback.")
@click.option("--data", default="", metavar="CORPUS",
              help="A corpus instead of the synthetic one: token ids (.npy, .txt) or, with --tokenizer, text.")
@click.option("--seed", type=int, default=1234, show_default=True, help="Seeds the model and the synthetic corpus.")
@click.option("--data-workers", type=int, default=None,
              help="DataLoader worker processes per rank [default: plan.json's loader settings, else 1].")
@click.option("--tokenizer", default="", metavar="DIR",
              help="A local Hugging Face tokenizer directory: --data is then raw text (.txt / .jsonl).")
@click.option("--eval-every", type=int, default=0, show_default=True,
              help="Held-out loss every K steps (0: never); metrics.json eval_loss.")
@click.option("--eval-batches", type=int, default=2, show_default=True, help="Global batches per evaluation.")
@click.option("--lr", type=float, default=None, help="Peak learning rate [default: 3e-4, planner.dsconfig.OPTIMIZER].")
@click.option("--lr-warmup-steps", type=int, default=0, show_default=True,
              help="Linear warmup steps (DeepSpeed warms up over at least 2).")
@click.option("--lr-schedule", type=click.Choice(LR_SCHEDULES), default=None,
              help="Warmup then cosine decay to 10% (DeepSpeed WarmupCosineLR) or warmup then constant "
                   "(WarmupLR) over --steps [default: a scheduler block in ds_config.json, else constant].")
@click.option("--metrics-port", type=int, default=0, show_default=True,
              help="Serve Prometheus metrics from rank 0 on this port (0: off); writes "
                   "prometheus-alerts.yml and grafana-dashboard.json into RUN_DIR.")
@click.option("--metrics-host", default="127.0.0.1", show_default=True,
              help="Address of the metrics endpoint (0.0.0.0 to let a Prometheus on another host scrape it).")
@click.option("--init-hf", default="", metavar="DIR", help="Start from this Hugging Face checkpoint directory.")
@click.option("--save-hf", default="", metavar="DIR", help="Save the trained weights here in Hugging Face format.")
@click.option("--inject-nan", type=int, default=-1, hidden=True, help="Poison the batch of this step (testing).")
@click.option("--step-sleep", type=float, default=0.0, hidden=True, help="Pause after each step (testing).")
@click.option("--save-sleep", type=float, default=0.0, hidden=True, help="Pause after each checkpoint file (testing).")
@click.option("--ignore-host-checks", is_flag=True,
              help="Launch even if this host looks too small for the plan (no CUDA / too few GPUs / too "
                   "little memory / too many ranks per core). Bad plan.json or ds_config.json is still refused.")
@_scale_option
def run(run_dir: str, **kw) -> None:
    """Train the plan in RUN_DIR under DeepSpeed and write RUN_DIR/metrics.json."""
    from planner.runtime.train.launch import run_plan
    _check_scale(run_dir, kw.pop("scale"))
    if kw["resume_if_present"]:
        kw["resume"] = True
    m = run_plan(run_dir, echo=click.echo, **kw)
    p, e = m["predicted"], m["relative_error"]
    click.echo(f"step time     {_fmt(m['step_time_s'], ' s')}  (predicted {_fmt(p['step_time_s'], ' s')}, "
               f"error {_err(e['step_time_s'])})")
    click.echo(f"tokens/s      {_fmt(m['tokens_per_s'], '', 4)}  real tokens, {m['padding_fraction']:.0%} padding "
               f"(predicted {_fmt(p['tokens_per_s'], '', 4)}, error {_err(e['tokens_per_s'])})")
    click.echo(f"peak memory   {', '.join(f'{g:.3f}' for g in m['peak_memory_gb_per_rank'])} GB per rank "
               f"(predicted {_fmt(p['peak_memory_gb'], ' GB')}, error {_err(e['peak_memory_gb'])}; {m['memory_method']})")
    click.echo(f"model states  {', '.join(f'{g * 1e3:.1f}' for g in m['model_state_gb_per_rank'])} MB per rank")
    click.echo(f"loss          {m['loss'][0]:.4f} -> {m['loss'][-1]:.4f} over {len(m['loss'])} steps")
    if m.get("eval_loss"):
        ev = m["eval_loss"]
        click.echo(f"eval loss     {ev[0]['loss']:.4f} (step {ev[0]['step']}) -> {ev[-1]['loss']:.4f} (step {ev[-1]['step']})")
    if m.get("lr"):
        sch = m.get("lr_schedule") or {}
        click.echo(f"lr            {sch.get('schedule', '?')}: {m['lr'][0]:.3g} -> {m['lr'][-1]:.3g} "
                   f"(peak {sch.get('lr', 0):.3g}, warmup {sch.get('warmup_steps', 0)})")
    for ev in m["events"]:
        if ev["kind"] != "checkpoint":
            click.echo(f"event         step {ev['step']}: {ev['kind']}: {ev['message']}")
    click.echo(f"wrote {run_dir}/metrics.json")


@click.command()
@click.argument("run_dir", type=click.Path(file_okay=True, dir_okay=True))
@click.option("--steps", type=int, default=12, show_default=True, help="Baseline steps (the plan runs on as many real tokens).")
@click.option("--warmup", type=int, default=2, show_default=True, help="Steps left out of the timing.")
@click.option("--timeout", type=float, default=900.0, show_default=True, help="Seconds before a run counts as hung.")
@click.option("--seed", type=int, default=1234, show_default=True)
@click.option("--data", default="", metavar="PATH", help="A corpus instead of the synthetic one (as `planner run --data`).")
@click.option("--tokenizer", default="", metavar="DIR", help="A local Hugging Face tokenizer directory for a text corpus (.txt/.jsonl).")
@_scale_option
def verify(run_dir: str, **kw) -> None:
    """Run the conventional baseline and the plan; compare against the 3x / one-third-memory targets."""
    from planner.runtime.preflight.checks import check_run
    from planner.runtime.train.launch import check_counts
    from planner.runtime.train.verify import check_inputs, verify as do_verify
    from planner.rundir import check_writable
    check_counts(kw["steps"], kw["warmup"], kw["timeout"])
    check_inputs(Path(run_dir))  # a profile from another machine, or missing a precision's probe
    _check_scale(run_dir, kw.pop("scale"))
    check_run(run_dir)  # refuse before the baseline starts, not after it ran
    check_writable(run_dir, "RUN_DIR")
    do_verify(run_dir, echo=click.echo, **kw)
    click.echo(f"wrote {run_dir}/verify.json")
