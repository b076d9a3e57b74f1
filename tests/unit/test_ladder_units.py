"""The ladder (issue 12): legal rungs, one technique a rung, gains that multiply to the
baseline-to-plan ratio, the article's figures beside ours, --order and the bad inputs."""
from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pytest

from planner.cli import main
from planner.cost import estimate
from planner.errors import SpecError
from planner.ladder import TECHNIQUES, build, parse_order
from planner.ladder import claims
from planner.ladder.techniques import DERIVED, FIELDS, Rung, compose, differing
from planner.rundir import atomic_write_json, plan_document
from planner.search.baseline import baseline_train, conventional_baseline
from planner.specs import Plan, TrainSpec, parse_cluster, preset, scale
from planner.specs.validate import plan_problems

SHARES = {"static": 0.4, "dynamic": 0.96}
"""Fixed real-token shares, so the ratio below is computed by hand from two estimates."""


def inputs(model="glm-10b", gpus="8xA100", batch=64, seq=1024, size=None):
    return scale(preset(model), size), parse_cluster(gpus), TrainSpec(global_batch=batch, seq_len=seq)


CASES = {
    # ZeRO-1 DP 8 with larger buckets and micro-batch 2: the demo's kind of plan
    "dp-zero1": (inputs(), Plan(dp=8, zero=1, micro_batch=2, grad_accum=4, bucket_elements=200_000_000)),
    # GLM-130B's published 3D layout: every technique changes something
    "3d": (inputs("glm-130b", "4x8xA100", 48, 2048),
           Plan(dp=1, tp=8, pp=4, zero=1, micro_batch=1, grad_accum=48, recompute="full", sequence_parallel=True)),
    # ZeRO-3 with offload and checkpointing of some layers, plain DP
    "zero3": (inputs("chatglm3-6b", "8xA100", 64, 2048),
              Plan(dp=8, zero=3, micro_batch=4, grad_accum=2, recompute="full", recompute_layers=(20,),
                   offload_optimizer="cpu")),
}


def test_every_plan_field_belongs_to_exactly_one_technique():
    owned = [f for fs in FIELDS.values() for f in fs] + list(DERIVED)
    assert sorted(owned) == sorted(f.name for f in dataclasses.fields(Plan))
    assert set(FIELDS) == set(TECHNIQUES)


@pytest.mark.parametrize("case", sorted(CASES))
def test_rungs_are_legal_differ_by_one_technique_and_multiply_to_the_ratio(case):
    (m, c, t), plan = CASES[case]
    assert plan_problems(m, c, t, plan) == []
    lad = build(m, c, t, plan, shares=SHARES)
    rungs = lad["rungs"]
    legal = [r for r in rungs if "illegal" not in r]
    assert legal[0]["technique"] == "baseline" and lad["reaches_plan"]
    assert Plan.from_dict(legal[-1]["plan"]) == plan
    prev = None
    for r in legal:
        p = Plan.from_dict(r["plan"])
        tr = dataclasses.replace(t, global_batch=r["global_batch"], precision=p.precision)
        assert plan_problems(m, c, tr, p) == [], r["description"]
        if prev is not None:
            a = Rung(frozenset(), Plan.from_dict(prev["plan"]), prev["batching"], prev["global_batch"])
            b = Rung(frozenset(), p, r["batching"], r["global_batch"])
            assert differing(a, b, m.layers) == set(r["adds"]), (prev["description"], r["description"])
        prev = r
    # the ratio, by hand: the plan's and the fp32 baseline's all-token tokens/s times their real shares
    base, best = conventional_baseline(m, c, t, precision="fp32")
    pest = estimate(m, c, t, plan)
    ratio = (pest.tokens_per_s * SHARES["dynamic"]) / (best.tokens_per_s * SHARES["static"])
    assert math.prod(r["gain"] for r in legal[1:]) == pytest.approx(ratio, rel=1e-9)
    assert lad["ratio"]["throughput"] == pytest.approx(ratio, rel=1e-12)
    assert math.prod(r["memory_ratio"] for r in legal[1:]) == pytest.approx(
        pest.peak_memory_gb / best.peak_memory_gb, rel=1e-9)
    # every technique the plan uses is on the ladder once (in a rung's adds), the others say why not
    used = [a for r in legal[1:] for a in r["adds"]]
    assert sorted(used + [u["technique"] for u in lad["unchanged"]]) == sorted(TECHNIQUES)


