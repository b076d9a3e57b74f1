"""benchmarks/serve_published_rows.json: every published serving figure carries its source, a GPU
the profiles know, a known metric and positive settings; the model shapes reproduce the published
parameter counts; a malformed row is refused with one line, not a traceback."""
from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from planner.errors import SpecError
from planner.specs import find_device

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "benchmarks" / "serve_published_rows.json"


def _bench():
    spec = importlib.util.spec_from_file_location("serve_published", ROOT / "benchmarks" / "serve_published.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["serve_published"] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


sp = _bench()
RAW = json.loads(DATA.read_text())
KNOWN_METRICS = {"ttft_s", "e2e_s", "tpot_s", "output_tok_s", "decode_tok_s", "max_qps", "memory_gb", "req_s",
                 "ttft_p50_s", "ttft_p99_s"}


def test_every_row_has_a_source_a_known_gpu_a_known_metric_and_positive_values():
    rows = RAW["rows"]
    assert 30 <= len(rows) <= 60
    assert len({r["id"] for r in rows}) == len(rows)
    for r in rows:
        assert r["source"] in RAW["sources"] and RAW["sources"][r["source"]].strip(), r["id"]
        assert r["where"].strip() and isinstance(r["assumptions"], list), r["id"]
        find_device(r["gpu"])  # raises SpecError for a GPU without a profile
        assert r["metric"] in KNOWN_METRICS, r["id"]
        assert r["value"] > 0, r["id"]
        for key in ("gpus", "tp", "prompt_len", "output_len", "batch"):
            assert isinstance(r[key], int) and r[key] >= 1, (r["id"], key)
        assert r["gpus"] % r["tp"] == 0
    assert set(sp.METRICS) == KNOWN_METRICS
    # both GPU generations the issue names, and rows that enter the error summary
    assert {find_device(r["gpu"])[0].name for r in rows} >= {"A100-80GB", "H100-SXM"}
    assert sum(r["in_mape"] for r in rows) >= 8
    # nothing is fitted to these rows: all are validation rows
    assert RAW["calibration_rows"] == []
    # closed-loop rows name their concurrency and request count
    closed = [r for r in rows if "concurrency" in r]
    assert closed and all(r["concurrency"] >= 1 and r["requests"] >= r["concurrency"] for r in closed)


def test_rows_load_with_their_models_and_clusters():
    rows = {r.id: r for r in sp.load_rows()}
    assert len(rows) == len(RAW["rows"])
    # TensorRT-LLM's A100 FP16 first-token latency, LLaMA 7B, input 2048: 133 ms
    t2 = rows["T2"]
    assert (t2.prompt_len, t2.output_len, t2.batch, t2.tp, t2.metric, t2.value) == (2048, 1, 1, 1, "ttft_s", 0.133)
    assert t2.cluster.world_size == 1 and t2.cluster.device.name == "A100-80GB"
    assert rows["N3"].cluster.world_size == 2 and rows["N3"].tp == 2


def test_model_shapes_reproduce_the_published_parameter_counts():
    rows = {r.id: r for r in sp.load_rows()}
    # Llama-2-7B: 32 x (4 h^2 + 3 h 11008 + 2 h) + 2 x 32000 h + h, h = 4096
    h = 4096
    assert rows["T1"].model.params == 32 * (4 * h * h + 3 * h * 11008 + 2 * h) + 2 * 32000 * h + h == 6_738_415_616
    # Llama-3.1-8B: GQA, 8 KV heads of 128: q and o h^2 each, k and v h x 1024 each
    assert rows["V1"].model.params == 32 * (2 * h * h + 2 * h * 1024 + 3 * h * 14336 + 2 * h) + 2 * 128256 * h + h \
        == 8_030_261_248
    assert rows["V1"].model.kv_heads == 8
    # Llama-2-70B: 80 layers, h = 8192, GQA with 8 KV heads of 128 (k and v h x 1024), FFN 28672
    g = 8192
    assert rows["T9"].model.params == 80 * (2 * g * g + 2 * g * 1024 + 3 * g * 28672 + 2 * g) + 2 * 32000 * g + g \
        == 68_976_648_192
    assert rows["T9"].tp == 4 and rows["T9"].cluster.world_size == 4 and rows["T12"].weight_precision == "bf16"


def test_every_llama_row_of_the_low_latency_tables_is_a_row():
    # TensorRT-LLM performance.md (138f96d) Low Latency: LLaMA 7B on H100 FP8, L40S FP8, A100 FP16 and
    # LLaMA 70B TP 4 on H100 FP8 and A100 FP16, inputs 128 and 2048: 10 first-token latencies
    rows = [r for r in sp.load_rows() if r.source == "trtllm" and r.metric == "ttft_s"]
    got = {(r.model_name, r.cluster.device.name, r.tp, r.weight_precision, r.prompt_len): r.value for r in rows}
    assert got == {("llama-2-7b", "A100-80GB", 1, "bf16", 128): 0.016, ("llama-2-7b", "A100-80GB", 1, "bf16", 2048): 0.133,
                   ("llama-2-7b", "H100-SXM", 1, "fp8", 128): 0.007, ("llama-2-7b", "H100-SXM", 1, "fp8", 2048): 0.036,
                   ("llama-2-7b", "L40S", 1, "fp8", 128): 0.014, ("llama-2-7b", "L40S", 1, "fp8", 2048): 0.073,
                   ("llama-2-70b", "H100-SXM", 4, "fp8", 128): 0.026, ("llama-2-70b", "H100-SXM", 4, "fp8", 2048): 0.109,
                   ("llama-2-70b", "A100-80GB", 4, "bf16", 128): 0.047, ("llama-2-70b", "A100-80GB", 4, "bf16", 2048): 0.377}
    assert all(r.in_mape and r.output_len == 1 and r.batch == 1 for r in rows)


@pytest.mark.parametrize("field,value", [("metric", "qps"), ("gpu", "A200"), ("value", 0), ("batch", 0),
                                         ("source", "blog"), ("weight_precision", "fp4"),
                                         ("concurrency", 0), ("mean_output_len", 10_000),
                                         ("mean_output_len", "100"), ("scheduler", "v2")])
def test_a_malformed_row_is_refused_with_a_spec_error(tmp_path, field, value):
    data = copy.deepcopy(RAW)
    data["rows"][0][field] = value
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SpecError):
        sp.load_rows(path)
    assert sp.main(["--data", str(path)]) == 2


