"""planner/serve/calibrate.py recovers known serving factors from synthetic measurements
(steps generated with those factors on the tiny model, TP 1 and 2, memory- and compute-bound)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from planner.errors import SpecError
from planner.serve import calibrate
from planner.serve.factors import combine
from planner.serve.terms import decode_terms, prefill_terms
from planner.serve.spec import Deployment
from planner.specs.hardware import PROFILES_DIR, find_device, load_profile
from planner.specs.cluster import parse_cluster
from planner.specs.presets import preset, scale

TRUE = {"prefill_compute_scale": 1.7, "decode_bw_efficiency": 0.35, "serve_comm_scale": 3.0,
        "serve_step_overhead_s": 0.002, "decode_compute_scale": 4.0, "serve_tp_step_s": 0.004}
MODEL = scale(preset("chatglm3-6b"), "tiny")


def synthetic(tps=(1, 2), factors=TRUE) -> list[dict]:
    dev = find_device("cpu")[0]
    runs = []
    for tp in tps:
        dep = Deployment(tp=tp, max_batch=4, weight_precision="fp32", kv_precision="fp32")
        c = parse_cluster(f"{tp}xcpu", dev)
        # measured = forward (time_s) + the engine's own time (host_s): split it 80/20
        steps = []
        for b in (1, 2, 4, 8):
            for ctx in (20, 100, 300):
                t = combine(decode_terms(MODEL, c, dep, b, b * ctx), factors, decode=True)
                steps.append({"batch": b, "context_tokens": b * ctx, "time_s": 0.8 * t, "host_s": 0.2 * t})
        pre = [{"tokens": n, "time_s": combine(prefill_terms(MODEL, c, dep, n), factors)} for n in (16, 64, 200)]
        runs.append({"model": MODEL.to_dict(), "deployment": {"tp": tp, "max_batch": 4, "precision": "fp32"},
                     "decode_steps": steps, "prefills": pre})
    return runs


def test_recovers_known_factors():
    f = calibrate.fit_serving(synthetic())
    for k, v in TRUE.items():
        assert f[k] == pytest.approx(v, rel=1e-6), k


def test_undetermined_factor_keeps_its_value():
    # no TP run: nothing determines serve_comm_scale, which stays at the profile's default 1.0
    f = calibrate.fit_serving(synthetic(tps=(1,)))
    assert f["serve_comm_scale"] == 1.0
    assert f["decode_bw_efficiency"] == pytest.approx(0.35, rel=1e-6)


def test_writes_a_profile_copy(tmp_path):
    runs = synthetic()
    out = tmp_path / "cpu-serving.json"
    rep = calibrate.write_serving_profile(PROFILES_DIR / "cpu.json", runs, out)
    assert rep["mape_after_pct"] < 1e-6 < rep["mape_before_pct"]
    data = json.loads(out.read_text())
    assert data["builtin"] is False and "fitted by planner.serve.calibrate" in data["sources"]["factors.serve_comm_scale"]
    assert load_profile(out).factors["decode_bw_efficiency"] == pytest.approx(0.35, rel=1e-6)


def test_bad_runs():
    with pytest.raises(SpecError):
        calibrate.fit_serving([{"model": MODEL.to_dict()}])
    with pytest.raises(SpecError):
        calibrate.fit_serving([{"model": MODEL.to_dict(), "deployment": {"tp": 1}, "decode_steps": [], "prefills": []}])


def test_combine_pins_the_decode_scale_and_tp_step_term():
    f = {"prefill_compute_scale": 2.0, "decode_compute_scale": 5.0, "decode_bw_efficiency": 0.5,
         "serve_comm_scale": 3.0, "serve_step_overhead_s": 0.001, "serve_tp_step_s": 0.01}
    t = {"compute_s": 0.1, "memory_s": 0.2, "comm_s": 0.02, "tp_steps": 1.0}
    # prefill: max(0.1 x 2, 0.2 / 0.5) = 0.4; + 0.02 x 3 + 0.001 + 1 x 0.01
    assert combine(t, f) == pytest.approx(0.4 + 0.06 + 0.001 + 0.01)
    # decode: max(0.1 x 5, 0.4) = 0.5 (the compute floor binds)
    assert combine(t, f, decode=True) == pytest.approx(0.5 + 0.06 + 0.001 + 0.01)
    # no TP: no step term
    assert combine({**t, "tp_steps": 0.0}, f, decode=True) == pytest.approx(0.5 + 0.06 + 0.001)


def test_terms_count_one_tp_step_under_tp_only():
    dev = find_device("cpu")[0]
    for tp, want in ((1, 0.0), (2, 1.0)):
        c = parse_cluster(f"{tp}xcpu", dev)
        assert decode_terms(MODEL, c, Deployment(tp=tp), 2, 10)["tp_steps"] == want
        assert prefill_terms(MODEL, c, Deployment(tp=tp), 10)["tp_steps"] == want


def test_host_seconds_count_in_the_measured_step():
    dev = find_device("cpu")[0]
    run = {"model": MODEL.to_dict(), "deployment": {"tp": 1, "max_batch": 1},
           "decode_steps": [{"batch": 1, "context_tokens": 5, "time_s": 0.003, "host_s": 0.001}],
           "prefills": [{"tokens": 4, "time_s": 0.01}]}  # no host_s (older files): 0
    assert [(m, d) for _, m, d in calibrate._observations(run, dev)] == [(0.004, True), (0.01, False)]


def test_malformed_step_is_a_spec_error():
    run = {"model": MODEL.to_dict(), "deployment": {"tp": 1}, "decode_steps": [{"batch": 1, "time_s": 0.1}]}
    with pytest.raises(SpecError):
        calibrate.fit_serving([run])


def test_calibrate_cli_takes_serving_runs(tmp_path, capsys):
    from planner.cli import main
    dirs = []
    for i, run in enumerate(synthetic()):
        d = tmp_path / f"run{i}"
        d.mkdir()
        (d / "serve_metrics.json").write_text(json.dumps(run))
        dirs.append(str(d))
    out = tmp_path / "cpu-serving.json"
    # serve_metrics.json in every directory: a serving calibration without --serving
    assert main(["calibrate", *dirs, "--out", str(out)]) == 0
    assert load_profile(out).factors["decode_compute_scale"] == pytest.approx(4.0, rel=1e-6)
    # a built-in profile is not overwritten; a missing run is one line; nothing written
    assert main(["calibrate", "--serving", *dirs]) == 2
    assert main(["calibrate", "--serving", str(tmp_path / "none"), "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "built-in profile" in err[0] and "serve_metrics.json" in err[1]
    assert not (tmp_path / "x.json").exists()


def test_combine_adds_memory_and_compute_where_serial():
    f = {"prefill_compute_scale": 2.0, "decode_compute_scale": 5.0, "decode_bw_efficiency": 0.5,
         "serve_comm_scale": 3.0, "serve_step_overhead_s": 0.001, "serve_tp_step_s": 0.01}
    t = {"compute_s": 0.1, "memory_s": 0.2, "comm_s": 0.02, "tp_steps": 1.0, "serial": 1.0}
    # CPU: 0.1 x 2 + 0.2 / 0.5 = 0.6 (prefill), 0.1 x 5 + 0.4 = 0.9 (decode); + 0.06 + 0.001 + 0.01
    assert combine(t, f) == pytest.approx(0.6 + 0.071)
    assert combine(t, f, decode=True) == pytest.approx(0.9 + 0.071)
    # the fit's row carries both sides: [prefill scale, decode scale, 1/eff, comm, overhead, tp step,
    # wake, attention scale]
    assert calibrate._columns(t, True, f) == [0.0, 0.1, 0.2, 0.02, 1.0, 1.0, 0.0, 0.0]
    assert calibrate._columns({**t, "serial": 0.0}, True, f) == [0.0, 0.1, 0.0, 0.02, 1.0, 1.0, 0.0, 0.0]
    # a decode step's attention parts (0.04 s of its compute, 0.05 s of its memory) move to the
    # attention column at the current scale and efficiency: 0.04 x 5 + 0.05 / 0.5 = 0.3
    ta = {**t, "attn_compute_s": 0.04, "attn_memory_s": 0.05}
    assert calibrate._columns(ta, True, f) == pytest.approx([0.0, 0.06, 0.15, 0.02, 1.0, 1.0, 0.0, 0.3])
    # held at 3 (fold): compute 0.1 + 2 x 0.04, memory 0.2 + 2 x 0.05, no attention column
    assert calibrate._columns(ta, True, {**f, "decode_attention_scale": 3.0}, fold=True) == \
        pytest.approx([0.0, 0.18, 0.3, 0.02, 1.0, 1.0, 0.0, 0.0])
    # combine: x 3 on the attention parts: (0.1 + 0.08) x 5 + (0.2 + 0.1) / 0.5 = 1.5, + 0.071
    assert combine(ta, {**f, "decode_attention_scale": 3.0}, decode=True) == pytest.approx(1.5 + 0.071)
    assert combine(ta, {**f, "decode_attention_scale": 3.0}) == pytest.approx(0.6 + 0.071)  # prefill: no


def test_wake_seconds_on_steps_after_an_idle_wait():
    # the first step after an idle wait pays serve_wake_s: combine adds it, the fit's last column
    # carries it, and a run whose idle steps are 3 ms slower fits serve_wake_s = 3 ms
    f = {"prefill_compute_scale": 2.0, "decode_compute_scale": 5.0, "decode_bw_efficiency": 0.5,
         "serve_comm_scale": 3.0, "serve_step_overhead_s": 0.001, "serve_tp_step_s": 0.01, "serve_wake_s": 0.003}
    t = {"compute_s": 0.1, "memory_s": 0.2, "comm_s": 0.0, "tp_steps": 0.0, "serial": 1.0, "wake": 1.0}
    assert combine(t, f) == pytest.approx(0.6 + 0.001 + 0.003)
    assert calibrate._columns(t, False, f)[6] == 1.0
    runs = synthetic(tps=(1,))
    for s in runs[0]["prefills"]:
        s["after_idle"] = True
        s["time_s"] += 0.003
    runs[0]["prefills"] += [{**s, "after_idle": False, "time_s": s["time_s"] - 0.003} for s in list(runs[0]["prefills"])]
    g = calibrate.fit_serving(runs)
    assert g["serve_wake_s"] == pytest.approx(0.003, rel=1e-6)
    assert g["prefill_compute_scale"] == pytest.approx(TRUE["prefill_compute_scale"], rel=1e-6)


def test_fit_targets_each_groups_mean_step_time():
    # two decode steps of one batch size in one run, 10 ms and 30 ms, only the per-step overhead
    # to fit: the group's mean, 20 ms (simulate needs mean step times). Relative errors of the
    # single steps would give (1/0.01 + 1/0.03) / (1/0.01^2 + 1/0.03^2) = 12 ms.
    zero = {"compute_s": 0.0, "memory_s": 0.0, "comm_s": 0.0, "tp_steps": 0.0}
    obs = [(zero, 0.01, True), (zero, 0.03, True)]
    f = {**calibrate.SERVE_DEFAULTS}
    g = calibrate._fit_from(obs, np.array([0.01, 0.03]), f, 5, np.array([0, 0]))
    assert g["serve_step_overhead_s"] == pytest.approx(0.02)
    # two groups (batch 1 at 10 ms x 1 step, batch 2 at 30 ms x 3 steps): weighted by step count,
    # relative: minimise 1 x (x/0.01 - 1)^2 + 3 x (x/0.03 - 1)^2 -> x = (100 + 100) / (1e4 + 3333.3) = 15 ms
    obs = [(zero, 0.01, True)] + [(zero, 0.03, True)] * 3
    g = calibrate._fit_from(obs, np.array([0.01, 0.03, 0.03, 0.03]), f, 5, np.array([0, 1, 1, 1]))
    assert g["serve_step_overhead_s"] == pytest.approx(0.015)


def test_attention_scale_recovered_from_two_model_sizes():
    """decode_attention_scale is told apart from the bandwidth share once two model sizes give
    two weight reads (one model: the weight read moves with the fixed seconds, and the scale
    keeps its value, test_recovers_known_factors). Steps generated with it at 6 are fitted back."""
    global MODEL
    true = {**TRUE, "decode_attention_scale": 6.0}
    saved = MODEL
    try:
        runs = synthetic(factors=true)
        MODEL = scale(preset("chatglm3-6b"), "small")
        runs += synthetic(factors=true)
    finally:
        MODEL = saved
    f = calibrate.fit_serving(runs)
    for k, v in true.items():
        assert f[k] == pytest.approx(v, rel=1e-5), k
    assert calibrate.fit_serving(runs[:2])["decode_attention_scale"] == 1.0  # one size: held


def test_columns_take_the_binding_side_with_the_attention_scale():
    """GPU (max): which side binds is decided with the attention parts scaled. compute 0.3 s (0.1 of
    it attention), memory 0.4 s: at scale 1 memory binds (0.3 < 0.4); at 3 compute does (0.5 >= 0.4)."""
    f = {"prefill_compute_scale": 1.0, "decode_compute_scale": 1.0, "decode_bw_efficiency": 1.0,
         "serve_comm_scale": 1.0, "serve_step_overhead_s": 0.0, "serve_tp_step_s": 0.0}
    t = {"compute_s": 0.3, "memory_s": 0.4, "comm_s": 0.0, "tp_steps": 0.0, "serial": 0.0,
         "attn_compute_s": 0.1, "attn_memory_s": 0.05}
    # memory-bound: memory less its attention part, and the attention column its memory part / eff
    assert calibrate._columns(t, True, {**f, "decode_attention_scale": 1.0}) == \
        pytest.approx([0.0, 0.0, 0.35, 0.0, 1.0, 0.0, 0.0, 0.05])
    # compute-bound at 3 (0.3 + 2 x 0.1 = 0.5 >= 0.4 + 2 x 0.05 = 0.5, a tie): compute less its attention part, the
    # attention column its compute part x scale
    assert calibrate._columns(t, True, {**f, "decode_attention_scale": 3.0}) == \
        pytest.approx([0.0, 0.2, 0.0, 0.0, 1.0, 0.0, 0.0, 0.1])
    # the same terms as a prefill: no attention scale, no attention column; 0.3 < 0.4: memory binds
    assert calibrate._columns(t, False, {**f, "decode_attention_scale": 3.0}) == \
        pytest.approx([0.0, 0.0, 0.4, 0.0, 1.0, 0.0, 0.0, 0.0])


def test_columns_binding_side_weighs_memory_by_its_efficiency():
    """compute 0.3 s (0.1 attention), memory 0.2 s (0.05 attention) at 50% of the bandwidth: at
    scale 3 compute is 0.5 s and memory (0.2 + 2 x 0.05) / 0.5 = 0.6 s, so memory binds; its
    column is memory less the attention part, the attention column 0.05 / 0.5."""
    f = {"prefill_compute_scale": 4.0, "decode_compute_scale": 1.0, "decode_bw_efficiency": 0.5,
         "serve_comm_scale": 1.0, "serve_step_overhead_s": 0.0, "serve_tp_step_s": 0.0,
         "decode_attention_scale": 3.0}
    t = {"compute_s": 0.3, "memory_s": 0.2, "comm_s": 0.0, "tp_steps": 0.0, "serial": 0.0,
         "attn_compute_s": 0.1, "attn_memory_s": 0.05}
    assert calibrate._columns(t, True, f) == pytest.approx([0.0, 0.0, 0.15, 0.0, 1.0, 0.0, 0.0, 0.1])
    # a prefill of the same terms at prefill_compute_scale 4: 1.2 s of compute beats 0.4 s of memory
    assert calibrate._columns(t, False, f) == pytest.approx([0.3, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0])
