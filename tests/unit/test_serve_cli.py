"""`planner serve` through the CLI entry point: the run directory and bad input (one line, exit 2,
nothing written)."""
from __future__ import annotations

import json

import pytest

from planner.cli import main

BASE = ["serve", "--model", "chatglm3-6b", "--gpus", "1xA100", "--prompt-len", "512", "--output-len", "256",
        "--weight-precision", "bf16", "--requests", "40"]


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_writes_run_directory(capsys, tmp_path):
    rc, out, err = run(capsys, *BASE, "--max-batch", "64", "--target-p50-ms", "5000", "--out-dir", str(tmp_path),
                       "--name", "s")
    assert rc == 0, err
    d = tmp_path / "s"
    assert sorted(p.name for p in d.iterdir()) == ["serve_plan.json", "serve_report.html", "serve_top.json",
                                                   "vllm_serve.sh"]
    plan = json.loads((d / "serve_plan.json").read_text())
    assert plan["deployment"]["max_batch"] == 64 and plan["estimate"]["meets_target"] is True
    assert plan["estimate"]["qps_at_target"] > 0 and plan["inputs"]["workload"]["prompt_len"] == 512
    sh = (d / "vllm_serve.sh").read_text()
    assert "vllm serve" in sh and "--tensor-parallel-size 1" in sh and "--max-num-seqs 64" in sh
    assert "--gpu-memory-utilization 0.9" in sh and "--kv-cache-dtype" not in sh   # A100: no fp8
    html = (d / "serve_report.html").read_text()
    assert "data:image/png;base64," in html and "TTFT p99 ms" in html and "TPOT p99 ms" in html
    # the built-in A100 profile has no fitted serving factors: the report and the plan say so
    assert "uncalibrated: serving factors at their defaults; kernel times measured (vidur, A100-80GB)" in html
    assert plan["inputs"]["calibration"].startswith("uncalibrated") and "(uncalibrated" in out
    assert "white-space:pre-wrap" in html and "--port 8000 &" in html      # the whole command, wrapped
    assert "QPS@target" in out


def test_fp8_on_hopper(capsys, tmp_path):
    rc, _, err = run(capsys, *BASE, "--gpus", "1xH100-SXM", "--max-batch", "64", "--kv-precision", "fp8",
                     "--out-dir", str(tmp_path), "--name", "h")
    assert rc == 0, err
    assert "--kv-cache-dtype fp8" in (tmp_path / "h" / "vllm_serve.sh").read_text()


@pytest.mark.parametrize("extra,needle", [
    (["--target-p50-ms", "50"], "closest:"),
    (["--target-qps", "100000"], "short of 100000"),
    (["--kv-precision", "fp8"], "fp8"),
    (["--prompt-len", "8000"], "context of 8192"),
    (["--target-p50-ms", "-3"], "--target-p50-ms"),
    (["--target-p50-ms", "100", "--target-qps", "3"], "one target"),
    (["--prompt-len", "0"], "--prompt-len"),
    (["--tp", "3"], "--tp"),
    (["--rate-qps", "-1"], "--rate-qps"),
    (["--rate-qps", "nan"], "--rate-qps"),
    (["--rate-qps", "5", "--concurrency", "4"], "give one of them"),
    (["--concurrency", "-2"], "--concurrency"),
    (["--concurrency", "30"], "30 users need at least 60 --requests"),   # BASE: 40 requests
    (["--trace", "/nonexistent/trace.csv"], "cannot read"),
    (["--weight-precision", "fp8"], "FP8"),                  # A100: no FP8 tensor cores
    (["--kv-precision", "int8"], "no int8 KV cache"),        # neither engine has one
    (["--prefix-len", "600"], "--prefix-len"),
    (["--mean-output-len", "5000"], "--mean-output-len"),    # above --output-len
])
def test_bad_input_one_line(capsys, tmp_path, extra, needle):
    rc, out, err = run(capsys, *BASE, "--max-batch", "16", *extra, "--out-dir", str(tmp_path), "--name", "bad")
    assert rc == 2
    assert err.startswith("error:") and err.count("\n") == 1 and needle in err
    assert not (tmp_path / "bad").exists()


