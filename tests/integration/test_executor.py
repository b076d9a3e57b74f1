"""Real DeepSpeed on CPU (gloo), tiny GLM, few steps: ZeRO stages, mixed precision with
selective recompute, NaN rollback, refusals and timeouts, kill and resume. The parallel axes
(TP slices, pipeline stages and their checkpointing, four-process layouts) are checked on
test_parity.py's runs, which also reproduce the single-process run.

Run one at a time (2 cores): `flock /tmp/planner-cpu.lock .venv/bin/pytest -q tests/integration/test_executor.py`.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from planner import dsconfig
from planner.errors import ExecutionError
from planner.runtime.train.launch import run_plan
from planner.rundir import atomic_write_json, plan_document
from planner.specs import Plan, TrainSpec, parse_cluster, preset, scale
from shared_runs import DP2, DP2_STEPS, dp2_losses

pytestmark = pytest.mark.integration
os.environ.setdefault("DS_ACCELERATOR", "cpu")
MODEL = scale(preset("chatglm3-6b"), "tiny")
SEQ = 64


def make_run(root: Path, name: str, gpus: str = "2xcpu", **plan_kw) -> Path:
    plan = Plan(**plan_kw)
    cluster = parse_cluster(gpus)
    train = TrainSpec(global_batch=plan.global_batch, seq_len=SEQ, precision=plan.precision)
    d = root / name
    atomic_write_json(d / "plan.json", plan_document(plan, MODEL, cluster, train, scale="tiny", model_arg="chatglm3-6b"))
    atomic_write_json(d / "ds_config.json", dsconfig.ds_config(plan, MODEL, train, cluster))
    return d


def result(d: Path) -> dict:
    return json.loads((d / ".ranks" / "result.json").read_text())


def test_zero_stages_agree_in_fp32(tmp_path: Path) -> None:
    """ZeRO-0 and ZeRO-1 (with full recompute) with DP 2, fp32, accumulation 2: the same loss
    curve, and ZeRO-1 holds less per rank. (ZeRO-2 and -3 reproduce the single-process run's
    losses and gradients in test_parity.py; where ZeRO-3 keeps its shards: test_zero_variants.py.)"""
    curves, states = {}, {}
    for z in (0, 1):
        kw = {"recompute": "full"} if z == 1 else {}  # recompute must not change the math either
        d = make_run(tmp_path, f"z{z}", dp=2, zero=z, micro_batch=2, grad_accum=2, precision="fp32",
                     bucket_elements=2_000_000, **kw)
        m = run_plan(d, steps=4, warmup=1)
        assert m["status"] == "ok" and len(m["loss"]) == 4
        assert m["step_time_s"] > 0 and m["tokens_per_s"] > 0 and len(m["peak_memory_gb_per_rank"]) == 2
        curves[z], states[z] = m["loss"], m["model_state_breakdown_gb_per_rank"][0]
        if z == 1:
            assert all(r["checkpointed_blocks"] == [True] * 4 for r in result(d)["ranks"])
    assert curves[1] == pytest.approx(curves[0], rel=1e-4)
    # ZeRO-1 shards optimizer states (and reduced gradients)
    assert sum(states[1].values()) < sum(states[0].values())
    logs = tmp_path / "z0" / "logs"
    assert list(logs.rglob("events.out.tfevents*")) and list(logs.rglob("*.csv"))


def test_bf16_zero2_selective(tmp_path: Path) -> None:
    d = make_run(tmp_path, "bf16", dp=2, zero=2, micro_batch=1, grad_accum=4, precision="bf16",
                 recompute="selective", bucket_elements=2_000_000)
    m = run_plan(d, steps=3, warmup=1)
    assert m["status"] == "ok" and all(x == x for x in m["loss"])
    assert all(r["selective_blocks"] == [True] * 4 for r in result(d)["ranks"])


def test_nan_is_caught_and_rolled_back(tmp_path: Path) -> None:
    d = make_run(tmp_path, "nan", dp=2, zero=1, micro_batch=2, grad_accum=1, precision="fp32")
    m = run_plan(d, steps=5, warmup=1, checkpoint_every=2, inject_nan=3)
    kinds = [e["kind"] for e in m["events"]]
    assert "nan" in kinds and "rollback" in kinds
    assert m["status"] == "ok" and len(m["loss"]) == 5 and all(x == x for x in m["loss"])
    assert m["skipped_batches"] == [3]
    assert (d / "debug" / "nan_step4.json").exists()      # --inject-nan 3 is the 4th step, "step 4/5"
    assert [e["step"] for e in m["events"] if e["kind"] == "nan"] == [4]


def test_rejected_plan_and_timeout_name_the_rank(tmp_path: Path) -> None:
    d = make_run(tmp_path, "bad", dp=2, zero=1, micro_batch=2, grad_accum=1, precision="fp32")
    cfg = json.loads((d / "ds_config.json").read_text())
    # DeepSpeed's own config validation rejects it (the preflight compares only the layout fields)
    cfg["zero_optimization"]["reduce_bucket_size"] = -1
    atomic_write_json(d / "ds_config.json", cfg)
    with pytest.raises(ExecutionError, match=r"rank \d.*DeepSpeed rejected the plan"):
        run_plan(d, steps=2, warmup=0)
    m = json.loads((d / "metrics.json").read_text())
    assert m["status"] == "failed" and m["failed_rank"] in (0, 1) and "reduce_bucket_size" in m["error"]
    d2 = make_run(tmp_path, "slow", dp=2, zero=0, micro_batch=2, grad_accum=1, precision="fp32")
    with pytest.raises(ExecutionError, match="hung"):
        run_plan(d2, steps=1000, warmup=0, timeout=4)
    assert json.loads((d2 / "metrics.json").read_text())["status"] == "failed"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_kill_a_rank_then_resume_continues_the_same_curve(tmp_path: Path, dp2_bare_run) -> None:
    """The uninterrupted curve is conftest.dp2_bare_run's: the same plan and steps, one launch that
    test_trainer's launch.sh-path test reads as well."""
    n = DP2_STEPS
    ref_loss = dp2_losses(dp2_bare_run)
    d = make_run(tmp_path, "kill", **DP2)
    proc = subprocess.Popen([sys.executable, "-c", "from planner.cli import entry; entry()", "run", str(d), "--steps", str(n), "--warmup", "1",
                             "--checkpoint-every", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    progress = d / ".ranks" / "progress.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        done = [json.loads(x) for x in progress.read_text().splitlines()] if progress.exists() else []
        if sum(1 for r in done if r["kind"] == "checkpoint" and r["step"] >= 4):
            break
        time.sleep(0.05)
    victim = json.loads((d / ".ranks" / "rank1.json").read_text())["pid"]
    os.kill(victim, signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "rank 1" in out and "SIGKILL" in out, out
    m = json.loads((d / "metrics.json").read_text())
    assert m["status"] == "failed" and m["failed_rank"] == 1
    pids = [json.loads((d / ".ranks" / f"rank{r}.json").read_text())["pid"] for r in (0, 1)]
    assert not any(_pid_alive(p) for p in pids)  # the other rank was cleaned up
    done = [json.loads(x) for x in progress.read_text().splitlines()]
    last_ckpt = max(r["step"] for r in done if r["kind"] == "checkpoint")
    seen: list[str] = []
    resumed = run_plan(d, steps=n, warmup=1, resume=True, checkpoint_every=1, echo=seen.append)
    assert resumed["resumed_at"] == last_ckpt  # no completed (checkpointed) step lost
    # it reads as a resume: where it continues, then only the new run's steps (not the killed run's)
    assert f"resuming from step {last_ckpt} (checkpoint {d.resolve() / 'checkpoints' / f'step{last_ckpt}'})" in seen
    steps_seen = [ln.split(" | ")[0] for ln in seen if ln.startswith("step ")]
    assert steps_seen == [f"step {s}/{n}" for s in range(last_ckpt + 1, n + 1)], seen
    assert resumed["loss"] == pytest.approx(ref_loss, rel=1e-5)
