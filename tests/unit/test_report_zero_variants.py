"""The report on DeepSpeed's ZeRO variants (issue 9): the variants and the host memory of the
chosen plan, the host side of the cluster, and the near-the-memory-limit marker on the
summary and on each top-plans row (and not on plans far from the limit)."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from planner.cli import main
from planner.report import analysis
from planner.report.build import render
from planner.report.data import RunData, load
from planner.specs.estimate import GB

NEAR_TEXT = "near the memory limit: "


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("runs")
    assert main(["search", "--model", "glm-10b", "--gpus", "8xA100", "--exhaustive", "--out-dir", str(out)]) == 0
    return out / "glm-10b_8xA100"


@pytest.fixture(scope="module")
def run(run_dir: Path) -> RunData:
    return load(run_dir)


def with_peak(run: RunData, peak_gb: float) -> RunData:
    """The run with the chosen plan's estimated peak memory replaced."""
    return dataclasses.replace(run, estimate={**run.estimate, "peak_memory_gb": peak_gb})


def row_flags(html: str) -> int:
    return html.count('class="badge warn near-limit"')


def test_a_plan_far_from_the_limit_is_not_flagged(run: RunData) -> None:
    usable_gb = run.cluster.usable_bytes / GB
    assert run.estimate["peak_memory_gb"] < 0.95 * usable_gb          # glm-10b on 8x A100-80GB: ~54 of 80 GB
    html = render(run)
    assert 'id="memory-limit"' not in html and 'near memory limit</span></div><div class="v">' not in html
    head = analysis.headline(run, None, None)
    assert head["memory_flag"] is None
    # every top-plans row is flagged exactly when its peak is within 2% of the usable memory
    rows = analysis.top_plans(run, 10)
    plans = rows[rows["kind"] == "plan"]
    flagged = [f is not None for f in plans["memory_flag"]]
    assert flagged == [p > 0.98 * usable_gb for p in plans["peak_memory_gb"]]
    assert row_flags(html) == sum(flagged)


def test_a_plan_near_the_limit_is_flagged_on_the_page(run: RunData) -> None:
    usable_gb = run.cluster.usable_bytes / GB
    near = 0.99 * usable_gb
    html = render(with_peak(run, near))
    assert 'id="memory-limit"' in html
    assert f"{NEAR_TEXT}{near:.1f} of {usable_gb:.1f} GB usable (headroom " in html
    assert 'near memory limit</span></div><div class="v">' in html        # the badge on the memory card
    # 1.5% below the limit is near; 2.5% below is not
    assert 'id="memory-limit"' in render(with_peak(run, 0.985 * usable_gb))
    assert 'id="memory-limit"' not in render(with_peak(run, 0.975 * usable_gb))


def test_a_top_plans_row_near_the_limit_carries_the_marker(run: RunData) -> None:
    usable_gb = run.cluster.usable_bytes / GB
    trials = run.trials.copy()
    best = trials[trials["feasible"] & (trials["source"] != "baseline")]["tokens_per_s"].idxmax()
    trials.loc[best, "peak_memory_gb"] = 0.99 * usable_gb
    edited = dataclasses.replace(run, trials=trials)
    rows = analysis.top_plans(edited, 10)
    plans = rows[rows["kind"] == "plan"]
    flagged = plans[[f is not None for f in plans["memory_flag"]]]
    assert int(trials.loc[best, "trial"]) in set(flagged["trial"])
    assert all(p > 0.98 * usable_gb for p in flagged["peak_memory_gb"])
    html = render(edited)
    assert row_flags(html) == len(flagged) >= 1
    assert f"{NEAR_TEXT}{0.99 * usable_gb:.1f} of {usable_gb:.1f} GB usable" in html   # the badge's title


def test_variants_and_host_memory_on_the_page(run: RunData) -> None:
    plan = dataclasses.replace(run.plan, zero=3, offload_optimizer="cpu", quantized_weights=True)
    est = {**run.estimate, "host_memory_gb": 20.0}
    edited = dataclasses.replace(run, plan=plan, estimate=est, doc={**run.doc, "description": plan.describe()})
    html = render(edited)
    assert plan.describe() in html and "optimizer offload to cpu" in html
    assert 'id="plan-variants"' in html and "<span>ZeRO++ qwZ</span>" in html
    # the host memory card: 20 GB per rank x 8 ranks of the node's 2048 GB (profiles/A100-80GB.json)
    assert 'id="host-memory"' in html and "160.0 GB" in html
    assert "20.0 GB offloaded per rank &times; 8, of 2048.0 GB on the node" in html
    # the cluster's host side
    assert "<dt>host memory</dt><dd>2048 GB per node</dd>" in html
    assert "<dt>NVMe</dt><dd>25 GB/s per node</dd>" in html
    # no host memory, no card; the plan as searched has no variants
    assert 'id="host-memory"' not in render(run) and 'id="plan-variants"' not in render(run)


def test_variant_knobs_name_the_deepspeed_keys(run: RunData) -> None:
    plan = dataclasses.replace(run.plan, zero=3, offload_optimizer="nvme", offload_params="cpu", hpz=8,
                               quantized_gradients=True, prefetch_elements=10_000_000)
    keys = {full.split(" ")[0]: (short, v) for short, v, full in analysis.knobs(plan, run.model, run.train, run.cluster)}
    assert keys["zero_optimization.offload_optimizer.device"] == ("off-opt", "nvme")
    assert keys["zero_optimization.offload_param.device"] == ("off-par", "cpu")
    assert keys["zero_optimization.zero_hpz_partition_size"] == ("hpZ", "8")
    assert keys["zero_optimization.zero_quantized_gradients"] == ("qgZ", "")
    assert keys["zero_optimization.stage3_prefetch_bucket_size"] == ("prefetch", "1e7")
    assert "zero_optimization.mics_shard_size" not in keys
    mics = dataclasses.replace(run.plan, zero=3, mics_shard=4)
    assert ("MiCS", "4") in [(s, v) for s, v, _ in analysis.knobs(mics, run.model, run.train, run.cluster)]
    # every option away from its default, so two plans differing only in one never share a label
    assert analysis.short_label(plan).endswith("off-opt:nvme off-par:cpu hpZ8 qgZ bucket=2e8 prefetch=1e7")


def test_the_cli_words_import_without_the_report_stack() -> None:
    code = ("import sys; import planner.report.plan_text, planner.cli.search; "
            "bad = [m for m in ('pandas', 'jinja2', 'matplotlib') if m in sys.modules]; "
            "assert not bad, bad; from planner.report import write_report; assert callable(write_report)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
