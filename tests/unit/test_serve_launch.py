"""The launch script (planner/serve/launch.py), trace files (planner/serve/trace.py) and the
measured quantized-kernel curve (planner/serve/kernels.py)."""
from __future__ import annotations

import math

import pytest

from planner.errors import SpecError
from planner.serve import launch
from planner.serve.kernels import kernel_efficiency
from planner.serve.spec import Deployment, ServeEstimate, Workload
from planner.serve.trace import read_trace
from planner.specs.presets import preset

EST = ServeEstimate(deployment=Deployment(), feasible=True, ttft_s=0.05, tpot_s=0.01, e2e_p50_s=1.0, e2e_p99_s=2.0,
                    rate_qps=3.0, max_qps=4.0)
W = Workload(prompt_len=512, output_len=256)


def script(model: str, dep: Deployment, weights: str | None = None, budget: float = 2048) -> str:
    return launch.launch_script(preset(model), model, dep, W, EST, budget=budget, weights=weights)


def test_vllm_command_starts_as_written():
    sh = script("glm-4-9b", Deployment(max_batch=64))
    assert 'MODEL=${MODEL:-THUDM/glm-4-9b-chat-hf}' in sh
    # 768 tokens + 10% = 845 -> 1024 (a multiple of 256); no remote code for glm4; the budget passed
    assert "--max-model-len 1024" in sh and "--trust-remote-code" not in sh
    assert "--max-num-batched-tokens 2048" in sh and "--no-enable-prefix-caching" in sh
    assert "--quantization" not in sh
    # ChatGLM3's checkpoint carries its own modelling code
    assert "--trust-remote-code" in script("chatglm3-6b", Deployment())
    # a config.json path: the checkpoint is its directory, never the file
    assert launch.model_path("/ckpt/glm/config.json", None) == "/ckpt/glm"
    assert launch.model_path("/ckpt/glm/config.json", "org/quant-awq") == "org/quant-awq"


def test_quantized_weights_need_a_quantized_checkpoint():
    sh = script("chatglm3-6b", Deployment(weight_precision="int4"))
    assert ': "${MODEL:?weights int4 need an AWQ 4-bit checkpoint' in sh
    assert "--quantization" not in sh                      # the engine picks awq_marlin from the checkpoint
    sh = script("chatglm3-6b", Deployment(weight_precision="int4"), weights="me/chatglm3-awq")
    assert "MODEL=${MODEL:-me/chatglm3-awq}" in sh
    assert "--quantization fp8" in script("glm-4-9b", Deployment(weight_precision="fp8"))


def test_sglang_command():
    sh = script("glm-4-9b", Deployment(engine="sglang", tp=2, kv_precision="fp8", prefix_caching=True), budget=8192)
    assert "python -m sglang.launch_server --model-path \"$MODEL\"" in sh
    assert "--tp-size 2" in sh and "--context-length 1024" in sh and "--mem-fraction-static 0.87" in sh
    assert "--kv-cache-dtype fp8_e5m2" in sh and "--chunked-prefill-size 8192" in sh
    assert "--disable-radix-cache" not in sh
    assert "--disable-radix-cache" in script("glm-4-9b", Deployment(engine="sglang"))


def test_max_model_len_headroom_capped_at_the_context():
    m = preset("chatglm3-6b")                               # context 8192
    assert launch.max_model_len(m, Workload(prompt_len=4000, output_len=3500)) == 8192   # 8,250 -> 8,448, capped
    assert launch.max_model_len(m, Workload(prompt_len=4000, output_len=3000)) == 7936   # 7,700 -> 31 x 256
    assert launch.max_model_len(m, Workload(prompt_len=100, output_len=100)) == 256


