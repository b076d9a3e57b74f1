"""The report: hand-computed numbers for its pieces, then whole pages from sample run directories."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from planner.cli import main
from planner.errors import SpecError
from planner.report import analysis, cluster, fmt, timeline
from planner.report.build import render, write_report
from planner.report.data import MIN_TRIALS_FOR_IMPORTANCE, load
from planner.report.sample import write_sample_run
from planner.specs import Plan, TrainSpec, parse_cluster, preset

FIGURES = ("frontier", "memory", "time", "gantt", "history", "importances", "cluster", "measured", "loss", "bill")


# --- pieces, with numbers worked out by hand ---------------------------------------------

def test_pareto_front_by_hand() -> None:
    mem = np.array([10, 20, 15, 30, 25, 20.0])
    tps = np.array([5, 8, 4, 8, 9, 7.0])
    # (15,4) loses to (10,5); (30,8) to (25,9); (20,7) to (20,8)
    assert analysis.pareto_mask(mem, tps).tolist() == [True, True, False, False, True, False]
    assert analysis.pareto_mask(np.array([]), np.array([])).tolist() == []


def test_reason_classes() -> None:
    # memory problems by their code (trials.csv reason_code), never by their wording
    assert analysis.reason_category("stage 0 needs 55.2 GB > 40.0 GB: activations 30.5 GB",
                                    "memory:activations") == "out of memory (activations)"
    assert analysis.reason_category("stage 3 needs 99.0 GB > 80.0 GB: optimizer states 60.1 GB",
                                    "memory:optimizer") == "out of memory (optimizer states)"
    assert analysis.reason_category("reworded: the activations do not fit", "memory:activations") == \
        "out of memory (activations)"
    assert analysis.reason_category("stage 0 needs 9 GB > 8 GB even with the best stage split", "memory") == \
        "out of memory"
    assert analysis.reason_category("tp 8 does not divide the 12 attention heads") == "tp # does not divide the # attention heads"
    assert analysis.reason_category("") == "infeasible (no reason given)"
    # whole words, no "..." (the legend read "MiCS was removed from DeepSpeed (#.# rejects zero_optimiz...")
    assert analysis.reason_category("MiCS was removed from DeepSpeed (0.19.8 rejects zero_optimization.mics_shard_size, "
                                    "runtime/zero/config.py)") == "MiCS was removed from DeepSpeed"
    long = "a reason that states at length why this plan cannot run on the runtime it was written for"
    assert analysis.reason_category(long) == long


def test_1f1b_balanced_schedule_matches_the_closed_form() -> None:
    p, m, f, b = 4, 8, 1.0, 2.0
    ops = timeline.simulate([f] * p, [b] * p, m)
    assert len(ops) == 2 * p * m
    end = max(o.end for o in ops)
    assert end == pytest.approx((m + p - 1) * (f + b))          # fill + m cycles
    idle = sum(end - sum(o.end - o.start for o in ops if o.stage == i) for i in range(p)) / (p * end)
    assert idle == pytest.approx((p - 1) / (m + p - 1))         # = bubble (p-1)/m of the ideal m (f+b)
    for i in range(p):
        order = timeline.stage_order(p, m, i)
        assert sum(1 for k, _, ph in order if ph == "warm-up") == p - 1 - i
        assert [j for k, j, _ in order if k == "B"] == list(range(m))
    # dependencies hold: forward j on stage i after stage i-1; backward after the next stage's
    t = {(o.kind, o.stage, o.micro): o for o in ops}
    for i in range(1, p):
        for j in range(m):
            assert t[("F", i, j)].start >= t[("F", i - 1, j)].end
            assert t[("B", i - 1, j)].start >= t[("B", i, j)].end


def test_stage_times_fall_back_to_block_shares_and_prefer_written_ones() -> None:
    est = {"time_breakdown_s": {"forward": 9.0, "backward": 16.0, "recompute": 2.0}}
    f, b, how = timeline.stage_times(est, (9, 9, 6), m=3)
    assert f == pytest.approx([3.0, 3.0, 2.0]) and b == pytest.approx([6.0, 6.0, 4.0]) and "scaled" in how
    est["stage_time_s"] = [{"forward": 1.0, "backward": 2.0}] * 3
    f, b, how = timeline.stage_times(est, (9, 9, 6), m=3)
    assert f == [1.0] * 3 and b == [2.0] * 3 and "estimate.json" in how


def test_long_schedules_are_cut_in_the_middle() -> None:
    for m, n in ((8, 1), (128, 2)):
        ops = timeline.simulate([1.0, 1.0], [2.0, 2.0], m)
        end = max(o.end for o in ops)
        assert len(timeline.windows(ops, m, 3.0, end)) == n


def test_rank_layout_and_groups() -> None:
    plan = Plan(dp=3, tp=4, pp=2, micro_batch=1, grad_accum=1)
    for r in range(plan.world_size):
        assert plan.rank(*plan.coords(r)) == r
    assert plan.coords(13) == (1, 0, 0, 1)                  # (1*3 + 0)*4 + 1
    g, info = cluster.build_graph(plan, gpus_per_node=8)
    kinds = [k for _, _, k in g.edges(data="kind")]
    assert kinds.count("tp") == plan.dp * plan.pp * (plan.tp - 1)
    assert kinds.count("pp") == plan.dp * plan.tp * (plan.pp - 1)
    assert kinds.count("dp") == plan.pp * plan.tp * (plan.dp - 1)
    for u, v, k in g.edges(data="kind"):
        if k == "tp":
            assert g.nodes[u]["server"] == g.nodes[v]["server"]   # TP stays inside a server
    big = Plan(dp=24, tp=4, pp=8, micro_batch=1, grad_accum=1)
    g, info = cluster.build_graph(big, gpus_per_node=8)
    assert info["shown_ranks"] == 2 * 4 * 8 <= cluster.MAX_RANKS and info["world"] == 768


def test_why_a_plan_lost() -> None:
    winner = {"tokens_per_s": 1000.0, "peak_memory_gb": 30.0, "step_time_s": 10.0,
              "time_breakdown_s": {"forward": 3.0, "backward": 6.0, "bubble": 1.0}}
    row = pd.Series({"feasible": True, "tokens_per_s": 800.0, "peak_memory_gb": 25.0, "step_time_s": 12.5,
                     "time_forward": 3.0, "time_backward": 6.0, "time_bubble": 3.5})
    assert analysis.why_lost(row, winner) == "20.0% slower: pipeline bubble +2.5 s; 5.0 GB less per GPU"
    assert analysis.why_lost(pd.Series({"feasible": False, "reason": "stage 0 needs 9 GB > 8 GB"}), winner) == \
        "stage 0 needs 9 GB > 8 GB"
    same = pd.Series({"feasible": True, "tokens_per_s": 1000.0, "peak_memory_gb": 30.0})
    assert analysis.why_lost(same, winner) == "as fast; same memory"


def test_train_cost_and_formatting() -> None:
    c = analysis.train_cost(1000.0, 8, 3.6e6, 2.0)             # 3600 s on 8 GPUs = 8 GPU-hours
    assert c == {"time_s": pytest.approx(3600.0), "gpu_hours": pytest.approx(8.0), "cost": pytest.approx(16.0)}
    assert analysis.train_cost(0.0, 8, 1e6, None)["time_s"] is None
    assert fmt.si(143750) == "144k" and fmt.si(2.61e12, "tokens") == "2.61T tokens" and fmt.si(None) == "n/a"
    assert fmt.duration(86400 * 5) == "5 days" and fmt.duration(3600 * 30) == "30 h" and fmt.duration(0.0123) == "12.3 ms"
    assert fmt.money(16) == "$16.00" and fmt.money(8.31e6) == "$8.31M" and fmt.pct(0.425) == "42.5%"
    # a memory increase reads as one: "12.3% more", never "-12.3% less"
    assert fmt.less(0.123) == "12.3% less" and fmt.less(-0.123) == "12.3% more" and fmt.less(None) == "n/a"


def test_knobs_name_the_deepspeed_settings() -> None:
    plan = Plan(dp=2, tp=4, pp=2, zero=1, micro_batch=2, grad_accum=8, recompute="full",
                stage_layers=(5, 5), recompute_layers=(3, 1), sequence_parallel=True)
    model = dataclasses.replace(preset("glm-10b"), layers=10)
    train = TrainSpec(global_batch=32, seq_len=1024)
    keys = {full: (short, v) for short, v, full in analysis.knobs(plan, model, train, parse_cluster("16xA100"))}
    assert keys["zero_optimization.stage"] == ("zero", "1")
    assert keys["gradient_accumulation_steps"] == ("accum", "8")
    assert not any("autotp" in k for k in keys)  # TP is the executor's own layers, not a DeepSpeed AutoTP key
    assert ("tp", "4") in keys.values()
    assert ("stages", "5/5") in keys.values() and ("ckpt", "4/10") in keys.values()


# --- whole pages ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_sample_run(tmp_path_factory.mktemp("runs") / "glm-10b", study_trials=40, metrics=True, verify=True)


def _images(html: str) -> dict[str, str]:
    """Figure id -> data URI; every <img> on the page must be one of them."""
    found = {m.group(2): m.group(1) for m in re.finditer(
        r'<img src="(data:image/png;base64,[A-Za-z0-9+/=]+)" alt="[^"]*" id="img-([a-z]+)"', html)}
    assert len(found) == html.count("<img ")
    return found


@pytest.fixture(scope="module")
def page(sample: Path) -> str:
    out = write_report(sample, price_per_gpu_hour=2.0, train_tokens=1e12)
    assert out == sample / "report.html"
    return out.read_text()


def test_full_page_has_every_section_and_figure(sample: Path, page: str) -> None:
    html = page
    run = load(sample)
    assert set(_images(html)) == set(FIGURES)
    assert "could not be drawn" not in html and 'class="note"' not in html
    assert run.plan.describe() in html
    assert "$2.00/GPU-hour" in html and "1T tokens" in html
    for section in ("summary", "top-plans", "frontier", "memory", "time", "pipeline", "search", "cluster",
                    "measured", "reproduce", "inputs"):
        assert f'<section id="{section}">' in html
    assert 'class="sortable" id="top-table"' in html and html.count('<tr class="chosen">') == 1
    assert json.loads((sample / "plan.json").read_text())["inputs"]["command"].split()[0] in html
    assert str((sample / "ds_config.json").resolve()) in html


def test_page_is_self_contained(page: str) -> None:
    html = page
    refs = re.findall(r"""\b(?:src|href|action|poster|srcset)\s*=\s*(["']?)([^"'\s>]*)""", html, re.I)
    assert refs and all(v.startswith(("data:image/png;base64,", "#")) for _, v in refs), "a reference leaves the page"
    assert "<link" not in html and "@import" not in html and "url(" not in html
    csp = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', html).group(1)
    assert "default-src 'none'" in csp and "img-src data:" in csp
    import base64
    import hashlib
    script = re.search(r"<script>(.*?)</script>", html, re.S).group(1)
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    assert f"script-src 'sha256-{digest}'" in csp                 # the one script the page may run


def test_optional_files_missing_or_broken(sample: Path, tmp_path: Path) -> None:
    run = tmp_path / "bare"
    run.mkdir()
    for name in ("plan.json", "estimate.json"):
        (run / name).write_text((sample / name).read_text())
    html = write_report(run).read_text()
    assert set(_images(html)) == {"memory", "time", "gantt", "cluster", "bill"}     # the bill is in estimate.json
    assert "No trials.csv" in html and "No Optuna study" in html and 'id="measured"' not in html
    (run / "trials.csv").write_text("not,a,trials\nfile\n")
    (run / "study.db").write_bytes(b"this is not sqlite" * 100)
    (run / "metrics.json").write_text("{broken")
    html = write_report(run).read_text()
    assert "trials.csv could not be read" in html and "study.db could not be read" in html
    assert "metrics.json could not be read" in html


def test_required_files_and_bad_flags_are_one_line_errors(sample: Path, tmp_path: Path, capsys) -> None:
    with pytest.raises(SpecError, match="plan.json"):
        write_report(tmp_path)
    (tmp_path / "plan.json").write_text((sample / "plan.json").read_text())
    with pytest.raises(SpecError, match="estimate.json"):
        write_report(tmp_path)
    (tmp_path / "estimate.json").write_text('{"estimate": {"tokens_per_s": "fast"}}')
    with pytest.raises(SpecError, match="step_time_s"):
        write_report(tmp_path)
    for args in (["report", str(tmp_path / "nowhere")], ["report", str(sample), "--price-per-gpu-hour", "-3"],
                 ["report", str(sample), "--train-tokens", "0"]):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert main(["report", str(sample), "--price-per-gpu-hour", "1.5"]) == 0
    assert "wrote" in capsys.readouterr().out


def test_importances_need_enough_varied_trials(tmp_path: Path) -> None:
    # one CPU process: one layout x the recompute modes, so the real search stops after a few trials
    from planner.specs import preset, scale
    few = write_sample_run(tmp_path / "few", model=scale(preset("chatglm3-6b"), "tiny"), gpus="1xcpu",
                           global_batch=8, seq_len=128, study_trials=MIN_TRIALS_FOR_IMPORTANCE - 1)
    run = load(few)
    n = len(run.study.history)
    assert run.study is not None and not run.study.importances and 1 <= n < MIN_TRIALS_FOR_IMPORTANCE
    assert f"only {n} complete" in run.study.importance_note
    html = render(run)
    assert 'id="img-history"' in html and 'id="img-importances"' not in html
    assert run.study.importance_note in html


def test_baseline_that_fits_gives_ratios(sample: Path, tmp_path: Path) -> None:
    run = load(sample)
    est = dict(run.estimate)
    fake = {"plan": Plan(dp=16, micro_batch=1, grad_accum=4).to_dict(),
            "estimate": {**est, "tokens_per_s": est["tokens_per_s"] / 4, "peak_memory_gb": est["peak_memory_gb"] * 2,
                         "feasible": True}}
    import dataclasses
    head = analysis.headline(dataclasses.replace(run, baseline=fake, verify=None), None, None)
    b = head["baseline"]
    assert b["fits"] and b["throughput_ratio"] == pytest.approx(4.0) and b["memory_reduction"] == pytest.approx(0.5)
    assert b["met"] == {"throughput_ratio": True, "memory_reduction": True}
    slow = {**fake, "estimate": {**fake["estimate"], "tokens_per_s": est["tokens_per_s"] / 2}}
    b = analysis.headline(dataclasses.replace(run, baseline=slow, verify=None), None, None)["baseline"]
    assert b["throughput_ratio"] == pytest.approx(2.0) and not b["met"]["throughput_ratio"]


def test_tiny_cpu_run_draws_every_figure_without_layout_warnings(tmp_path):
    """A tiny model on a CPU host uses a sliver of its capacity: the capacity must not be drawn
    off the axes (that collapsed matplotlib's constrained layout and dropped the figure)."""
    import warnings

    from planner.report import write_report
    from planner.report.sample import write_sample_run
    from planner.specs import preset, scale
    run = write_sample_run(tmp_path / "tiny", model=scale(preset("chatglm3-6b"), "tiny"), gpus="2xcpu",
                           global_batch=8, seq_len=128, study_trials=12)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        page = write_report(run).read_text()
    assert "could not be drawn" not in page
