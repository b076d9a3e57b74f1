"""What a new user hit with `planner run` (issues 21 and 25): --timeout 0, --resume with nothing
to resume, a stale torch-extensions build lock, event step numbers, a resumed run re-echoing the
killed run's lines, Prometheus gauges reading 0 before step 1, and checks that must come before
DeepSpeed is imported. No rank is started (test_run_guard's no_launch)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from planner.cli import main
from planner.errors import ExecutionError
from planner.runtime.preflight import buildlock
from planner.runtime.train import launch, worker
from planner.runtime.files import CKPT_DIR, RANKS_DIR
from planner.runtime.observe.monitor import StabilityMonitor
from planner.runtime.observe.watch import format_progress
from test_run_guard import no_launch, refuse, tiny  # noqa: F401  (fixture)


def test_timeout_zero_is_refused_before_anything_starts(tmp_path, no_launch) -> None:
    line = refuse(tiny(tmp_path), ExecutionError, timeout=0)
    assert line.startswith("--timeout: must be a positive number of seconds, got 0")


def test_resume_without_a_checkpoint_is_refused(tmp_path, no_launch) -> None:
    d = tiny(tmp_path)
    line = refuse(d, ExecutionError, resume=True)
    assert line.startswith(f"--resume: no checkpoint to resume from in {d.resolve() / CKPT_DIR}")
    assert "--resume-if-present" in line
    (d / CKPT_DIR).mkdir()
    (d / CKPT_DIR / "latest").write_text("step4")     # names a tag that is not there: nothing to resume
    with pytest.raises(ExecutionError, match="^--resume: no checkpoint"):
        launch.run_plan(d, steps=3, warmup=1, resume=True)


def test_resume_if_present_starts_fresh_and_says_so(tmp_path, no_launch, capsys) -> None:
    d = tiny(tmp_path)
    with pytest.raises(AssertionError, match="a rank was started"):   # it got as far as launching
        launch.run_plan(d, steps=3, warmup=1, resume=True, resume_if_present=True, echo=print)
    assert f"no checkpoint in {d.resolve() / CKPT_DIR}: starting at step 1" in capsys.readouterr().out


def test_cli_resume_without_checkpoint_is_one_line_exit_2(tmp_path, no_launch, capsys) -> None:
    d = tiny(tmp_path)
    assert main(["run", str(d), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --resume: no checkpoint") and "\n" not in err


def test_a_resumed_run_echoes_only_its_own_progress(tmp_path, monkeypatch) -> None:
    """The killed run's records stay in progress.jsonl; the resumed launcher starts reading
    after them, and rank 0's "resume" record reads as what it is."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    d = tiny(tmp_path)
    (d / CKPT_DIR / "step2").mkdir(parents=True)
    (d / CKPT_DIR / "latest").write_text("step2")
    ranks = d / RANKS_DIR
    ranks.mkdir()
    old = [{"step": s, "total": 4, "kind": "step", "loss": 7.0} for s in (1, 2, 3)]
    (ranks / "progress.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    monkeypatch.setattr(launch.preflight, "probe_host", lambda gpu: __import__("test_run_guard").CPU_HOST)
    started = {}

    class Rank:   # stands in for a rank: appends the resumed run's records, exits 0
        def __init__(self, cmd, **kw) -> None:
            started.setdefault("cmd", cmd)
            self.pid = os.getpid()
            if kw["env"]["RANK"] == "0":
                with open(ranks / "progress.jsonl", "a") as fh:
                    fh.write(json.dumps({"step": 2, "kind": "resume", "tag": "step2",
                                         "dir": str(d / CKPT_DIR / "step2")}) + "\n")
                    fh.write(json.dumps({"step": 3, "total": 4, "kind": "step", "loss": 6.0}) + "\n")

        def poll(self) -> int:
            return 0

    monkeypatch.setattr(launch.subprocess, "Popen", Rank)
    monkeypatch.setattr(launch, "build_metrics", lambda *a, **k: {"status": "ok"})
    (ranks / "result.json").write_text("{}")
    monkeypatch.setattr(launch, "read_json", lambda p, what: {})
    seen: list[str] = []
    launch.run_plan(d, steps=4, warmup=1, resume=True, echo=seen.append)
    assert "--resume" in started["cmd"]
    steps_seen = [s for s in seen if s.startswith("step ")]
    assert steps_seen == ["step 3/4 | loss 6.0000 | lr n/a | tokens/s n/a | step n/a s | peak mem n/a GB"]
    assert f"resuming from step 2 (checkpoint {d / CKPT_DIR / 'step2'})" in seen


def test_events_use_the_progress_lines_step_numbers() -> None:
    """A spike seen on the 38th step is `event step 38`, as `step 38/60` is printed."""
    mon = StabilityMonitor()
    events = []
    for i, g in enumerate([1.0] * 5 + [50.0]):
        events += mon.observe(i + 1, 5.0, g)       # loop.py passes step + 1
    assert [e["step"] for e in events] == [6]
    src = Path(launch.__file__).with_name("loop.py").read_text()
    assert "monitor.observe(step + 1," in src


def test_the_resume_record_reads_as_a_resume() -> None:
    assert format_progress({"step": 10, "kind": "resume", "tag": "step10", "dir": "R/checkpoints/step10"}) == \
        "resuming from step 10 (checkpoint R/checkpoints/step10)"


# --- the torch-extensions build lock ---------------------------------------------------------

def _lock(root: Path, name: str = "deepspeed_shm_comm") -> Path:
    p = root / "py312_cpu" / name / "lock"
    p.parent.mkdir(parents=True)
    p.write_text("")
    return p


def test_a_lock_no_process_holds_is_stale_and_a_held_one_is_not(tmp_path) -> None:
    lock = _lock(tmp_path)
    assert buildlock.stale_locks([tmp_path]) == [lock]                 # the real /proc scan
    fd = os.open(lock, os.O_RDONLY)                                    # as FileBaton holds it
    try:
        assert buildlock.stale_locks([tmp_path]) == []
    finally:
        os.close(fd)
    msg, fix = buildlock.stale_lock_problem([tmp_path])
    assert str(lock) in msg and "deepspeed_shm_comm" in msg and fix == f"delete it: rm {lock}"


def test_the_roots_are_torchs_own() -> None:
    import torch.utils.cpp_extension as ext
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    root = buildlock.extension_roots(env)[0]
    assert Path(ext.get_default_build_root()) == root.resolve()
    assert buildlock.extension_roots({"TORCH_EXTENSIONS_DIR": "/x/ext"}) == [Path("/x/ext")]


def test_the_launcher_refuses_while_a_stale_lock_exists(tmp_path, no_launch, monkeypatch) -> None:
    lock = _lock(tmp_path / "ext")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext" / "py312_cpu"))
    line = refuse(tiny(tmp_path / "run"), ExecutionError)
    assert line.startswith(f"torch extensions: stale torch-extensions build lock {lock}") and f"rm {lock}" in line


def test_sigterm_unwinds_so_the_builds_lock_is_released(tmp_path) -> None:
    """A worker killed inside torch's FileBaton section removes the lock on its way out (the
    os._exit handler left it; every later run waited on it)."""
    lock = tmp_path / "lock"
    ready = tmp_path / "ready"
    code = f"""
import os, sys, time
from pathlib import Path
from planner.runtime.train import worker
from torch.utils.file_baton import FileBaton
class S:
    def write(self, **kw): Path({str(tmp_path / 'status')!r}).write_text(kw.get('phase', ''))
import signal
signal.signal(signal.SIGTERM, worker._on_sigterm(S()))
baton = FileBaton({str(lock)!r})
assert baton.try_acquire()
try:
    Path({str(ready)!r}).write_text('1')
    try:
        time.sleep(60)
    finally:
        baton.release()
except worker.Terminated:
    os._exit(143)
"""
    p = subprocess.Popen([sys.executable, "-c", code])
    for _ in range(300):
        if ready.exists():
            break
        p.poll()
        assert p.returncode is None
        __import__("time").sleep(0.05)
    assert lock.exists()
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=20) == 143
    assert not lock.exists() and (tmp_path / "status").read_text() == "terminated"


