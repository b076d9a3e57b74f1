"""The trainer on real DeepSpeed (CPU, gloo, tiny GLM, DP 2): the Prometheus endpoint of a live
run, the progress lines of `planner run` and of a worker started without it (launch.sh's
path), held-out evaluation, the learning-rate schedule, and `kill -9` of `planner run` while
it saves a checkpoint.

Run one at a time (2 cores): `flock /tmp/planner-cpu.lock .venv/bin/pytest -q tests/integration/test_trainer.py`.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from planner.runtime.train.launch import run_plan
from shared_runs import DP2, DP2_STEPS
from test_executor import _pid_alive, make_run

pytestmark = pytest.mark.integration
os.environ.setdefault("DS_ACCELERATOR", "cpu")
CLI = [sys.executable, "-c", "from planner.cli import entry; entry()", "run"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_live_endpoint_progress_eval_and_schedule(tmp_path: Path) -> None:
    """`planner run --metrics-port`: the endpoint answers while the ranks train, with per-rank
    series; the CLI echoes rank 0's progress lines; metrics.json has the rates DeepSpeed's
    WarmupCosineLR gave each step and the held-out losses."""
    d = make_run(tmp_path, "live", **DP2)
    port = _free_port()
    proc = subprocess.Popen(CLI + [str(d), "--steps", "6", "--warmup", "1", "--metrics-port", str(port),
                                   "--lr-schedule", "cosine", "--lr-warmup-steps", "2", "--eval-every", "2",
                                   "--eval-batches", "1", "--step-sleep", "0.4"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    live = None
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            got = _scrape(port)
        except OSError:
            time.sleep(0.1)
            continue
        if got.get(("planner_step", ())) and 3 <= got[("planner_step", ())] < 6:
            live = got
            break
        time.sleep(0.1)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert live is not None, "no scrape while training"
    for name in ("planner_tokens_per_second", "planner_step_time_seconds", "planner_loss", "planner_grad_norm",
                 "planner_learning_rate"):
        assert (name, ()) in live, name
    for name in ("planner_peak_memory_bytes", "planner_allreduce_seconds", "planner_allreduce_latency_seconds"):
        assert {lab for n, lab in live if n == name} == {(("rank", "0"),), (("rank", "1"),)}, name
    assert live[("planner_peak_memory_bytes", (("rank", "1"),))] > 1e7
    # ZeRO-1 DP 2: DeepSpeed all-reduces the gradients every step, so time is spent in it on each rank
    assert live[("planner_allreduce_calls", (("rank", "0"),))] >= 1
    assert not any(n == "planner_gpu_utilization_percent" for n, _ in live)  # CPU run
    assert ("planner_eval_loss", ()) in live  # evaluated at step 2
    lines = [ln for ln in out.splitlines() if ln.startswith("step ") and " | loss " in ln]
    assert [ln.split(" | ")[0] for ln in lines] == [f"step {s}/6" for s in range(1, 7)], out
    assert "eval loss" in lines[1] and "eval loss" not in lines[2] and "tokens/s" in lines[0]
    m = json.loads((d / "metrics.json").read_text())
    # WarmupCosineLR (warmup 2, 6 steps, floor 10%): step k uses iteration k-1
    assert m["lr"] == pytest.approx([0.0, 0.0, 1.5e-4, 3e-4 * (0.1 + 0.9 * 0.5 * (1 + 2 ** -0.5)),
                                     3e-4 * 0.55, 3e-4 * (0.1 + 0.9 * 0.5 * (1 - 2 ** -0.5))], rel=1e-9)
    assert m["lr_schedule"]["scheduler"]["type"] == "WarmupCosineLR"
    assert [e["step"] for e in m["eval_loss"]] == [2, 4, 6]
    # lr 0 for the first two updates: the model evaluated after step 2 is the initial one, so
    # held-out loss is that of an untrained model (~ln 1024 = 6.93) and then falls
    assert m["eval_loss"][0]["loss"] == pytest.approx(6.982180, abs=2e-5) and m["eval_loss"][2]["loss"] < m["eval_loss"][0]["loss"]
    assert len(m["allreduce_s_per_step"]) == 6 and all(x > 0 for x in m["allreduce_s_per_step"])
    rules = yaml.safe_load((d / "prometheus-alerts.yml").read_text())
    assert len(rules["groups"][0]["rules"]) == 2
    assert json.loads((d / "grafana-dashboard.json").read_text())["panels"]


def test_worker_without_planner_run_prints_steps_and_writes_metrics(dp2_bare_run) -> None:
    """launch.sh's path: the deepspeed launcher starts the worker with torchrun-style
    environment variables; rank 0 prints the progress lines itself and writes metrics.json.
    (The run is conftest.dp2_bare_run, shared with test_executor's resume test.)"""
    d, outs, codes = dp2_bare_run
    n = DP2_STEPS
    assert codes == [0, 0], outs
    steps = [ln for ln in outs[0].splitlines() if ln.startswith("step ")]
    assert [ln.split(" | ")[0] for ln in steps] == [f"step {s}/{n}" for s in range(1, n + 1)]
    assert not any(ln.startswith("step ") for ln in outs[1].splitlines())  # rank 0 only
    m = json.loads((d / "metrics.json").read_text())
    assert m["status"] == "ok" and len(m["loss"]) == n and m["warmup"] == 1 and m["world_size"] == 2
    assert m["lr"] == [3e-4] * n and m["lr_schedule"]["scheduler"]["type"] == "WarmupLR"
    assert f"{m['loss'][0]:.4f}" in steps[0]


def test_kill_9_during_a_checkpoint_save_keeps_the_previous_one(tmp_path: Path) -> None:
    """`kill -9` of `planner run` while its ranks write checkpoint step4 (each checkpoint file
    is followed by a 2 s pause, longer than the 1 s parent watch, so the kill lands between files): the ranks exit with their
    parent, `latest` still names step2, and --resume continues from step 2."""
    d = make_run(tmp_path, "kill", **DP2)
    proc = subprocess.Popen(CLI + [str(d), "--steps", "6", "--warmup", "1", "--checkpoint-every", "2",
                                   "--save-sleep", "2.0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt = d / "checkpoints"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if (ckpt / "step4").is_dir() and any((ckpt / "step4").iterdir()):
            break
        time.sleep(0.02)
    assert (ckpt / "latest").read_text() == "step2"
    pids = [json.loads((d / ".ranks" / f"rank{r}.json").read_text())["pid"] for r in (0, 1)]
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(_pid_alive(p) for p in pids):
        time.sleep(0.1)
    assert not any(_pid_alive(p) for p in pids)  # the parent watch ended them
    # the save of step4 was cut short: some files there, `latest` untouched
    assert (ckpt / "latest").read_text() == "step2"
    assert len(list((ckpt / "step4").iterdir())) < len(list((ckpt / "step2").iterdir()))
    m = run_plan(d, steps=6, warmup=1, resume=True, checkpoint_every=2)
    assert m["status"] == "ok" and m["resumed_at"] == 2 and len(m["loss"]) == 6
    assert (ckpt / "latest").read_text() == "step6"
    assert sorted(p.name for p in (ckpt / "step4").iterdir()) == sorted(p.name for p in (ckpt / "step2").iterdir())


def test_pipeline_eval_matches_the_data_parallel_one(tmp_path: Path) -> None:
    """Held-out loss under the pipeline engine (engine.eval_batch) of the untrained model (two
    steps at lr 0 in the cosine warmup) equals the DP 2 run's (forward under no_grad): the same
    four eval rows in the same micro-batches, 6.982180 measured by the DP 2 run of
    test_live_endpoint_progress_eval_and_schedule (fp32, seed 1234)."""
    d = make_run(tmp_path, "pp2", pp=2, zero=1, micro_batch=2, grad_accum=2, precision="fp32", stage_layers=(2, 2))
    m = run_plan(d, steps=2, warmup=1, eval_every=2, eval_batches=1, lr_schedule="cosine", lr_warmup_steps=2)
    assert m["lr"] == [0.0, 0.0]
    assert [e["step"] for e in m["eval_loss"]] == [2]
    assert m["eval_loss"][0]["loss"] == pytest.approx(6.982180, abs=2e-5)
