"""`planner export --to megatron-lm`: a megatron-core plan as Megatron-LM pretrain_gpt.py
arguments (exports follow the runtime, issue 19 item 1); DeepSpeed's exports refuse it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.cli import main

GLM10 = ["--model", "glm-10b", "--gpus", "4x8xA100", "--global-batch", "512", "--tp", "4", "--pp", "4",
         "--zero", "1", "--sequence-parallel", "--recompute", "full"]


@pytest.fixture(scope="module")
def mc_run(tmp_path_factory) -> Path:
    """A run directory whose plan is for megatron-core: interleaved, written as a deepspeed plan
    and re-labelled (planner estimate --write writes deepspeed plans only)."""
    d = tmp_path_factory.mktemp("mc") / "run"
    assert main(["estimate", *GLM10, "--write", str(d)]) == 0
    doc = json.loads((d / "plan.json").read_text())
    doc["plan"].update(runtime="megatron-core", schedule="interleaved", interleave=2)
    (d / "plan.json").write_text(json.dumps(doc))
    return d


def test_megatron_core_plan_exports_megatron_lm_arguments(mc_run: Path, capsys) -> None:
    out = mc_run / "mlm"
    assert main(["export", str(mc_run), "--to", "megatron-lm", "--out", str(out)]) == 0
    args = json.loads((out / "pretrain_gpt_args.json").read_text())
    flag = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--") and not args[i + 1].startswith("--")}
    assert flag["--tensor-model-parallel-size"] == "4" and flag["--pipeline-model-parallel-size"] == "4"
    assert flag["--num-layers-per-virtual-pipeline-stage"] == "6"  # 48 layers / (4 stages x 2 chunks)
    assert {"--sequence-parallel", "--tp-comm-overlap", "--use-distributed-optimizer", "--overlap-grad-reduce",
            "--overlap-param-gather", "--bf16"} <= set(args)
    assert flag["--recompute-granularity"] == "full" and flag["--recompute-method"] == "block"
    assert flag["--micro-batch-size"] == "1" and flag["--global-batch-size"] == "512"
    script = (out / "pretrain_gpt.sh").read_text()
    assert "torchrun --nproc-per-node 8 --nnodes 4" in script and "deepspeed" not in script.lower()


def test_deepspeed_exports_refuse_a_megatron_core_plan(mc_run: Path, capsys) -> None:
    rc = main(["export", str(mc_run), "--to", "megatron-deepspeed", "--out", str(mc_run / "mds")])
    err = capsys.readouterr().err
    assert rc == 2 and "use --to megatron-lm" in err and len(err.strip().splitlines()) == 1
    assert not (mc_run / "mds").exists()


def test_megatron_lm_refuses_what_it_cannot_run(tmp_path: Path, capsys) -> None:
    d = tmp_path / "z2"
    assert main(["estimate", "--model", "glm-10b", "--gpus", "8xA100", "--global-batch", "64", "--zero", "2",
                 "--write", str(d)]) == 0
    capsys.readouterr()
    rc = main(["export", str(d), "--to", "megatron-lm", "--out", str(d / "x")])
    err = capsys.readouterr().err
    assert rc == 2 and "no ZeRO-2" in err and not (d / "x").exists()


def test_megatron_lm_spells_the_model_in_megatron_core_flags(tmp_path: Path) -> None:
    """ChatGLM3-6B: 2 KV groups, RMSNorm, rotary on half the head, SwiGLU, a QKV-only bias."""
    d = tmp_path / "glm3"
    assert main(["estimate", "--model", "chatglm3-6b", "--gpus", "8xA100", "--global-batch", "64", "--tp", "2",
                 "--zero", "1", "--write", str(d)]) == 0
    doc = json.loads((d / "plan.json").read_text())
    doc["plan"]["runtime"] = "megatron-core"
    (d / "plan.json").write_text(json.dumps(doc))
    assert main(["export", str(d), "--to", "megatron-lm", "--out", str(d / "x")]) == 0
    args = json.loads((d / "x" / "pretrain_gpt_args.json").read_text())
    flag = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--") and not args[i + 1].startswith("--")}
    assert flag["--num-query-groups"] == "2" and "--group-query-attention" in args
    assert flag["--normalization"] == "RMSNorm" and flag["--position-embedding-type"] == "rope"
    assert flag["--rotary-percent"] == "0.5" and "--norm-epsilon" in flag
    assert {"--swiglu", "--disable-bias-linear", "--add-qkv-bias", "--untie-embeddings-and-output-weights"} <= set(args)
    assert "--num-key-value-heads" not in args and "--layernorm-epsilon" not in args  # Megatron-DeepSpeed's spelling