# --- checks before DeepSpeed --------------------------------------------------------------------

@pytest.mark.parametrize("argv, says", [
    (["run", "does-not-exist"], "plan.json: "),
    (["run", "RUN", "--timeout", "0"], "--timeout: must be a positive"),
    (["run", "RUN", "--resume"], "--resume: no checkpoint"),
    (["verify", "RUN", "--steps", "0"], "--steps/--warmup: need steps >= 1"),
    (["verify", "RUN", "--timeout", "-1"], "--timeout: must be a positive"),
])
def test_bad_arguments_fail_before_torch_or_deepspeed_is_imported(tmp_path, argv, says) -> None:
    d = tiny(tmp_path / "r")
    argv = [str(d) if a == "RUN" else a for a in argv]
    code = ("import sys; from planner.cli import main; rc = main(sys.argv[1:]); "
            "bad = [m for m in ('deepspeed', 'torch') if m in sys.modules]; "
            "print('IMPORTED', bad); sys.exit(rc)")
    res = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env=dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext")))
    assert res.returncode == 2, res.stderr
    assert "IMPORTED []" in res.stdout
    err = res.stderr.strip()
    assert err.startswith(f"error: {says}") and "\n" not in err
    assert not (d / "verify").exists() and not (d / RANKS_DIR).exists()