def test_mistral_shape_and_grouped_mape():
    rows = {r.id: r for r in sp.load_rows()}
    assert rows["M4q"].model.params == 7_248_023_552 and rows["M4q"].concurrency == 4
    out = sp.compare([rows["V2"], rows["M4q"]])
    assert set(out["groups"]) == {"TPOT", "throughput"}
    assert out["groups"]["TPOT"]["rows"] == 1 and out["groups"]["throughput"]["rows"] == 1


def test_closed_loop_rows_stop_at_end_of_sequence_as_the_source_table_says():
    rows = {r.id: r for r in sp.load_rows()}
    # Output Tok/s / Req/s of the source's table: ~100 tokens per request, under the 128 cap
    assert rows["M4t"].mean_output_len == 100 and rows["M4t"].output_len == 128
    assert sp.workload(rows["M4t"]).stop_probability() > 0
    assert rows["T1"].mean_output_len == 0 and sp.workload(rows["T1"]).stop_probability() == 0


def _sensitivity():
    spec = importlib.util.spec_from_file_location("serve_published_sensitivity",
                                                  ROOT / "benchmarks" / "serve_published_sensitivity.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sensitivity_spreads_keep_the_mean_and_the_cap():
    sens = _sensitivity()
    n = 4000
    cap_or_first = sens.output_lengths("cap-or-first", 100, 128, n, 0)
    assert set(cap_or_first) == {1, 128}
    # q = (128 - 100) / 127 of the requests stop after the first token: mean 100 up to sampling
    assert abs(sum(cap_or_first) / n - 100) < 3
    assert sens.output_lengths("fixed", 100, 128, 5, 0) == [100] * 5
    geo = sens.output_lengths("geometric", 100, 128, n, 0)
    assert max(geo) == 128 and min(geo) >= 1 and abs(sum(geo) / n - 100) < 3
    with pytest.raises(ValueError):
        sens.output_lengths("fixed", 200, 128, 5, 0)


def test_sensitivity_keeps_the_benchmarks_own_reading():
    # the (V1, geometric) reading is the benchmark's prediction; the spread of readings is a range
    sens = _sensitivity()
    rows = [r for r in sp.load_rows() if r.id in ("M4q", "M4f")]
    out = {x["id"]: x for x in sens.sensitivity(rows)}
    for r in rows:
        assert out[r.id]["default"] == pytest.approx(sp.predict(r)["predicted"], rel=1e-9)
        assert out[r.id]["min"] <= out[r.id]["default"] <= out[r.id]["max"]
    assert set(out["M4f"]["readings"]) == {f"{s}/{p}" for s in sens.SCHEDULERS for p in sens.SPREADS}
    # per scheduler: inside the range of that scheduler's own readings
    for r in rows:
        x = out[r.id]
        for sched in sens.SCHEDULERS:
            own = [v for k, v in x["readings"].items() if k.startswith(sched + "/")]
            assert x["inside_by"][sched] == (min(own) <= r.value <= max(own))
        assert x["inside"] == (x["min"] <= r.value <= x["max"])


def test_awaiting_first_token_is_littles_law_on_the_published_table():
    sens = _sensitivity()
    rows = [r for r in sp.load_rows() if r.id in ("M4q", "M4f", "M48q", "M48f", "M48m", "T1")]
    out = {x["concurrency"]: x for x in sens.awaiting_first_token(rows)}
    assert set(out) == {4, 48}  # static rows and a concurrency without both req_s and ttft_s: none
    # 11.87 req/s x 0.667 s = 7.917 users waiting of 48; 2.09 x 0.063 = 0.1317 of 4
    assert out[48]["waiting"] == pytest.approx(7.91729) and out[48]["share"] == pytest.approx(7.91729 / 48)
    assert out[4]["waiting"] == pytest.approx(0.13167)
    # V1's default budget on a 24 GB RTX 4090 is 2048 tokens: 8 whole 256-token prompts per step
    assert out[48]["prompts_per_step"] == 8 and out[4]["prompts_per_step"] == 8


def test_simulated_awaiting_takes_each_schedulers_largest_reading():
    sens = _sensitivity()
    rows = {r.id: r for r in sp.load_rows() if r.id in ("M48q", "M48f")}
    # hand-made readings: V1 geo 10 req/s x 0.5 s = 5, V1 fixed 12 x 0.6 = 7.2; V0 geo 9 x 1.0 = 9
    res = [{"id": "M48q", "metric": "req_s", "readings": {"vllm/geometric": 10.0, "vllm/fixed": 12.0,
                                                          "vllm-v0/geometric": 9.0}},
           {"id": "M48f", "metric": "ttft_s", "readings": {"vllm/geometric": 0.5, "vllm/fixed": 0.6,
                                                           "vllm-v0/geometric": 1.0}}]
    got = sens.simulated_awaiting(res, list(rows.values()))
    assert got == {48: {"vllm": pytest.approx(7.2), "vllm-v0": pytest.approx(9.0)}}
    text = sens.awaiting_table(sens.awaiting_first_token(list(rows.values())), got)
    assert "7.9 waiting" in text and "at most 7.2 (V1), 9.0 (V0)" in text


def test_ttft_contributions_rank_rows_by_their_share_of_the_mape():
    # hand-made comparison rows: |errors| 0.6, 0.3, 0.1 (sum 1.0) -> shares 60/30/10%, running 60/90/100%;
    # a row out of the MAPE or of another metric is not counted
    out = [{"id": "a", "metric": "ttft_s", "in_mape": True, "error": -0.3},
           {"id": "b", "metric": "ttft_p50_s", "in_mape": True, "error": 0.6},
           {"id": "c", "metric": "ttft_s", "in_mape": True, "error": -0.1},
           {"id": "d", "metric": "ttft_s", "in_mape": False, "error": 5.0},
           {"id": "e", "metric": "tpot_s", "in_mape": True, "error": 0.9}]
    by = sp.contributions(out, sp.GROUPS["TTFT"])
    assert [x["id"] for x in by] == ["b", "a", "c"]
    assert [x["share"] for x in by] == pytest.approx([0.6, 0.3, 0.1])
    assert [x["cumulative"] for x in by] == pytest.approx([0.6, 0.9, 1.0])
    # the benchmark's own TTFT group carries it, summing to the whole
    res = sp.compare([r for r in sp.load_rows() if r.id in ("T1", "T2", "L2")])
    assert res["groups"]["TTFT"]["by_row"][-1]["cumulative"] == pytest.approx(1.0)


def test_closed_loop_p99_ttft_rows_read_the_simulations_99th_percentile():
    from planner.serve.estimate import estimate_serving
    rows = {r.id: r for r in sp.load_rows()}
    r = rows["M48p"]
    assert r.metric == "ttft_p99_s" and r.concurrency == 48 and r.value == 1.483 and r.in_mape
    est = estimate_serving(r.model, r.cluster, sp.deployment(r), sp.workload(r), requests=r.requests)
    assert sp.predict(r)["predicted"] == pytest.approx(est.ttft_p99_s, rel=1e-12)
    assert est.ttft_p99_s > est.ttft_p50_s
    assert "ttft_p99_s" in sp.GROUPS["TTFT"]


def test_the_v0_reading_runs_whole_prompts_under_v0s_default_budget(tmp_path, monkeypatch, capsys):
    import dataclasses
    rows = {r.id: r for r in sp.load_rows()}
    r = rows["M48q"]
    assert r.scheduler == "vllm" and sp.deployment(r).engine == "vllm" and sp.deployment(r).prefill_chunk == 0
    v0 = dataclasses.replace(r, scheduler="vllm-v0")
    dep = sp.deployment(v0)
    # max(max_model_len, 2048): Mistral-7B-v0.3's 32,768-token context; Llama-2-7B's 4,096
    assert dep.engine == "vllm-v0" and dep.prefill_chunk == 32768
    assert sp.v0_budget(rows["T1"].model) == 4096
    assert sp.v0_budget(dataclasses.replace(rows["T1"].model, max_seq=1024)) == 2048
    # the what-if flag reaches the closed-loop rows only
    monkeypatch.setattr(sp, "OUT", tmp_path / "comparison.json")
    assert sp.main(["--rows", "M4q,T1", "--scheduler", "vllm-v0", "--json"]) == 0
    out = {x["id"]: x for x in json.loads(capsys.readouterr().out)["rows"]}
    assert out["M4q"]["predicted"] == pytest.approx(sp.predict(dataclasses.replace(rows["M4q"], scheduler="vllm-v0"))["predicted"])
    assert out["T1"]["predicted"] == pytest.approx(sp.predict(rows["T1"])["predicted"])
