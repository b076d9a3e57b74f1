"""Starting and stopping the processes of a run: the one place that spawns ranks.

- `RankGroup`: ranks as direct children of this process in one new process group (same
  session), with torchrun's standalone environment (RANK, LOCAL_RANK; `rank_env` adds
  MASTER_ADDR/PORT on a free port and WORLD_SIZE). We start them ourselves rather than through
  torchrun because torchrun puts each worker in its own session: if torchrun itself is killed,
  its workers cannot be reached through our process group. Here we know each rank's pid and
  exit status, and stopping signals only that group. Used by the trainer's launcher
  (planner/runtime/train/launch.py) and the serving lab (planner/runtime/serve/run.py).
- `stop_group`: SIGTERM, then SIGKILL after a grace period, to one process group; also stops
  the deepspeed launcher's session (planner/runtime/train/group_launch.py).
- `free_port`: a free TCP port on 127.0.0.1 for the rendezvous.
Standard library only, so anything that starts processes may use it.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from typing import IO, Callable


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(world: int, **extra: str) -> dict[str, str]:
    """This process's environment plus torchrun's standalone rendezvous for `world` local ranks."""
    return dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
                PYTHONUNBUFFERED="1", **extra)


def stop_group(pgid: int, running: Callable[[], bool], grace: tuple[float, float] = (5.0, 5.0), *,
               sweep: bool = False) -> None:
    """SIGTERM process group `pgid`, wait up to grace[0] s while `running()`, then SIGKILL and wait
    up to grace[1] s. Without `sweep` it stops as soon as nothing runs; with it the SIGKILL goes
    out anyway (a launcher whose children may outlive it)."""
    for sig, wait in zip((signal.SIGTERM, signal.SIGKILL), grace):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and running():
            time.sleep(0.1)
        if not sweep and not running():
            return


class RankGroup:
    """The ranks of one run, each a direct child in one new process group (the first rank's pid)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.pgid = 0

    def start(self, cmd: list[str], rank: int, env: dict[str, str], log: IO, cwd: str | None = None) -> None:
        """Start rank `rank` (RANK = LOCAL_RANK = rank) with stdout and stderr to `log`."""
        kw = {"process_group": 0 if not self.procs else self.pgid}  # one new group, same session
        self.procs.append(subprocess.Popen(cmd, env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)), cwd=cwd,
                                           stdout=log, stderr=subprocess.STDOUT, **kw))
        if len(self.procs) == 1:
            self.pgid = self.procs[0].pid

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def stop(self) -> None:
        """Stop what is left of the group: SIGTERM, then SIGKILL after a grace period."""
        if self.procs and self.running():
            stop_group(self.pgid, self.running)


__all__ = ["RankGroup", "free_port", "rank_env", "stop_group"]