# --- Prometheus ---------------------------------------------------------------------------------

def test_no_gauge_reads_zero_before_the_first_step() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from planner.runtime.observe.prom import Exporter
    from test_trainer_units import _free_port
    port = _free_port()
    ex = Exporter(port)
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        ex.close()
    got = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert got == {"planner_step": 0.0}        # steps completed: truly 0; loss, tokens/s: absent, not 0



def test_a_lock_left_while_ranks_start_stops_the_run_with_its_name(tmp_path, monkeypatch) -> None:
    """Ranks waiting on a stale lock poll forever: the watch loop names it instead of waiting
    for --timeout to call the run hung 'in phase start'."""
    lock = _lock(tmp_path / "ext")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext" / "py312_cpu"))
    monkeypatch.setattr(launch, "LOCK_CHECK_S", 0.0)
    (tmp_path / RANKS_DIR).mkdir()
    (tmp_path / RANKS_DIR / "rank0.json").write_text(json.dumps({"phase": "start"}))

    class Waiting:
        def poll(self):
            return None
    with pytest.raises(ExecutionError, match=f"rank 0 cannot start: stale torch-extensions build lock {lock}"):
        launch._watch(tmp_path, [Waiting()], __import__("time").monotonic(), 600.0)


# --- the one-time op build -----------------------------------------------------------------------

def test_make_builds_the_ops_a_run_loads() -> None:
    """`make`'s install step runs planner.runtime.preflight.ops, whose OPS are the builders DeepSpeed's
    CPU comm backend loads at init_distributed (deepspeed/comm/torch.py build_shm_op)."""
    import importlib
    import inspect

    from planner.runtime.preflight import ops
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    makefile = (Path(__file__).parents[2] / "Makefile").read_text()
    install = makefile.split("$(STAMP):", 1)[1].split("\n\n", 1)[0]
    assert "-m planner.runtime.preflight.ops" in install
    src = inspect.getsource(ds_torch.build_shm_op)
    assert all(f'"{name}"' in src for name in ops.OPS)


def test_the_op_build_stops_at_a_stale_lock(tmp_path, monkeypatch) -> None:
    from planner.runtime.preflight import ops
    lock = _lock(tmp_path)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "py312_cpu"))
    said: list[str] = []
    assert ops.build(said.append) == 1
    assert said == [f"warning: DeepSpeed ops not built: {buildlock.stale_lock_problem()[0]} (fix: delete it: rm {lock})"]
