"""Model-variant what-ifs through the executor (docs/variants.md): tiny ChatGLM3, 2 CPU processes
(DP 2, ZeRO-0, bf16), 3 steps each, measured against the cost model's prediction.

- share-layers=2 and ffn-sparsity=0.5, together in one run (a launch costs ~15 s of CI): model-state
  bytes per rank, counted by the executor (planner.runtime.observe.measure.model_states), within 3%
  of planner.cost.estimate's and in the predicted ratio to the base run's. Each variant alone would
  miss by far more than 3%: against the 527,488 parameters predicted, a run without the sharing
  would hold 792,704, one without the thinner FFN 693,376;
- linear-attention: it trains (finite, falling loss); what each block keeps for backward
  (planner.runtime.observe.measure.ActivationRecorder, in-process) against
  planner.cost.memory.block_activation_bytes at s = 512, where the eager base keeps
  b n s^2 scores per block and linear attention none.

Run alone (2 cores): `flock /tmp/planner-cpu.lock .venv/bin/pytest -q -s tests/integration/test_variants.py`
(-s prints the figures docs/variants.md records).
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from planner import dsconfig
from planner.cli.common import apply_variants
from planner.cost import estimate, memory
from planner.runtime.train.launch import run_plan
from planner.rundir import atomic_write_json, plan_document
from planner.specs import Plan, TrainSpec, parse_cluster, preset, scale

pytestmark = pytest.mark.integration
os.environ.setdefault("DS_ACCELERATOR", "cpu")

TINY = scale(preset("chatglm3-6b"), "tiny")
SEQ, STEPS = 64, 3
PLAN = Plan(dp=2, zero=0, micro_batch=2, grad_accum=2, precision="bf16", bucket_elements=2_000_000)
VARIANTS = {"base": (), "share2+ffn0.5": ("share-layers=2", "ffn-sparsity=0.5"), "linattn": ("linear-attention",)}
GB = 1e9


def _run(root: Path, name: str):
    model = apply_variants(TINY, VARIANTS[name])
    cluster = parse_cluster("2xcpu")
    train = TrainSpec(global_batch=PLAN.global_batch, seq_len=SEQ, precision="bf16")
    d = root / name
    atomic_write_json(d / "plan.json", plan_document(PLAN, model, cluster, train, scale="tiny",
                                                      model_arg="chatglm3-6b"))
    atomic_write_json(d / "ds_config.json", dsconfig.ds_config(PLAN, model, train, cluster))
    m = run_plan(d, steps=STEPS, warmup=1, timeout=300)
    assert m["status"] == "ok", m.get("error")
    est = estimate(model, cluster, train, PLAN)
    mb = est.stage_memory[0]
    return model, m, (mb.params + mb.grads + mb.optimizer) / GB


def test_variants_model_states_and_training(tmp_path: Path) -> None:
    out = {name: _run(tmp_path, name) for name in VARIANTS}
    for name, (model, m, predicted) in out.items():
        counted = m["model_state_gb_per_rank"]
        print(f"\nVARIANT | {model.name} | params {model.params:,} | model states per rank counted "
              f"{[round(c * 1e3, 3) for c in counted]} MB, predicted {predicted * 1e3:.3f} MB | "
              f"loss {[round(x, 5) for x in m['loss']]} | step {m['step_time_s']:.3f} s | "
              f"peak {m['peak_memory_gb'] * 1e3:.0f} MB")
        assert all(math.isfinite(x) for x in m["loss"]) and m["loss"][-1] < m["loss"][0]
        for c in counted:
            assert c == pytest.approx(predicted, rel=0.03), (name, c, predicted)
    # at init phi(x) = elu(x) + 1 ~ 1 + x and softmax ~ uniform weights: close curves, not the same
    assert out["linattn"][1]["loss"] != out["base"][1]["loss"]
    base = out["base"][1]["model_state_gb_per_rank"][0]
    # the measured ratio to the base run follows the parameter count's
    model, m, _ = out["share2+ffn0.5"]
    ratio = m["model_state_gb_per_rank"][0] / base
    print(f"RATIO | share2+ffn0.5 | measured {ratio:.3f} | parameters {model.params / TINY.params:.3f}")
    assert ratio == pytest.approx(model.params / TINY.params, rel=0.03)


def _block_bytes(model, attention: str, s: int) -> tuple[float, float]:
    """(measured, predicted) bytes one block keeps for backward, in-process, bf16, b 1."""
    from planner.runtime.observe.measure import ActivationRecorder
    from planner.model.glm import GLMModel
    torch.manual_seed(0)
    net = GLMModel(model, [False] * model.layers, False, attention=attention).to(torch.bfloat16).train()
    rec = ActivationRecorder(net)
    ids = torch.randint(0, model.vocab, (1, s))
    pos, seg = torch.arange(s)[None], torch.zeros(1, s, dtype=torch.long)
    seg[0, s // 3:] = 1  # two packed documents
    with rec.window():
        logits = net(ids, pos, seg)
    logits.float().sum().backward()
    measured = rec.result["blocks"]["1"]
    kernel = "linear" if model.linear_attention else attention
    predicted = memory.block_activation_bytes(model, s, 1, 1, sequence_parallel=False, recompute="none",
                                              act_bytes=2.0, kernel=kernel)
    return measured, predicted


def test_linear_attention_block_activations() -> None:
    s = 512
    lin = apply_variants(TINY, ["linear-attention"])
    figures = {"eager": _block_bytes(TINY, "eager", s), "flash": _block_bytes(TINY, "flash", s),
               "linear": _block_bytes(lin, "eager", s)}
    for k, (meas, pred) in figures.items():
        print(f"\nBLOCK ACTIVATIONS | s {s} | {k} | measured {meas:,} B | predicted {pred:,.0f} B")
        assert meas == pytest.approx(pred, rel=0.02), k
    # the s^2 scores are gone: eager - linear = b n s^2 e (+ flash's lse vs none)
    assert figures["eager"][0] - figures["linear"][0] == pytest.approx(4 * s * s * 2, rel=0.02)