def test_the_3d_plan_climbs_in_the_article_order():
    (m, c, t), plan = CASES["3d"]
    lad = build(m, c, t, plan, shares=SHARES)
    assert [r["technique"] for r in lad["rungs"]] == ["baseline", *TECHNIQUES]
    first = lad["rungs"][0]
    assert first["plan"]["precision"] == "fp32" and first["plan"]["dp"] == 32 and first["plan"]["zero"] == 0
    assert first["batching"] == "static" and first["plan"]["overlap_comm"] is False
    rc = lad["rungs"][5]  # checkpointing before the layout: all 32 blocks of plain DP's one stage
    assert rc["plan"]["recompute"] == "full" and rc["plan"]["pp"] == 1
    # the overlap rung under ZeRO-0 is inert (DeepSpeed ignores overlap_comm there) and predicted so
    ov = lad["rungs"][2]
    assert ov["inert"] and ov["gain"] == pytest.approx(1.0)


def test_a_rung_made_illegal_is_skipped_and_its_technique_arrives_with_the_next():
    # 8 GPUs, global batch 16: plain DP leaves 2 sequences per rank; the plan's micro-batch 16
    # (TP 8) cannot run before the layout gives it the 16 sequences of one DP rank
    m, c, t = inputs(batch=16)
    plan = Plan(dp=1, tp=8, micro_batch=16, grad_accum=1)
    lad = build(m, c, t, plan, shares=SHARES)
    rec = next(r for r in lad["rungs"] if r["technique"] == "recompute")
    assert "micro-batch 16 x DP 8 does not divide the global batch 16" in rec["illegal"]
    lay = next(r for r in lad["rungs"] if r["technique"] == "layout")
    assert lay["adds"] == ["recompute", "layout"] and Plan.from_dict(lay["plan"]) == plan


def test_order_and_each_alone():
    (m, c, t), plan = CASES["dp-zero1"]
    default = build(m, c, t, plan, shares=SHARES)
    zero_first = build(m, c, t, plan, order=parse_order("zero,overlap"), shares=SHARES, each_alone=True)
    assert [r["technique"] for r in zero_first["rungs"]][:3] == ["baseline", "zero", "overlap"]
    assert zero_first["ratio"]["throughput"] == pytest.approx(default["ratio"]["throughput"], rel=1e-12)
    ov = zero_first["rungs"][2]
    assert not ov["inert"]  # after ZeRO-1, overlap_comm and buckets are DeepSpeed's to use
    alone = {r["technique"]: r for r in zero_first["alone"]}
    assert alone["overlap"]["gain"] == pytest.approx(1.0)   # on ZeRO-0 alone it does nothing
    assert alone["batching"]["gain"] == pytest.approx(SHARES["dynamic"] / SHARES["static"])


def test_parse_order():
    assert parse_order(None) == TECHNIQUES
    assert parse_order("layout, zero") == ("layout", "zero", "precision", "overlap", "batching", "recompute")
    with pytest.raises(SpecError, match="unknown technique 'fp16'"):
        parse_order("precision,fp16")
    with pytest.raises(SpecError, match="named twice"):
        parse_order("zero,precision,zero")


def test_compose_by_hand():
    base = Plan(dp=8, micro_batch=2, grad_accum=4, precision="fp32")
    target = Plan(dp=2, tp=2, pp=2, zero=1, micro_batch=4, grad_accum=8, recompute="full",
                  recompute_layers=(3, 2), stage_layers=(5, 5), precision="bf16")
    r = compose(target, base, frozenset({"recompute"}), world=8, base_batch=64, user_batch=64)
    assert r.plan == Plan(dp=8, micro_batch=4, grad_accum=2, precision="fp32", recompute="full",
                          recompute_layers=(5,), overlap_comm=False)
    r = compose(target, base, frozenset({"layout"}), world=8, base_batch=64, user_batch=64)
    assert r.plan == Plan(dp=2, tp=2, pp=2, stage_layers=(5, 5), micro_batch=2, grad_accum=16, precision="fp32",
                          overlap_comm=False)
    assert r.batching == "static"
    # the baseline's rounded-up global batch until the layout is applied (GLM-130B: 4224 on 768 -> 4608)
    r = compose(target, base, frozenset(), world=8, base_batch=80, user_batch=64)
    assert r.global_batch == 80 and r.plan.grad_accum == 5
    r = compose(target, base, frozenset({"layout"}), world=8, base_batch=80, user_batch=64)
    assert r.global_batch == 64 and r.plan.grad_accum == 16


