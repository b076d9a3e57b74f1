"""Profiler maths: alpha-beta fit, bus-bandwidth conventions, GEMM shapes and curve, formulas."""
from __future__ import annotations

import math

import numpy as np
import pytest

from planner.profiler import comm, gemm
from planner.profiler.fit import bus_factor, fit_alpha_beta
from planner.profiler.stats import Sample, summarize, time_call
from planner.specs import preset, scale


@pytest.mark.parametrize("op,n,alpha,busbw", [("all_reduce", 2, 50e-6, 1.5e9), ("all_reduce", 8, 8e-6, 230e9),
                                               ("all_gather", 4, 20e-6, 3e9), ("send_recv", 2, 100e-6, 2e9)])
def test_alpha_beta_recovered_from_noisy_synthetic_sweep(op, n, alpha, busbw):
    rng = np.random.default_rng(0)
    sizes = [2.0 ** k for k in range(10, 29, 2)]
    algbw = busbw / bus_factor(op, n)
    times = [(alpha + s / algbw) * (1 + 0.02 * rng.standard_normal()) for s in sizes]
    fit = fit_alpha_beta(op, n, sizes, times)
    assert fit.alpha_s == pytest.approx(alpha, rel=0.05)
    assert fit.busbw_gbps == pytest.approx(busbw / 1e9, rel=0.05)
    assert fit.max_rel_error < 0.08
    assert fit.predict(sizes[-1]) == pytest.approx(alpha + sizes[-1] / algbw, rel=0.05)


def test_alpha_is_never_negative():
    sizes = [1e3, 1e6, 1e8]
    fit = fit_alpha_beta("all_reduce", 2, sizes, [s / 1e9 * 1.1 - 1e-6 if s > 1e3 else 1e-9 for s in sizes])
    assert fit.alpha_s >= 0 and fit.beta_s_per_byte > 0


def test_fit_needs_two_points():
    with pytest.raises(ValueError):
        fit_alpha_beta("all_reduce", 2, [1.0], [1.0])


def test_nccl_tests_bus_factors():
    # nccl-tests PERFORMANCE.md: all-reduce 2(n-1)/n; all-gather / reduce-scatter (n-1)/n; sendrecv 1
    assert bus_factor("all_reduce", 8) == pytest.approx(1.75)
    assert bus_factor("all_gather", 8) == pytest.approx(0.875)
    assert bus_factor("reduce_scatter", 2) == pytest.approx(0.5)
    assert bus_factor("send_recv", 4) == 1.0


def test_group_and_message_sizes():
    assert comm.group_sizes(1) == []
    assert comm.group_sizes(2) == [2]
    assert comm.group_sizes(6) == [2, 4, 6]
    quick, full = comm.message_sizes(True, "cpu"), comm.message_sizes(False, "cpu")
    assert quick[0] == 4 << 10 and quick[-1] == 16 << 20
    assert full[0] == 1 << 10 and full[-1] == 256 << 20
    assert comm.message_sizes(False, "gpu")[-1] == 1 << 30


def test_model_shapes_match_the_cost_model_flops():
    from planner.cost.compute import block_gemms, logits_forward_flops
    for name in ("chatglm3-6b", "glm-130b", "glm-10b"):
        m = preset(name)
        for t in (1, 2, 8):
            shapes = {s.name: s for s in gemm.model_shapes(m, 2048, t)}
            weight, _ = block_gemms(m, 2048, 1, t)
            ffn_up = next(v for k, v in shapes.items() if k.startswith("ffn_up"))
            ours = shapes["qkv"].flops + shapes["attn_out"].flops + ffn_up.flops + shapes["ffn_down"].flops
            assert ours == pytest.approx(sum(weight))
            assert shapes["output"].flops == pytest.approx(logits_forward_flops(m, 2048, 1, t), rel=1e-4)


def test_legal_tp():
    tiny = scale(preset("chatglm3-6b"), "tiny")  # 4 heads, 2 KV groups
    assert gemm.legal_tp(tiny, 8) == [1, 2]
    assert gemm.legal_tp(preset("glm-130b"), 8) == [1, 2, 4, 8]


def _result(flops_side: int, tflops: float, prec: str = "bf16") -> gemm.GemmResult:
    shape = gemm.GemmShape(name="square", m=flops_side, k=flops_side, n=flops_side)
    t = shape.flops / (tflops * 1e12)
    return gemm.GemmResult(shape=shape, precision=prec, time=Sample(median=t, min=t, max=t, n=3, unit="s"))


def test_peak_and_efficiency_curve():
    rs = [_result(128, 0.05), _result(130, 0.07), _result(1024, 0.2), _result(2048, 0.25), _result(512, 1.0, "fp32")]
    best = gemm.peak_tflops(rs)
    assert best["bf16"].tflops == pytest.approx(0.25)
    assert best["fp32"].tflops == pytest.approx(1.0)
    curve = gemm.efficiency_curve([r for r in rs if r.precision == "bf16"], best["bf16"].tflops)
    assert [round(e, 3) for _, e in curve] == [0.24, 0.8, 1.0]  # 128 and 130 share a half-decade bin: median
    assert all(a[0] < b[0] for a, b in zip(curve, curve[1:]))


def test_sample_summary_and_timer():
    s = summarize([1.0, 2.0, 4.0], "s")
    assert (s.median, s.n, s.spread) == (2.0, 3, 1.5)
    calls = []
    t = time_call(lambda: calls.append(1), warmup=2, repeats=4)
    assert t.n == 4 and len(calls) == 6 and t.median >= 0
    assert math.isfinite(t.to_dict()["spread"])
