"""`planner estimate` / `planner search` through the CLI entry point: output and bad input."""
from __future__ import annotations

import json

import pytest

from planner.cli import main

GLM130 = ["--model", "glm-130b", "--gpus", "96x8xA100-40GB", "--global-batch", "4224", "--seq-len", "2048"]
KEYS = {"step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "hfu", "peak_memory_gb", "memory_breakdown_gb",
        "bubble_fraction", "feasible", "reasons"}


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_estimate_json(capsys):
    rc, out, err = run(capsys, "estimate", *GLM130, "--tp", "4", "--pp", "8", "--zero", "1", "--micro-batch", "1",
                       "--recompute", "selective", "--sequence-parallel", "--interleave", "2", "--json")
    assert rc == 0 and err == ""
    doc = json.loads(out)
    assert KEYS <= set(doc)
    assert doc["plan"]["dp"] == 24 and doc["plan"]["grad_accum"] == 176
    assert doc["plan"]["schedule"] == "interleaved" and doc["plan"]["sequence_parallel"]


def test_estimate_table_and_alias_note(capsys):
    rc, out, _ = run(capsys, "estimate", "--model", "glm-10b", "--gpus", "8xA100", "--tp", "2", "--zero", "1")
    assert rc == 0 and "tokens/s" in out and "A100 means A100-80GB" in out


@pytest.mark.parametrize("argv,needle", [
    (["estimate", *GLM130, "--tp", "3"], "tp 3"),
    (["estimate", *GLM130, "--tp", "4", "--pp", "5"], "--tp/--pp"),
    (["estimate", *GLM130, "--tp", "4", "--pp", "8", "--micro-batch", "5"], "--micro-batch"),
    (["estimate", *GLM130, "--tp", "4", "--pp", "8", "--zero", "2"], "ZeRO-2"),
    (["estimate", *GLM130, "--tp", "0"], "--tp"),
    (["estimate", "--model", "gpt-5", "--gpus", "8xA100"], "glm-130b"),
    (["estimate", "--model", "glm-10b", "--gpus", "8xB300"], "A100-80GB"),
    (["estimate", "--model", "glm-10b", "--gpus", "8 by A100"], "--gpus"),
    (["estimate", "--model", "glm-10b", "--gpus", "8xA100", "--global-batch", "-1"], "--global-batch"),
    (["estimate", "--model", "glm-10b", "--gpus", "8xA100", "--stage-layers", "a,b"], "--stage-layers"),
    (["search", "--model", "glm-10b", "--gpus", "8xA100", "--name", "../x"], "--name"),
    (["search", "--model", "glm-10b", "--gpus", "8xA100", "--trials", "0"], "--trials"),
    (["search", "--model", "glm-10b", "--gpus", "8xA100", "--storage", "nosuchdb://x"], "--storage"),
])
def test_bad_input_is_one_line(capsys, argv, needle):
    rc, out, err = run(capsys, *argv)
    assert rc == 2, err
    assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_hf_config_errors(capsys, tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama", "hidden_size": 40')
    rc, _, err = run(capsys, "estimate", "--model", str(bad), "--gpus", "8xA100")
    assert rc == 2 and "not valid JSON" in err and len(err.splitlines()) == 1
    bad.write_text('{"model_type": "t5"}')
    rc, _, err = run(capsys, "estimate", "--model", str(bad), "--gpus", "8xA100")
    assert rc == 2 and "chatglm" in err and "bloom" in err


def test_hf_config_estimates(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 1024, "num_hidden_layers": 8,
                               "num_attention_heads": 16, "num_key_value_heads": 4, "intermediate_size": 2816,
                               "vocab_size": 32000, "max_position_embeddings": 2048}))
    rc, out, _ = run(capsys, "estimate", "--model", str(cfg), "--gpus", "8xH100", "--tp", "4", "--json")
    assert rc == 0 and json.loads(out)["feasible"]


def test_fits_nowhere_writes_nothing(capsys, tmp_path):
    # no host memory: no ZeRO-Offload / ZeRO-Infinity, which would fit it (issue 9)
    rc, out, err = run(capsys, "search", "--model", "glm-130b", "--gpus", "8xA100-40GB", "--global-batch", "8",
                       "--cpu-mem-gb", "0", "--out-dir", str(tmp_path))
    assert rc == 2 and "does not fit" in err and "GB" in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []
