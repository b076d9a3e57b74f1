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
AFTER = {"T1": 0.050, "DS-A": 0.041, "DS-A13": 0.564, "DS-B": 0.061, "DS-C": 0.164, "DS-D": 0.004,
         "DS-E": 0.146, "S1": 0.074, "S5": 0.078, "S6": 0.022, "S7": 0.075, "S8": 0.120, "all": 0.101}
"""MAPE after (shipped factors, each row on its runtime), as printed by
`benchmarks/fidelity.py --no-loso-deepspeed` on 2026-12-02 after communication per link class
(profiles/links.json: measured base latency and efficiency per class, hierarchical collectives,
ring vs tree) replaced the fitted comm_efficiency and latency_scale, and step_overhead_s was
capped at 50 ms (issue 19 items 3, 4). Worse than before and why: DS-A13 (1 row, 30.1% -> 56.4%)
and DS-E (11.4% -> 14.6%): V100's 1.79 s per-step constant is gone and its compute_scale
(refitted 1.41 -> 1.89) now absorbs the V100 time no physics term explains yet; S1 (6.7% ->
7.4%), S6/S7 (+0.1): the measured NVSwitch step latency (1.32 us, was an assumed 6-8 us) and
InfiniBand's measured 0.84 efficiency on pipeline sends. Better: DS-C 31.4% -> 16.4%, DS-B
6.4% -> 6.1%, S5 8.1% -> 7.8%.
"""
LOSO = {"T1": 0.058, "S1": 0.076, "S5": 0.084, "S6": 0.022, "S7": 0.075, "S8": 0.120}
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
    """The issue's target is 5%; measured 4.95% (2026-12-02, link classes): within a tenth of a point."""
    assert report["sources"]["T1"]["mape_after"] <= fidelity.TARGETS["t1_after"] + 0.001


def test_unscored_rows_are_only_context_parallel(report) -> None:
    """fp8 and B200 are modelled: what stays unscored is context parallelism (21 rows)."""
    left = [r for r in report["rows"] if r["unsupported"]]
    assert len(left) == 21 and all("context parallelism" in r["unsupported"] for r in left)


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