def test_trace_file(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("prompt,output\n# a comment\n100, 20\n\n300\t40\n")
    assert read_trace(p) == ((100, 20), (300, 40))
    p.write_text('[[10, 2], {"input_len": 5, "output_len": 3}]')
    assert read_trace(p) == ((10, 2), (5, 3))
    for bad, needle in [("100,20\n5\n", "line 2: expected 2"), ("1,2\n3,x\n", "'x'"),
                        ("100,0\n", ">= 1"), ("", "no requests"), ("[1, 2]", "not a pair"), ("[[1.5, 2]]", "whole")]:
        p.write_text(bad)
        with pytest.raises(SpecError, match=needle) as e:
            read_trace(p)
        assert e.value.field == "--trace"
    with pytest.raises(SpecError, match="cannot read"):
        read_trace(tmp_path / "missing.csv")


def test_marlin_efficiency_curve():
    # Marlin / ideal speedup read off the README figure: 1 to 32 rows, 3.09 / 3.27 at 64, 1.55 / 1.64 at 128
    assert kernel_efficiency("int4", 1) == 1.0 and kernel_efficiency("int4", 16) == 1.0
    assert kernel_efficiency("int4", 64) == pytest.approx(3.09 / 3.27)
    assert kernel_efficiency("int4", 128) == pytest.approx(1.55 / 1.64)
    # beyond 128 rows: Marlin's bench.py on an A100 (vLLM PR #2497), the ideal being 1 (both compute-bound)
    assert kernel_efficiency("int4", 256) == pytest.approx(0.74)
    assert kernel_efficiency("int4", 2048) == pytest.approx(0.60)
    assert kernel_efficiency("int4", 8192) == kernel_efficiency("int4", 4000) == pytest.approx(0.61)  # held beyond
    # log-linear between the README's 128 (A10) and the A100's 256: halfway in log rows, halfway in efficiency
    assert kernel_efficiency("int4", 181) == pytest.approx((1.55 / 1.64 + 0.74) / 2, abs=1e-3)
    assert 3.09 / 3.27 < kernel_efficiency("int8", 48) < 3.82 / 3.85                  # log-linear between
    assert kernel_efficiency("bf16", 64) == 1.0
    assert math.isclose(kernel_efficiency("int4", 32), 3.82 / 3.85)


def test_fp8_efficiency_is_vllms_measured_speedup_over_the_ideal_2x():
    # vLLM PR #49363, H100, torch-bf16 vs fp8-tensor-w-token-a TFLOP/s, two gemma-4-31B shapes:
    # N=12288 K=5376 and N=43008 K=5376; the mean speedup of the two over the ideal 2x
    sp1 = (4.733311 / 2.870333 + 5.796762 / 3.072025) / 2            # 1 row: 1.768
    sp128 = (505.737658 / 352.560566 + 615.837656 / 364.745064) / 2  # 128 rows: 1.561
    assert kernel_efficiency("fp8", 1) == pytest.approx(sp1 / 2, abs=1e-4)
    assert kernel_efficiency("fp8", 128) == pytest.approx(sp128 / 2, abs=1e-4)
    assert kernel_efficiency("fp8", 2048) == kernel_efficiency("fp8", 128)          # held beyond
    assert kernel_efficiency("fp8", 128) < kernel_efficiency("fp8", 64) < kernel_efficiency("fp8", 1) < 1.0


def test_fp8_kernel_efficiency_slows_an_fp8_prefill_by_its_inverse(monkeypatch):
    # a compute-bound FP8 prefill on a GPU without measured block curves (L40S): its linear layers
    # take 1 / 0.78 of their ideal FP8 time (the measured efficiency at 128+ rows)
    import planner.serve.terms as terms
    from planner.specs import parse_cluster
    model, cluster = preset("glm-4-9b"), parse_cluster("1xL40S")
    dep = Deployment(weight_precision="fp8")
    slow = terms.step_terms(model, cluster, dep, [(2048, 0)])["compute_s"]
    monkeypatch.setattr(terms, "kernel_efficiency", lambda precision, rows: 1.0)
    ideal = terms.step_terms(model, cluster, dep, [(2048, 0)])["compute_s"]
    assert ideal * 1.15 < slow < ideal / kernel_efficiency("fp8", 2048) * 1.0001


def test_closed_loop_curve_is_over_the_users():
    # a closed-loop workload: the report's curve steps the users (2, 4, 6, 8), each point's rate is
    # what those users reach, and more users reach more requests/s here (the batch is not full)
    from planner.serve.estimate import estimate_serving
    from planner.serve.outputs import latency_curve
    from planner.specs import parse_cluster, scale
    model, cluster = scale(preset("chatglm3-6b"), "tiny"), parse_cluster("1xcpu")
    w = Workload(prompt_len=16, output_len=8, concurrency=8)
    est = estimate_serving(model, cluster, Deployment(max_batch=16), w, requests=40)
    pts = latency_curve(model, cluster, est, w, requests=40, seed=0, points=4)
    assert len(pts) == 4 and set(pts[0]) >= {"qps", "e2e_p50_s", "ttft_p99_s", "tpot_p50_s"}
    assert pts[0]["qps"] < pts[-1]["qps"] and pts[-1]["qps"] == pytest.approx(est.rate_qps)
