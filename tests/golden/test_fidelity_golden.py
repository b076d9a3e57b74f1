"""Golden accuracy bounds: the cost model against every published run in shared reference/,
source by source (benchmarks/fidelity.py; issue 19, issue 21 item 4). Each bound is the MAPE
that benchmarks/fidelity.py printed when it was set, plus half a percentage point: a change
that makes the model worse on any source turns this red. Tighten a bound when the model
improves; never loosen one without saying in the commit which physics changed and why.

DeepSpeed's leave-one-source-out (a refit of benchmarks/ds_reference.py's fitter per source,
~minutes) is not run here: its after-fit MAPE is bounded instead.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import fidelity  # noqa: E402

MARGIN = 0.005
AFTER = {"T1": 0.044, "DS-A": 0.035, "DS-A13": 0.559, "DS-B": 0.066, "DS-C": 0.181, "DS-D": 0.001,
         "DS-E": 0.145, "S1": 0.072, "S5": 0.098, "S6": 0.038, "S7": 0.095, "S8": 0.114, "all": 0.098}
"""MAPE after (shipped factors, each row on its runtime), as printed by
`benchmarks/fidelity.py --no-loso-deepspeed` on 2026-12-02, with the 21 context-parallel rows of S5-S7
scored (ring CP): S5, S6 and S7 now hold 12, 17 and 17 rows instead of 10, 10 and 5, and their MAPE
covers the long-context rows (S7's H100 rows at 32k-1M tokens are 16-20% too fast).
Then communication per link class (profiles/links/classes.json: measured base latency and efficiency per
class, hierarchical collectives, ring vs tree by size) replaced DeepSpeed's fitted comm_efficiency
and latency_scale, step_overhead_s was capped at 50 ms (issue 19 items 3, 4) and DeepSpeed's
factors were refitted. Worse, and why: DS-A13 (1 row, 30.1% -> 56.3%) and DS-E (11.4% -> 14.6%):
V100's 1.79 s per-step constant is gone and its compute_scale (refitted 1.41 -> 1.89) absorbs
V100 time no physics term explains yet; S1 (6.2% -> 7.2%), T1 (4.2% -> 4.4%), S8 (11.1% ->
11.4%): the measured NVSwitch step latency (1.32 us, was an assumed 6-8 us) and InfiniBand's
measured 0.84 efficiency. Better: DS-C 31.4% -> 18.1%, S5 10.4% -> 9.8%. A100's network_efficiency
(0.79, from sections A and B: two fabrics) moved DS-A 3.9% -> 3.5% (leave-one-source-out 4.8% ->
3.5%) and DS-B 6.1% -> 6.6% (6.0% -> 6.9%)."""
LOSO = {"T1": 0.051, "S1": 0.074, "S5": 0.102, "S6": 0.038, "S7": 0.095, "S8": 0.114}
"""Leave-one-source-out MAPE of the sources whose runtime's factors this benchmark fits."""
NOT_FITTING = 60
"""Reference runs (which all ran) predicted not to fit: may only go down."""


@pytest.fixture(scope="module")
def report():
    return fidelity.run(loso_deepspeed=False)


@pytest.mark.parametrize("source", sorted(AFTER))
def test_after_mape_within_bound(report, source: str) -> None:
    v = report["sources"][source]["mape_after"]
    assert v is not None and v <= AFTER[source] + MARGIN, f"{source}: MAPE after {v:.1%} > {AFTER[source]:.1%}"


@pytest.mark.parametrize("source", sorted(LOSO))
def test_loso_mape_within_bound(report, source: str) -> None:
    v = report["sources"][source]["mape_loso"]
    assert v is not None and v <= LOSO[source] + MARGIN, f"{source}: LOSO {v:.1%} > {LOSO[source]:.1%}"


def test_table1_under_megatron_core_is_near_the_issue_target(report) -> None:
    """The issue's target is 5%; measured 5.0005% (2026-12-02): within a tenth of a point."""
    assert report["sources"]["T1"]["mape_after"] <= fidelity.TARGETS["t1_after"] + 0.001


def test_every_reference_row_is_scored(report) -> None:
    """fp8, B200 and context parallelism (ring CP, planner.cost.longctx) are modelled: no row is
    left unscored."""
    assert [r["id"] for r in report["rows"] if r["unsupported"]] == []


def test_runs_predicted_not_to_fit_do_not_grow(report) -> None:
    assert len(report["sources"]["all"]["not_fitting"]) <= NOT_FITTING


def test_every_row_is_scored_or_says_why(report) -> None:
    assert all(r["unsupported"] or r["err_after"] is not None for r in report["rows"])
    assert len(report["rows"]) == 10 + 38 + 194  # Table 1, deepspeed-at-scale.md A-E, modern-runs.md


def test_before_is_the_pre_runtime_model(report) -> None:
    """Every DeepSpeed row is costed the same before and after (its runtime did not change);
    the megatron-core rows are not (their runtime and factors did)."""
    ds = [r for r in report["rows"] if r["runtime"] == "deepspeed"]
    assert all(abs(r["before_s"] - r["after_s"]) < 1e-12 for r in ds)
    mc = [r for r in report["rows"] if r["runtime"] == "megatron-core" and not r["unsupported"]
          and r["before_s"] is not None]
    assert mc and all(abs(r["before_s"] - r["after_s"]) > 1e-6 for r in mc)
