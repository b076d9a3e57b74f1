"""`planner search --refine` on a node group of two other "hosts": the deepspeed launcher starts
one rank on each over ssh (its pdsh backend), the hosts do not see this machine's run
directory, and metrics.json comes back from the first host.

Each host is an sshd on its own loopback address (127.0.0.2, 127.0.0.3) in its own mount
namespace, with an empty tmpfs over this test's scratch directory: the code and the venv are at
the same paths (as on a cluster), the run directory is not (no shared filesystem). ssh reaches
them through a config file (an `ssh` wrapper first on PATH, for the launcher, pdsh and the
worker alike). .ci/run installs Debian's openssh-server and pdsh; where sshd, pdsh or mount
namespaces are missing the test skips with a line saying so.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
HOSTS = ("127.0.0.2", "127.0.0.3")
INPUTS = ["--model", "chatglm3-6b", "--scale", "tiny", "--gpus", "2x1xcpu", "--global-batch", "8", "--seq-len", "64",
          "--trials", "8"]


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    """(scratch dir hidden from the hosts, PATH with the ssh wrapper, {host: sshd process})."""
    missing = [t for t in ("/usr/sbin/sshd", "pdsh", "unshare", "ssh-keygen", "ssh") if not shutil.which(t)]
    if missing or os.geteuid() != 0:
        pytest.skip(f"no second host: {', '.join(missing) or 'not root'} (Debian: apt-get install openssh-server "
                    "pdsh, as .ci/run does; mount namespaces need root)")
    keys, scratch = tmp_path_factory.mktemp("ssh"), tmp_path_factory.mktemp("scratch")
    for name in ("host", "id"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name)], check=True)
    shutil.copy(keys / "id.pub", keys / "authorized_keys")
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)        # sshd's privilege-separation directory
    client, procs = [], {}
    try:
        for host in HOSTS:
            port = _free_port(host)
            cfg = keys / f"sshd-{host}"
            cfg.write_text(f"Port {port}\nListenAddress {host}\nHostKey {keys / 'host'}\n"
                           f"AuthorizedKeysFile {keys / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
                           "PasswordAuthentication no\nKbdInteractiveAuthentication no\nStrictModes no\nUsePAM no\n"
                           f"PidFile {keys / f'{host}.pid'}\n")
            client.append(f"Host {host}\n  Port {port}\n  User root\n  IdentityFile {keys / 'id'}\n"
                          "  IdentitiesOnly yes\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n"
                          "  LogLevel ERROR\n")
            procs[host] = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                 f"mount -t tmpfs tmpfs {scratch} && exec /usr/sbin/sshd -D -e -f {cfg}"],
                stdout=subprocess.DEVNULL, stderr=open(keys / f"{host}.log", "w"))
        (keys / "ssh_config").write_text("".join(client))
        (keys / "bin").mkdir()
        (keys / "bin" / "ssh").write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {keys / "ssh_config"} "$@"\n')
        (keys / "bin" / "ssh").chmod(0o755)
        path = f"{keys / 'bin'}:{os.environ['PATH']}"
        deadline = time.monotonic() + 20
        for host, p in procs.items():
            while subprocess.run(["ssh", "-o", "BatchMode=yes", host, "true"], env=dict(os.environ, PATH=path),
                                 capture_output=True).returncode != 0:
                if p.poll() is not None or time.monotonic() > deadline:
                    pytest.skip(f"no second host: sshd on {host} did not start: "
                                f"{(keys / f'{host}.log').read_text().strip()[-300:]}")
                time.sleep(0.2)
        ip = subprocess.run(["ssh", HOSTS[0], "hostname -I"], env=dict(os.environ, PATH=path), capture_output=True,
                            text=True).stdout.split()
        if not ip:     # the launcher takes the first host's `hostname -I` as the rendezvous address
            pytest.skip("no second host: `hostname -I` names no address for the launcher's rendezvous")
        yield scratch, path, procs
    finally:
        for p in procs.values():
            p.terminate()
            p.wait(timeout=10)


def _ssh(path: str, host: str, cmd: str) -> str:
    return subprocess.run(["ssh", host, cmd], env=dict(os.environ, PATH=path), capture_output=True, text=True).stdout


def test_trial_on_two_other_hosts_brings_metrics_back(two_hosts, monkeypatch, capsys) -> None:
    from planner.cli import main
    scratch, path, procs = two_hosts
    monkeypatch.setenv("PATH", path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # the ranks load DeepSpeed's shm op from the extension cache every test uses (built by `make`'s install)
    hosts = scratch / "hosts"
    hosts.write_text("".join(f"{h} slots=1\n" for h in HOSTS))
    args = ["search", *INPUTS, "--out-dir", str(scratch), "--name", "r", "--refine", "1", "--refine-steps", "2",
            "--hostfile", str(hosts), "--trial-timeout", "300"]
    assert main(args) == 0, capsys.readouterr()
    run = scratch / "r" / "refine" / "plan-0"
    metrics = json.loads((run / "metrics.json").read_text())            # brought back from 127.0.0.2
    assert metrics["status"] == "ok" and metrics["tokens_per_s"] > 0 and metrics["world_size"] == 2
    refine = json.loads((scratch / "r" / "refine.json").read_text())
    assert refine["summary"]["runs"] == 1
    # the ranks ran there, each host in its own copy of the run directory, none here
    assert not (run / ".ranks").exists()
    assert "rank0.json" in _ssh(path, HOSTS[0], f"ls {run}/.ranks") and "metrics.json" in _ssh(path, HOSTS[0], f"ls {run}")
    assert "rank1.json" in _ssh(path, HOSTS[1], f"ls {run}/.ranks") and "rank0" not in _ssh(path, HOSTS[1], f"ls {run}/.ranks")
    # a host that stops answering: the trial fails in one line naming it, before anything is launched
    procs[HOSTS[1]].terminate()
    procs[HOSTS[1]].wait(timeout=10)
    capsys.readouterr()
    t0 = time.monotonic()
    assert main([*args, "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert f"checking the run directory on {HOSTS[1]}: ssh exited with status 255" in err, err
    assert "Connection refused" in err and time.monotonic() - t0 < 120
