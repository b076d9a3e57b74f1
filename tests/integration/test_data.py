"""A real run on real text: prepare-data with a tokenizer trained on the fly, then DeepSpeed on CPU
trains the tiny model on the indexed dataset with a held-out loss; bad data is refused before start.

    flock /tmp/planner-cpu.lock .venv/bin/pytest -q tests/integration/test_data.py
"""
from __future__ import annotations

import math
import os
import random
import string
from pathlib import Path

import pytest

from planner import dsconfig
from planner.cli import main
from planner.errors import SpecError
from planner.runtime.train.launch import run_plan
from planner.rundir import atomic_write_json, plan_document
from planner.specs import Plan, TrainSpec, parse_cluster, preset, scale

pytestmark = pytest.mark.integration
os.environ.setdefault("DS_ACCELERATOR", "cpu")
MODEL = scale(preset("glm-10b"), "tiny")  # vocab 1024


def _run_dir(root: Path) -> Path:
    plan = Plan(dp=2, zero=1, micro_batch=2, grad_accum=1, precision="bf16")
    cluster = parse_cluster("2xcpu")
    train = TrainSpec(global_batch=plan.global_batch, seq_len=64, precision=plan.precision)
    d = root / "run"
    atomic_write_json(d / "plan.json", plan_document(plan, MODEL, cluster, train, scale="tiny", model_arg="glm-10b"))
    atomic_write_json(d / "ds_config.json", dsconfig.ds_config(plan, MODEL, train, cluster))
    return d


def test_trains_on_prepared_text_and_refuses_bad_data(tmp_path: Path) -> None:
    text = tmp_path / "story.txt"
    text.write_text("\n\n".join(f"The {c} cat sat on the {m} mat and looked at the {c} dog for {k} minutes."
                                for k in range(200) for c, m in [(("red", "blue", "green")[k % 3],
                                                                  ("old", "new")[k % 2])]))
    assert main(["prepare-data", str(text), "--train-tokenizer", "512", "--out", str(tmp_path / "story"),
                 "--no-progress"]) == 0
    prefix, tok = tmp_path / "story", tmp_path / "story-tokenizer"
    d = _run_dir(tmp_path)
    bin_file = f"{prefix}.bin"  # PREFIX.bin names the pair as well as PREFIX does
    m = run_plan(d, steps=4, warmup=1, data=bin_file, tokenizer=str(tok), eval_every=4, eval_batches=1)
    assert m["status"] == "ok" and len(m["loss"]) == 4 and all(math.isfinite(x) for x in m["loss"])
    assert m["eval_loss"] and m["eval_loss"][-1]["step"] == 4 and math.isfinite(m["eval_loss"][-1]["loss"])
    # a tokenizer larger than the model's vocabulary is refused before any rank starts
    rng = random.Random(0)
    words = tmp_path / "words.txt"  # enough distinct words for 1100 BPE tokens
    words.write_text(" ".join("".join(rng.choice(string.ascii_lowercase) for _ in range(6)) for _ in range(5000)))
    assert main(["prepare-data", str(words), "--train-tokenizer", "1100", "--out", str(tmp_path / "big"),
                 "--no-progress"]) == 0
    with pytest.raises(SpecError, match="more than the model's vocabulary of 1024"):
        run_plan(d, steps=2, warmup=1, data=str(text), tokenizer=str(tmp_path / "big-tokenizer"))
    # a truncated .bin is named
    (tmp_path / "story.bin").write_bytes((tmp_path / "story.bin").read_bytes()[:-2])
    with pytest.raises(SpecError, match="story.bin holds"):
        run_plan(d, steps=2, warmup=1, data=bin_file, tokenizer=str(tok))
