"""Where the report and the CLI contradicted themselves (issue 25): the frontier's legend counted
trials.csv rows while its caption counts distinct plans; tied plans got identical chart labels;
top rows that differ only in a hidden ZeRO option looked identical; after a real-text run the
Measured section showed no held-out loss or learning rate and an older synthetic verify as if it
were this run's."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pandas as pd
import pytest
from matplotlib.figure import Figure
from rich.console import Console

from planner.report import build, plots
from planner.report.plan_text import distinct_labels, option_labels
from planner.report.sample import write_sample_run
from planner.specs import Plan


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> Path:
    return write_sample_run(tmp_path_factory.mktemp("lab") / "run", study_trials=30)


def _legends(monkeypatch) -> dict[str, list[list[str]]]:
    """Legend texts of every figure drawn, by the drawing function's name."""
    seen: dict[str, list[list[str]]] = {}
    real = plots.render

    def spy(draw, size):
        fig = Figure(figsize=size)
        draw(fig)
        seen.setdefault(draw.__qualname__.split(".")[0], []).append(
            [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()])
        return real(draw, size)
    monkeypatch.setattr(plots, "render", spy)
    return seen


def test_frontier_legend_counts_what_the_caption_counts(sample: Path, tmp_path: Path, monkeypatch) -> None:
    d = tmp_path / "dup"
    shutil.copytree(sample, d)
    trials = pd.read_csv(d / "trials.csv")
    plans = trials[trials["source"] != "baseline"]
    # Optuna proposing plans again: trials.csv lists them again (more rows, the same plans)
    pd.concat([trials, plans.head(7).assign(trial=lambda f: f["trial"] + 10_000)]).to_csv(d / "trials.csv", index=False)
    legends = _legends(monkeypatch)
    html = build.write_report(d).read_text()
    n, feasible = (int(x) for x in re.search(r"(\d+) distinct plans: (\d+) feasible", html).groups())
    (labels,) = legends["frontier"]
    counted = {lab.split(" (")[0]: int(re.search(r"\((\d+)\)", lab).group(1)) for lab in labels if "(" in lab}
    assert counted["feasible"] == feasible
    reasons = sum(v for k, v in counted.items() if k not in ("feasible", "Pareto front"))
    assert counted["feasible"] + reasons == n


def test_tied_plans_get_labels_that_tell_them_apart() -> None:
    a = Plan(dp=2, pp=2, micro_batch=1, grad_accum=4, stage_layers=(2, 2))
    b = Plan(dp=2, pp=2, micro_batch=1, grad_accum=4, stage_layers=(3, 1))
    labels = distinct_labels(["#1 TP1·PP2·DP2", "#1 TP1·PP2·DP2", "#3 other"], [a, b, a])
    assert labels == ["#1 TP1·PP2·DP2 (stage_layers=2,2)", "#1 TP1·PP2·DP2 (stage_layers=3,1)", "#3 other"]
    assert distinct_labels(["x", "x"], [a, a]) == ["x", "x"]           # the same plan: nothing to add


def test_the_reports_time_and_memory_labels_are_distinct(sample: Path, tmp_path: Path, monkeypatch) -> None:
    """Two plans tied on tokens/s that differ only in the ZeRO-3 live-parameter limit: the
    time chart's labels named only TP·PP·DP (twice "#1 TP1·PP1·DP2")."""
    captured: dict[str, list[str]] = {}
    monkeypatch.setattr(plots, "time_breakdown", lambda rows: captured.setdefault("time", [r["label"] for r in rows])
                        and "data:image/png;base64,")
    monkeypatch.setattr(plots, "memory_stacks", lambda groups, cap: captured.setdefault(
        "memory", [g["label"] for g in groups]) and "data:image/png;base64,")
    d = tmp_path / "tie"
    shutil.copytree(sample, d)
    trials = pd.read_csv(d / "trials.csv")
    ok = trials[(trials["source"] != "baseline") & trials["feasible"]].sort_values("tokens_per_s", ascending=False)
    second = ok.iloc[1:2].copy()
    twin = second.copy()
    twin["trial"] += 10_000
    twin["live_elements"] = 10 ** 9
    twin["overlap_comm"] = False
    pd.concat([trials, twin]).to_csv(d / "trials.csv", index=False)
    build.write_report(d)
    for key in ("time", "memory"):
        labels = captured[key]
        assert len(labels) == len(set(labels)), labels
    assert any("live=1e9" in lab for lab in captured["time"]), captured["time"]


