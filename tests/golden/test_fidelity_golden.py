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
AFTER = {"T1": 0.030, "DS-A": 0.035, "DS-A13": 0.543, "DS-B": 0.066, "DS-C": 0.164, "DS-D": 0.001,
         "DS-E": 0.144, "S1": 0.061, "S5": 0.044, "S6": 0.063, "S7": 0.070, "S8": 0.083, "all": 0.076}
"""MAPE after (shipped factors, each row on its runtime), as printed by
`benchmarks/fidelity.py --no-loso-deepspeed` on 2026-12-02, with the 21 context-parallel rows of S5-S7
scored (ring CP), and compute from shapes (planner/cost/compute.py: GEMMs from (M, N, K) with tile and
wave quantization, flash attention from its measured throughput, causal where the runtime passes a
causal flag; Table 1 with Megatron-LM 2021's unfused attention) and megatron-core's compute_scale
fitted per GPU. Looser than before, said in the commit: DS-A/B/C/E (the DeepSpeed factors in
profiles/ were fitted on the old FLOPs-only curve and await their refit), S1 (6.2 -> 9.3%), S7
(9.5 -> 19.0%: the H100 long-sequence rows, whose measured steps are derived from TFLOP/s counted
non-causally, are 25-35% too fast against the cuDNN causal curves) and S8 (11.1 -> 14.3%: at
physics compute_scale 1.0 FSDP on A100 is 14% too fast on average).
Then communication per link class (profiles/links/classes.json: measured base latency and efficiency
per class, hierarchical collectives, ring vs tree by size) replaced DeepSpeed's fitted comm_efficiency
and latency_scale, step_overhead_s was capped at 50 ms, A100's network_efficiency was fitted (sections
A and B) and `planner calibrate --reference` refitted the DeepSpeed factors on compute from shapes
(A100 compute_scale 1.09). Better: DS-A 14.4 -> 3.5%, DS-B 11.0 -> 6.6%, DS-C 32.7 -> 16.3%, DS-D,
S5 8.7 -> 8.2%, all 12.9 -> 12.1%. Worse, and why: DS-A13 (1 row, 32.5 -> 54.3%) and DS-E (11.9 ->
14.4%): V100's 1.79 s per-step constant is gone and V100's compute_scale (1.81) is set by E's five
2019 rows (refitted without E it is 1.00); S1 (9.3 -> 10.0%): the measured NVSwitch step latency
(1.32 us, was an assumed 6-8 us) and InfiniBand's measured 0.84 efficiency.
Then each source's attention kernel as its published configuration ran it (TrainSpec.attention_backend,
benchmarks/reference_rows.py ATTENTION_BACKEND): S7's H100 rows FlashAttention-2 (their container's
launcher set NVTE_FUSED_ATTN=0), S8 llm-foundry's Triton FlashAttention (--attn_impl triton).
Better: S7 19.0 -> 7.2%, S8 14.3 -> 8.3%, all 12.1 -> 7.8%; S5 (8.2 -> 8.4%) and S6 (3.8 -> 4.0%) within their bounds:
H100's compute_scale is refitted (1.338 -> 1.337) with S7's H100 rows no longer 25-35% too fast.
Then Megatron-Core's data-parallel sync as it runs (runtime grad_reduce_fp32, param_gather_overlap): bf16/fp8
gradients reduce-scattered in fp32 (Megatron-LM arguments.py forces accumulate_allreduce_grads_in_fp32 for
bf16), the distributed optimizer's parameter all-gather hidden behind the next forward (--overlap-param-gather).
Looser, said in the commit: S1 after 10.0 -> 10.8% and S6 after 3.8 -> 4.4% (H100's refit 1.337 -> 1.339);
better: S6 LOSO 4.9 -> 4.5%, S5 9.0 -> 8.9%. S1's four PP=1 rows now lie within 8 points of each other
(-13..-5%, were -10..+17%): what is left there is common to them; its PP rows stay +1..+19%.
Then S1's unstated interleaving from every chunking Megatron-Core can run (benchmarks/reference_rows.py
every_chunking: the divisors of the layers per stage, was 1, 2, 3, 4, 6, 8 only, which left S1-6's 92 layers
over 4 stages and S1-9's 112 over 16 with no interleaving at all): S1 10.8 -> 6.1%, all 7.8 -> 7.7%.
Then the GEMM ceilings vidur did not measure from each GPU's measured maximum achievable matmul FLOPS
(benchmarks/kernel_curves.py MAMF, stas00/ml-engineering's table): H100 fp8 0.747 -> 0.66 (its fp8 matmul
reaches 70.9% of peak, bf16 80.3%), B200 bf16 0.722 and fp8 0.71, H200 fp8 0.683. The fitted compute_scale
moves toward physics (H100 1.342 -> 1.225, B200 1.512 -> 1.440). Looser, said in the commit: S1 6.1 -> 9.1%
and S6 4.4 -> 5.2% (one H100 factor for bf16 and fp8: S1's bf16 rows want ~1.4, the fp8 sources ~1.2);
S7 7.2 -> 7.3%, all 7.7 -> 7.8%.
Then each GPU's capacity as the CUDA driver reports it (profiles/*.json memory_total_mib: an A100 "80GB" holds
81,039 MiB = 85.0e9 bytes, not 80e9): more of each source's allowed micro-batches and chunkings fit, so the
fastest plan a row is predicted by is one its authors could run. Tighter: S1 9.1 -> 8.3%, S5 8.1 -> 6.5%,
S6 5.2 -> 4.9%, S7 7.3 -> 7.0%, all 7.8 -> 7.7%.
Then megatron-core fp8 ZeRO-1 plans without the blocks' bf16 weight (Megatron-Bridge's fp8 recipes set
fp8_param_gather=True; profiles/runtimes/megatron-core.json): rows that had to recompute now fit without,
and H100's fitted compute_scale moves 1.244 -> 1.326. Tighter: S1 8.3 -> 6.1%, S5 6.5 -> 4.4%, S7 7.0 -> 6.9%,
all 7.7 -> 7.6%. Looser, said in the commit: S6 4.9 -> 6.3% (its H100 rows +6..+9% slow at the common factor,
S6-3/6/8/12/13 now predicted without recompute)."""
LOSO = {"T1": 0.030, "S1": 0.061, "S5": 0.051, "S6": 0.084, "S7": 0.107, "S8": 0.083}
"""Leave-one-source-out MAPE of the sources whose runtime's factors this benchmark fits. S5 8.5 -> 9.0%
(said in the commit): refitted without S5, H100's compute_scale (1.319) now comes from S1, S6 and S7's
H100 rows timed on FlashAttention-2, which no longer pull it up; S7 22.9 -> 11.2% (what is left is
B200, which has no fit without S7: S6 alone is one source). S6 4.5 -> 7.3% with S1 interleaved as Megatron
can (said in the commit): refitted without S6, H100's objective (the mean of S1, S5 and S7's MAPE) is flat
within 0.01 points from 1.36 to 1.42 (S1 pulls down, S5 up) and the fit lands at 1.416, where S6's H100 rows
are ~5% slow; with S6 it is 1.342. S7 11.2 -> 11.3% (B200's refit 1.500 -> 1.512).
With the MAMF-derived ceilings (above): S1 6.1 -> 9.9%, S6 7.3 -> 10.0% (without S6 the fit is 1.334, the
fp8 rows want ~1.22: S6's H100 rows +6..+14%), S7 11.3 -> 11.0%, overall 8.9 -> 9.2%.
With the driver's capacity per GPU (above): S1 9.9 -> 9.2%, S5 8.2 -> 7.2%, S6 10.0 -> 9.5%, S7 11.0 -> 10.7%.
With fp8_param_gather (above): S1 9.2 -> 6.1%, S5 7.2 -> 5.1%, S6 9.5 -> 8.4%, S7 10.7 -> 10.7%."""
NOT_FITTING = 3
"""Reference runs (which all ran) predicted not to fit: may only go down. 19 -> 3 with the driver's capacity
per GPU (15 S8 rows and D01 were 0.2-3.2 GB over 80e9 / 40e9 / 32e9 bytes, within 85.0e9 / 42.4e9 / 34.1e9);
left: DS-B's 1T and 2T rows at micro-batch 8 (B03, B14: 2.3 and 4.3 GB over; B04: its 160 checkpoints alone,
2 s b h each, are 85.9 GB)."""


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


def test_shipped_trims_are_the_fit(report) -> None:
    """profiles/runtimes/megatron-core.json by_device holds what this benchmark fits (3 digits): a change
    that moves the fit must ship it, and a shipped trim cannot drift from its sources."""
    from planner.cost.runtime import get_runtime
    shipped = get_runtime("megatron-core").by_device
    fitted = report["fits"]["megatron-core"]["by_device"]
    assert sorted(shipped) == sorted(fitted)
    for gpu, fac in fitted.items():
        assert shipped[gpu]["compute_scale"] == pytest.approx(fac["compute_scale"], abs=0.001), gpu


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
