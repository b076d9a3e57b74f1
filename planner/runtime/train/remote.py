"""A trial's run directory on the hosts of a node group that are not this machine, over ssh.

The deepspeed launcher starts remote ranks with pdsh over ssh, each in `cd <run dir>` at the
same path as here, and rank 0 (on the group's first host) writes metrics.json there. DeepSpeed
itself copies nothing: it expects the code, the environment and the working directory at the
same path on every host, either on a filesystem the hosts share or put there beforehand. So,
over the same passwordless ssh the launcher needs (`ssh HOST`, with whatever ~/.ssh/config says
about the host):

    shared = stage(run_dir, hosts)      # before the launch: which hosts already see run_dir
    metrics_text = collect(run_dir, first_host) # after it, when the first host did not share it

- `stage` writes a random token into the run directory and asks each host for it: a host that
  answers with the same token shares the directory (nothing is copied); to any other host the
  run directory (plan.json, estimate.json, ds_config.json, .deepspeed_env: kilobytes) is
  copied with `tar | ssh HOST tar -x` at the same path.
- `collect` reads `<run dir>/metrics.json` from the first host with `ssh HOST cat`.

Every ssh call runs in batch mode (never a password prompt) with a connect timeout and a
wall-clock limit, so a dead or silent host fails the trial with one line naming the host, the
ssh error and the fix; it never hangs the worker.
"""
from __future__ import annotations

import secrets
import shlex
import subprocess
from pathlib import Path

from planner.errors import ExecutionError

SHARE_TOKEN = ".planner-share-token"
SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", "ConnectTimeout=10")
LIMIT_S = 60.0
_FIX = ("make `ssh {host}` work from this worker without a password (the deepspeed launcher needs it too), "
        "or keep the run directories on a filesystem the group shares")


def _ssh(host: str, remote: str, *, what: str, stdin: bytes | None = None, limit_s: float = LIMIT_S,
         fix: str = "") -> bytes:
    """Run `remote` (a shell command line) on `host`; its stdout, or one ExecutionError line (ssh's
    own failures, status 255, get the ssh fix; the remote command's get `fix`)."""
    cmd = ["ssh", *SSH_OPTIONS, host, remote]
    try:
        done = subprocess.run(cmd, input=stdin if stdin is not None else b"", capture_output=True,
                              timeout=limit_s)
    except subprocess.TimeoutExpired:
        raise ExecutionError("--hostfile", f"{what} on {host}: ssh did not finish within {limit_s:g} s",
                             _FIX.format(host=host)) from None
    except FileNotFoundError:
        raise ExecutionError("--hostfile", f"{what} on {host}: no ssh client on this machine",
                             "install openssh-client (the deepspeed launcher needs it for other hosts too)") from None
    if done.returncode != 0:
        err = [ln for ln in done.stderr.decode(errors="replace").splitlines() if ln.strip()]
        raise ExecutionError("--hostfile", f"{what} on {host}: ssh exited with status {done.returncode}"
                             + (f": {err[-1].strip()}" if err else ""),
                             _FIX.format(host=host) if done.returncode == 255 or not fix else fix)
    return done.stdout


def stage(run_dir: str | Path, hosts: list[str]) -> set[str]:
    """Make `run_dir` exist with its files on every host of `hosts`; returns the hosts that share it."""
    run = Path(run_dir).resolve()
    token = secrets.token_hex(16)
    (run / SHARE_TOKEN).write_text(token)
    q = shlex.quote(str(run))
    shared = set()
    for host in dict.fromkeys(hosts):
        seen = _ssh(host, f"cat {q}/{SHARE_TOKEN} 2>/dev/null || true", what="checking the run directory")
        if seen.decode(errors="replace").strip() == token:
            shared.add(host)
            continue
        files = [p.name for p in sorted(run.iterdir()) if p.is_file() and p.name != "metrics.json"]
        tar = subprocess.run(["tar", "-C", str(run), "-cf", "-", "--", *files], capture_output=True, check=True)
        _ssh(host, f"mkdir -p {q} && rm -f {q}/metrics.json && tar -xf - -C {q}", stdin=tar.stdout,
             what=f"copying the run directory {run}")
    return shared


def collect(run_dir: str | Path, host: str, limit_s: float = LIMIT_S) -> str:
    """The text of `run_dir`/metrics.json on `host` (rank 0's host)."""
    run = Path(run_dir).resolve()
    path = shlex.quote(str(run / "metrics.json"))
    out = _ssh(host, f"cat {path}", what=f"collecting {run / 'metrics.json'}", limit_s=limit_s,
               fix=f"rank 0 wrote none there: see {run / 'launcher.log'} for its output")
    return out.decode(errors="replace")


__all__ = ["LIMIT_S", "SHARE_TOKEN", "collect", "stage"]