def test_cli_rows_show_every_option_away_from_its_default() -> None:
    from planner.cli.search import _plan_cells
    base = Plan(dp=2, zero=3, micro_batch=1, grad_accum=4)
    live = Plan(dp=2, zero=3, micro_batch=1, grad_accum=4, live_elements=10 ** 9)
    off = Plan(dp=2, zero=3, micro_batch=1, grad_accum=4, overlap_comm=False)
    cells = [tuple(_plan_cells(p)) for p in (base, live, off)]
    assert len(set(cells)) == 3
    assert option_labels(live) == ("live=1e9",) and option_labels(off) == ("overlap=off",)
    assert option_labels(base) == ()
    Console(record=True).print(" ".join(cells[1]))       # prints as one plain row


def test_measured_section_after_a_real_text_run(tmp_path: Path, monkeypatch) -> None:
    d = write_sample_run(tmp_path / "m", study_trials=0, metrics=True, verify=True)
    m = json.loads((d / "metrics.json").read_text())
    m.update(eval_loss=[{"step": 2, "loss": 6.5}, {"step": 4, "loss": 6.1234}], lr=[1e-4, 3e-4, 2e-4, 3e-5],
             lr_schedule={"schedule": "cosine", "lr": 3e-4, "warmup_steps": 1},
             data={"corpus": "/data/text.txt", "tokenizer": "/data/tok", "seed": 1234})
    (d / "metrics.json").write_text(json.dumps(m))
    v = json.loads((d / "verify.json").read_text())
    v["planned"]["data"] = {"corpus": "synthetic", "tokenizer": None, "seed": 1234}
    (d / "verify.json").write_text(json.dumps(v))
    legends = _legends(monkeypatch)
    html = build.write_report(d).read_text()
    assert "Held-out loss 6.5000 (step 2) &rarr; 6.1234 (step 4), 2 evaluations." in html
    assert "Learning rate cosine: 0.0001 &rarr; 3e-05 (peak 0.0003, warm-up 1 steps)." in html
    assert "Data: /data/text.txt (tokenizer /data/tok)." in html
    assert 'id="verify-other-data"' in html and "ran on synthetic, not on /data/text.txt" in html
    assert legends["loss_curve"][0][:3] == ["training loss", "held-out loss", "learning rate"]
    v["planned"]["data"] = {"corpus": "/data/text.txt", "tokenizer": "/data/tok", "seed": 7}
    (d / "verify.json").write_text(json.dumps(v))
    assert 'id="verify-other-data"' not in build.write_report(d).read_text()      # the same corpus


def test_small_models_memory_bars_show_the_states_not_only_the_allowance(monkeypatch) -> None:
    """tiny chatglm3 on CPU: ~1 GB runtime allowance over a few MB of states; stacked, every
    bar was all allowance. The allowance is stated instead, the states fill the scale."""
    drawn: dict[str, list] = {}
    real = plots.render

    def spy(draw, size):
        fig = Figure(figsize=size)
        draw(fig)
        ax = fig.axes[0]
        drawn["heights"] = [round(p.get_height(), 6) for p in ax.patches]
        drawn["texts"] = [t.get_text() for t in ax.texts]
        drawn["legend"] = [t.get_text() for t in ax.get_legend().get_texts()]
        return real(draw, size)
    monkeypatch.setattr(plots, "render", spy)
    stage = {"params": 0.004, "grads": 0.004, "optimizer": 0.016, "activations": 0.01, "overhead": 1.0}
    plots.memory_stacks([{"label": "chosen", "stages": [stage, dict(stage, activations=0.02)]}], 20.0)
    assert max(drawn["heights"]) == pytest.approx(0.02) and 1.0 not in drawn["heights"]
    assert any("runtime allowance 1 GB per GPU, not drawn" in t for t in drawn["texts"])
    assert "runtime allowance" not in drawn["legend"] and "optimizer states" in drawn["legend"]
    big = dict(stage, params=2.0, optimizer=8.0)          # the allowance is a small share: drawn as before
    plots.memory_stacks([{"label": "chosen", "stages": [big]}], 20.0)
    assert 1.0 in drawn["heights"] and "runtime allowance" in drawn["legend"]