def test_claims_by_hand():
    t = {"forward": 2.0, "backward": 4.0, "recompute": 0.0, "dp_sync": 1.0, "tp_comm": 0.5, "optimizer": 0.5,
         "pp_comm": 0.0, "zero_gather": 0.0}
    assert claims.comm_share(t, 8.0) == pytest.approx(1.5 / 8.0)
    assert claims.compute_per_token(t, 100) == pytest.approx(0.06)
    mem = {"optimizer": 12.0, "activations": 8.0}
    before = {"time_breakdown_s": t, "tokens_per_step": 100, "comm_share": 0.3, "real_share": 0.4,
              "memory_breakdown_gb": mem, "plan": {"micro_batch": 2, "recompute": "none"}, "tokens_per_s": 10.0}
    t2 = dict(t, forward=0.5, backward=1.0, recompute=0.5)
    after = dict(before, time_breakdown_s=t2, memory_breakdown_gb={"optimizer": 3.0, "activations": 4.8},
                 plan={"micro_batch": 4, "recompute": "full"}, comm_share=0.1, real_share=0.96)
    assert claims.ours("precision", before, after)["ours"] == pytest.approx(6.0 / 2.0)
    assert claims.ours("zero", before, after)["ours"] == pytest.approx(0.25)
    rc = claims.ours("recompute", before, after)
    assert rc["ours"] == pytest.approx((4.8 / 4) / (8.0 / 2))            # 0.30x per sequence, the article's 70% less
    assert rc["compute_ratio"] == pytest.approx(2.0 / 6.0)
    ov = claims.ours("overlap", before, after)
    assert (ov["before"], ov["ours"]) == (0.3, 0.1)
    assert claims.fmt_value(0.123, "%") == "12%" and claims.fmt_value(2.8, "x") == "2.80x"


def _run_dir(tmp_path, m, c, t, plan, name="run"):
    d = tmp_path / name
    atomic_write_json(d / "plan.json", plan_document(plan, m, c, t, command="test"))
    return d


def test_cli_writes_ladder_and_waterfalls(tmp_path, capsys):
    m, c, t = inputs("chatglm3-6b", "2xcpu", 8, 128, "tiny")
    d = _run_dir(tmp_path, m, c, t, Plan(dp=2, zero=3, micro_batch=4, grad_accum=1))
    assert main(["ladder", str(d), "--each-alone"]) == 0
    out = capsys.readouterr().out
    assert "baseline -> plan (predicted)" in out and "each technique alone" in out
    lad = json.loads((d / "ladder.json").read_text())
    assert lad["reaches_plan"] and lad["alone"]
    for name in ("ladder-throughput.png", "ladder-memory.png"):
        assert (d / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, field", [(["--order", "zero,zero"], "--order"), (["--order", "tp"], "--order"),
                                         (["--steps", "2", "--warmup", "2"], "--steps/--warmup")])