def test_variant_side_by_side_in_report(capsys, tmp_path):
    """--variant: serve_plan.json and serve_report.html carry the base and the variant on the best
    deployment, side by side (linear attention: no KV bytes per token; chatglm3-6b bf16: K and V x 28
    layers x 2 KV groups x 128 x 2 bytes = 28,672)."""
    rc, out, err = run(capsys, *BASE, "--max-batch", "64", "--out-dir", str(tmp_path), "--name", "v",
                       "--variant", "linear-attention")
    assert rc == 0, err
    d = tmp_path / "v"
    cmp = json.loads((d / "serve_plan.json").read_text())["variant_comparison"]
    assert cmp["base"] == "chatglm3-6b" and cmp["variant"].startswith("chatglm3-6b+")
    rows = {r["figure"]: r for r in cmp["rows"]}
    assert rows["KV bytes per token"]["base"] == "28,672" and rows["KV bytes per token"]["variant"] == "0"
    html = (d / "serve_report.html").read_text()
    assert 'id="variant"' in html and "KV bytes per token" in html and "28,672" in html
    assert "# variant chatglm3-6b+linattn" in (d / "vllm_serve.sh").read_text()
    rc, _, err = run(capsys, *BASE, "--max-batch", "64", "--out-dir", str(tmp_path), "--name", "b")
    assert rc == 0 and "variant_comparison" not in (tmp_path / "b" / "serve_plan.json").read_text()
    assert 'id="variant"' not in (tmp_path / "b" / "serve_report.html").read_text()


def test_engines_and_workloads(capsys, tmp_path):
    """SGLang's script; N closed-loop users; a trace file; a rate above saturation answered with
    the queue's growth instead of refused."""
    rc, out, err = run(capsys, *BASE, "--max-batch", "16", "--engine", "sglang", "--concurrency", "8",
                       "--out-dir", str(tmp_path), "--name", "sg")
    assert rc == 0, err
    assert "sglang.launch_server" in (tmp_path / "sg" / "sglang_serve.sh").read_text()
    assert "closed loop, 8 users" in out
    plan = json.loads((tmp_path / "sg" / "serve_plan.json").read_text())
    assert plan["inputs"]["workload"]["concurrency"] == 8 and plan["deployment"]["engine"] == "sglang"
    trace = tmp_path / "trace.csv"
    trace.write_text("prompt,output\n200,50\n900,120\n")
    rc, out, err = run(capsys, *BASE, "--max-batch", "16", "--trace", str(trace), "--rate-qps", "1000",
                       "--out-dir", str(tmp_path), "--name", "tr")
    assert rc == 0, err
    est = json.loads((tmp_path / "tr" / "serve_plan.json").read_text())["estimate"]
    assert est["overloaded"] and est["backlog_growth_qps"] == pytest.approx(1000 - est["max_qps"])
    assert "overloaded: 1000 requests/s offered" in out
    assert json.loads((tmp_path / "tr" / "serve_plan.json").read_text())["inputs"]["workload"]["trace"] == \
        [[200, 50], [900, 120]]


def test_trace_beyond_the_context_names_the_trace(capsys, tmp_path):
    """A trace line longer than the model's context is the trace's fault, not --prompt-len's."""
    trace = tmp_path / "t.csv"
    trace.write_text("100,20\n8000,300\n")
    rc, _, err = run(capsys, *BASE, "--max-batch", "16", "--trace", str(trace), "--out-dir", str(tmp_path),
                     "--name", "bad")
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith("error: --trace: its longest request, prompt + output = 8300 tokens, exceeds")
    assert not (tmp_path / "bad").exists()
