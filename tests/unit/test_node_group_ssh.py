"""Node groups reached over ssh and groups pinned to cores, without a second host: a stand-in
`ssh` on PATH plays the remote host (the real ones: tests/integration/test_remote_group.py)."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from planner.errors import ExecutionError, SpecError
from planner.runtime.train import remote
from planner.runtime.train.group_launch import NodeGroup

FAKE_SSH = r'''#!PYTHON
"""ssh HOST CMD as a host with its own filesystem: FAKE_SSH_MODE says what it does."""
import os, sys, time, pathlib
mode, cmd = os.environ["FAKE_SSH_MODE"], sys.argv[-1]
pathlib.Path(os.environ["FAKE_SSH_LOG"]).open("a").write(sys.argv[-2] + " " + cmd + "\n")
if mode == "refused":
    sys.stderr.write("debug1: noise\nssh: connect to host %s port 22: Connection refused\n" % sys.argv[-2]); sys.exit(255)
if mode == "hang":
    time.sleep(30)
if "planner-share-token" in cmd:
    sys.exit(0)                                   # not shared: prints no token
if "tar -xf" in cmd:
    sys.stdin.buffer.read(); sys.exit(0)
if "metrics.json" in cmd and mode == "lost":
    sys.stderr.write("cat: metrics.json: No such file or directory\n"); sys.exit(1)
if "metrics.json" in cmd:
    sys.stdout.write(os.environ["FAKE_METRICS"]); sys.exit(0)
sys.exit(3)
'''


@pytest.fixture
def fake_ssh(tmp_path: Path, monkeypatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ssh = bin_dir / "ssh"
    ssh.write_text(FAKE_SSH.replace("PYTHON", sys.executable))
    ssh.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SSH_LOG", str(tmp_path / "ssh.log"))
    return tmp_path / "ssh.log"


def _group(tmp_path: Path, text: str, **kw: str) -> NodeGroup:
    (tmp_path / "hosts").write_text(text)
    return NodeGroup.parse(str(tmp_path / "hosts"), **kw)


def _launcher_writes(monkeypatch, tmp_path: Path, code: int = 0) -> Path:
    """The launcher replaced by a script that only leaves a mark and exits with `code`."""
    mark = tmp_path / "launched"
    script = f"open({str(mark)!r}, 'w').write('x'); raise SystemExit({code})"
    monkeypatch.setattr(NodeGroup, "command", lambda self, run, **kw: [sys.executable, "-c", script])
    return mark


def test_a_lone_remote_host_runs_there_not_here(tmp_path: Path) -> None:
    g = _group(tmp_path, "node-b slots=2\n")
    cmd = g.command(tmp_path, steps=2, warmup=1, port=1)
    assert not g.local and "--force_multi" in cmd and "--no_ssh_check" not in cmd
    two = _group(tmp_path, "node-b slots=1\nnode-c slots=1\n")
    assert "--force_multi" not in two.command(tmp_path, steps=2, warmup=1, port=1) and two.hosts == ["node-b", "node-c"]


def test_metrics_come_back_from_the_first_host(tmp_path: Path, fake_ssh: Path, monkeypatch) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "plan.json").write_text("{}")
    monkeypatch.setenv("FAKE_SSH_MODE", "ok")
    monkeypatch.setenv("FAKE_METRICS", json.dumps({"status": "ok", "tokens_per_s": 7.0}))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    mark = _launcher_writes(monkeypatch, tmp_path)
    g = _group(tmp_path, "node-b slots=1\nnode-c slots=1\n")
    assert g.run(run, steps=2, warmup=1, timeout=30)["tokens_per_s"] == 7.0
    calls = fake_ssh.read_text().splitlines()
    # the run directory checked and copied to both hosts, then metrics.json read from the first
    assert [c.split()[0] for c in calls] == ["node-b", "node-b", "node-c", "node-c", "node-b"]
    assert "tar -xf" in calls[1] and calls[-1] == f"node-b cat {run.resolve() / 'metrics.json'}" and mark.exists()
    assert "DS_ACCELERATOR=cpu" in (run / ".deepspeed_env").read_text()
    assert json.loads((run / "metrics.json").read_text())["tokens_per_s"] == 7.0


def test_a_host_ssh_cannot_reach_fails_before_the_launch(tmp_path: Path, fake_ssh: Path, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_SSH_MODE", "refused")
    mark = _launcher_writes(monkeypatch, tmp_path)
    with pytest.raises(ExecutionError) as info:
        _group(tmp_path, "node-b slots=2\n").run(tmp_path, steps=2, warmup=1, timeout=30)
    line = info.value.line()
    assert line.startswith("--hostfile: checking the run directory on node-b: ssh exited with status 255: "
                           "ssh: connect to host node-b port 22: Connection refused (fix: make `ssh node-b` work")
    assert "\n" not in line and not mark.exists()


def test_lost_metrics_are_the_trials_error(tmp_path: Path, fake_ssh: Path, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_SSH_MODE", "lost")
    _launcher_writes(monkeypatch, tmp_path)
    with pytest.raises(ExecutionError, match=r"collecting .*metrics.json on node-b: ssh exited with status 1: "
                                             r"cat: metrics.json: No such file or directory \(fix: rank 0 wrote none there: see "
                                             r".*launcher.log"):
        _group(tmp_path, "node-b slots=2\n").run(tmp_path, steps=2, warmup=1, timeout=30)
    # a launcher that failed by itself reports its own status, not the lost metrics
    _launcher_writes(monkeypatch, tmp_path, code=3)
    with pytest.raises(ExecutionError, match="launcher: exited with status 3"):
        _group(tmp_path, "node-b slots=2\n").run(tmp_path, steps=2, warmup=1, timeout=30)


def test_a_silent_host_times_out_instead_of_hanging(tmp_path: Path, fake_ssh: Path, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_SSH_MODE", "hang")
    monkeypatch.setattr(remote, "LIMIT_S", 1.0)
    t0 = time.monotonic()
    with pytest.raises(ExecutionError, match="collecting .* on node-b: ssh did not finish within 1 s"):
        remote.collect(tmp_path, "node-b", limit_s=remote.LIMIT_S)
    assert time.monotonic() - t0 < 10


def test_a_shared_directory_is_not_copied(tmp_path: Path, monkeypatch) -> None:
    """A host whose `cat` sees this machine's files (a stand-in ssh that runs the command here)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text('#!/bin/sh\nfor last; do :; done\nexec sh -c "$last"\n')
    (bin_dir / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    assert remote.stage(tmp_path, ["node-b", "node-b"]) == {"node-b"}


def test_cores_pin_a_local_group(tmp_path: Path) -> None:
    core = sorted(os.sched_getaffinity(0))[0]
    g = _group(tmp_path, "localhost slots=4\n", include="localhost:0,1", cores=str(core))
    assert g.cores == (core,) and g.command(tmp_path, steps=2, warmup=1, port=1)[:3] == ["taskset", "-c", str(core)]
    assert _group(tmp_path, "localhost slots=2\n").command(tmp_path, steps=2, warmup=1, port=1)[0] != "taskset"


@pytest.mark.parametrize("text, cores, words", [
    ("localhost slots=2\n", "4096", "names cores this process may not use"),
    ("localhost slots=2\n", "1-0", "is not a core list"),
    ("node-b slots=2\n", "0", "pins a group on this machine; node-b:0,1 starts its ranks over ssh"),
])
def test_bad_cores_are_one_line(tmp_path: Path, text: str, cores: str, words: str) -> None:
    with pytest.raises(SpecError) as info:
        _group(tmp_path, text, cores=cores)
    assert info.value.field == "--cores" and words in info.value.line()
    with pytest.raises(SpecError, match="--cores: pins a node group's ranks, and no --hostfile"):
        NodeGroup.parse(None, cores="0")


def test_dry_run_of_a_remote_group_says_what_goes_over_ssh(tmp_path: Path, capsys) -> None:
    from planner.cli import main
    hosts = tmp_path / "hosts"
    hosts.write_text("node-b slots=1\nnode-c slots=1\n")
    assert main(["search", "--model", "chatglm3-6b", "--scale", "tiny", "--gpus", "2x1xcpu", "--global-batch", "8",
                 "--seq-len", "64", "--trials", "8", "--out-dir", str(tmp_path), "--name", "d", "--refine", "1",
                 "--hostfile", str(hosts), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"--hostfile {hosts.resolve()} --master_port" in out and "--no_ssh_check" not in out
    assert "metrics.json is read back from node-b (ssh node-b cat RUN_DIR/metrics.json)" in out.replace("\n", " ")