def test_cli_bad_input_is_one_line_exit_2_nothing_written(tmp_path, capsys, args, field):
    m, c, t = inputs("chatglm3-6b", "2xcpu", 8, 128, "tiny")
    d = _run_dir(tmp_path, m, c, t, Plan(dp=2, zero=1, micro_batch=4, grad_accum=1))
    assert main(["ladder", str(d), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {field}") and "\n" not in err
    assert sorted(p.name for p in d.iterdir()) == ["plan.json"]


def test_cli_run_directory_without_a_plan(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["ladder", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err.strip()
    assert "plan.json" in err and "does not exist" in err and "\n" not in err
    assert list((tmp_path / "empty").iterdir()) == []


def test_predicted_ladder_needs_no_torch():
    code = ("import sys; from planner.ladder import build; from planner.ladder.text import lines; "
            "from planner.specs import Plan, TrainSpec, parse_cluster, preset; "
            "l = build(preset('glm-10b'), parse_cluster('8xA100'), TrainSpec(global_batch=64, seq_len=1024), "
            "Plan(dp=8, zero=1, micro_batch=2, grad_accum=4)); lines(l); "
            "assert 'torch' not in sys.modules and 'deepspeed' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_report_has_a_ladder_section(tmp_path):
    from planner.report import write_report
    m, c, t = inputs("chatglm3-6b", "2xcpu", 8, 128, "tiny")
    plan = Plan(dp=2, zero=1, micro_batch=4, grad_accum=1)
    d = _run_dir(tmp_path, m, c, t, plan)
    atomic_write_json(d / "estimate.json", {"plan": plan.to_dict(), "estimate": estimate(m, c, t, plan).to_json()})
    html = write_report(d).read_text()
    assert 'id="ladder"' in html and "No ladder yet" in html
    assert main(["ladder", str(d)]) == 0
    html = write_report(d).read_text()
    assert 'id="ladder-table"' in html and 'id="img-ladder_throughput"' in html and 'id="img-ladder_memory"' in html
    assert "35% -&gt; 12%" in html  # the article's figure beside ours


def test_waterfall_labels_are_short():
    from planner.ladder.plots import _label
    assert [_label(x) for x in (629, 9359, 21337, 1.2e6, 0.482)] == ["629", "9.4k", "21.3k", "1.2M", "0.482"]


def test_measured_optimizer_states_leave_out_buckets():
    """The zero rung's measured figure: the optimizer class of metrics.json's model states (a
    tiny ZeRO-3 run's figures), device plus host, not ZeRO-3's 100 MB reduce bucket (buckets)."""
    from planner.ladder.measure import optimizer_gb
    zero3 = {"params": 0.00112448, "grads": 0.00112448, "optimizer": 0.006746884, "buckets": 0.1, "other": 0.0}
    offload = {"params": 0.0022, "grads": 0.0, "optimizer": 0.000001, "buckets": 0.0, "other": 0.0}
    assert optimizer_gb({"model_state_breakdown_gb_per_rank": [zero3, zero3]}) == 0.006746884
    assert optimizer_gb({"model_state_breakdown_gb_per_rank": [offload],
                         "host_model_state_breakdown_gb_per_rank": [{"optimizer": 0.0135}]}) == pytest.approx(0.013501)
    assert optimizer_gb({}) is None
    from planner.ladder.measure import states_gb
    assert states_gb({"model_state_breakdown_gb_per_rank": [zero3, {**zero3, "grads": 0.002}],
                      "host_model_state_breakdown_gb_per_rank": [{"optimizer": 0.01}, {}]}) == {
        "params": 0.00112448, "grads": 0.002, "optimizer": pytest.approx(0.016746884), "buckets": 0.1, "other": 0.0}


def test_measured_rungs_print_the_prediction_error_and_allocated_peak():
    """Each measured rung: its gain's error against the measurement ((predicted - measured) /
    measured) and the allocated peak beside peak RSS; the whole ladder's too."""
    from planner.ladder.text import _err, rung_lines
    assert (_err(2.3, 2.0), _err(1.7, 2.0), _err(None, 2.0), _err(1.5, None)) == ("+15%", "-15%", "-", "-")
    rung = {"index": 1, "technique": "precision", "tokens_per_s": 2300.0, "gain": 2.3, "step_time_s": 0.5,
            "comm_share": 0.0, "padding_share": 0.0, "peak_memory_gb": 0.3, "feasible": True, "memory_ratio": 0.8,
            "measured": {"tokens_per_s": 2000.0, "gain": 2.0, "peak_memory_gb": 0.45, "allocated_peak_gb": 0.025}}
    line = rung_lines([rung], measured=True)[1]
    assert line.endswith("|     2,000  2.00x   +15%    0.025    0.450")


def test_ours_names_its_metric_so_it_is_not_a_second_gain() -> None:
    """precision's gain column (tokens/s, 14.88x on glm-10b 8xA100) and our figure beside the
    article (compute per token, 15.17x) were two unlabelled "x" figures for one rung."""
    from planner.ladder.claims import CLAIMS, ours_text
    c = {"ours": 15.17, "unit": "x", "short": "compute/token"}
    assert ours_text(c) == "15.17x compute/token"
    assert ours_text({"ours": 0.97, "before": 0.43, "unit": "%", "metric": CLAIMS["batching"].metric}) == \
        "43% -> 97% real tokens"                     # a ladder.json without "short": named by its metric
    assert ours_text({"ours": 0.08, "unit": "x", "short": "activations/seq", "compute_ratio": 1.3}) == \
        "0.08x activations/seq, compute +30%"
    assert ours_text({"ours": None, "unit": "x"}) == "-"
    assert len({v.short for v in CLAIMS.values()}) == len(CLAIMS)
