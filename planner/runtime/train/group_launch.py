"""Run a plan's run directory on a node group through the DeepSpeed launcher.

    group = NodeGroup.parse(hostfile="hosts", include="localhost:0,1")
    group.check(cluster)                          # refuses a group of the wrong size or shape
    cmd = group.command(run_dir, steps=5, warmup=1, port=29511)
    metrics = group.run(run_dir, steps=5, warmup=1, timeout=900)   # -> metrics.json of the run

A group is what the `deepspeed` launcher is given: a hostfile (`<host> slots=<n>` lines) and
optionally `--include` / `--exclude` (NODE[:SLOT,...][@NODE...]); it is resolved with the
launcher's own parser (deepspeed.launcher.runner), so the hosts and slots here are the ones
the launch uses. A group of one local host (localhost, 127.0.0.1 or this host's name) runs
without ssh on 127.0.0.1, so on one machine several workers can each own some of its slots;
other groups start their ranks over ssh/pdsh as the launcher does. Rank 0 writes metrics.json
into the run directory on the first host of the group: for a group whose first host is not
this one, the run directory must be on a filesystem both hosts share.

The launcher runs in its own session (a timeout stops the whole tree) under
`setpriv --pdeathsig TERM` where util-linux has it, so a worker killed with SIGKILL does not
leave its ranks running: the launcher gets SIGTERM and stops its ranks.
"""
from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import socket
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

from planner.dsconfig import ENTRY_MODULE
from planner.errors import ExecutionError, SpecError
from planner.rundir import read_json
from planner.runtime.procs import free_port, stop_group
_LOCAL = ("localhost", "127.0.0.1")


@dataclasses.dataclass(frozen=True)
class NodeGroup:
    """The hosts and slots one worker's trials run on."""

    hostfile: str
    include: str = ""
    exclude: str = ""
    resources: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """(host, slots) in launch order, as the DeepSpeed launcher resolves the filters."""

    @classmethod
    def parse(cls, hostfile: str | None, include: str = "", exclude: str = "") -> "NodeGroup | None":
        """None without a hostfile, include or exclude (trials then run locally with `planner run`)."""
        if not (hostfile or include or exclude):
            return None
        if include and exclude:
            raise SpecError("--include/--exclude", "give one of them, not both", "keep --include or --exclude")
        if not hostfile:
            raise SpecError("--hostfile", "--include/--exclude filter a hostfile, none given",
                            "give --hostfile PATH with lines '<host> slots=<n>' (e.g. 'localhost slots=4')")
        pool = _read_hostfile(hostfile)
        from deepspeed.launcher import runner
        try:
            active = runner.parse_inclusion_exclusion(pool, include, exclude)
        except (ValueError, KeyError) as exc:
            flag = "--include" if include else "--exclude"
            raise SpecError(flag, f"{include or exclude!r} does not select slots of {hostfile}: {exc}",
                            "write NODE[:SLOT,...][@NODE...] with hosts and slot numbers of the hostfile") from None
        res = tuple((h, tuple(int(s) for s in slots)) for h, slots in active.items() if slots)
        if not res:
            raise SpecError("--include" if include else "--exclude", "selects no slot", "keep at least one slot")
        return cls(hostfile=str(Path(hostfile).resolve()), include=include, exclude=exclude, resources=res)

    @property
    def slots(self) -> int:
        return sum(len(s) for _, s in self.resources)

    @property
    def local(self) -> bool:
        return len(self.resources) == 1 and self.resources[0][0] in (*_LOCAL, socket.gethostname())

    def describe(self) -> str:
        return "@".join(f"{h}:{','.join(map(str, s))}" for h, s in self.resources)

    def check(self, cluster: Any) -> None:
        """The group must be the plan's cluster: `nodes` hosts with `gpus_per_node` slots each."""
        per_host = sorted({len(s) for _, s in self.resources})
        flag = "--include" if self.include else "--exclude" if self.exclude else "--hostfile"
        want = f"{cluster.nodes} host(s) x {cluster.gpus_per_node} slot(s) = {cluster.world_size}"
        have = f"{len(self.resources)} host(s), {self.slots} slot(s) ({self.describe()})"
        if self.slots != cluster.world_size or len(self.resources) != cluster.nodes or len(per_host) != 1:
            more = "more" if self.slots > cluster.world_size else "fewer" if self.slots < cluster.world_size else \
                "other"
            raise SpecError(flag, f"names {more} slots than the plan needs: {have}; the plans are for {want}",
                            f"give a group of {want} (e.g. --include HOST:0,...,{cluster.gpus_per_node - 1}), "
                            "or --gpus matching the group")

    def command(self, run_dir: str | Path, *, steps: int, warmup: int, port: int) -> list[str]:
        """The exact launcher command line (run from `run_dir`)."""
        launcher = Path(sys.executable).with_name("deepspeed")
        cmd = [str(launcher) if launcher.exists() else "deepspeed", "--hostfile", self.hostfile]
        if self.include:
            cmd += ["--include", self.include]
        if self.exclude:
            cmd += ["--exclude", self.exclude]
        if self.local:
            cmd += ["--no_ssh_check", "--master_addr", "127.0.0.1"]
        cmd += ["--master_port", str(port), "--module", ENTRY_MODULE, "--run-dir", str(Path(run_dir).resolve()),
                "--steps", str(steps), "--warmup", str(warmup)]
        return cmd

    def run(self, run_dir: str | Path, *, steps: int, warmup: int, timeout: float,
            log_name: str = "launcher.log") -> dict[str, Any]:
        """Launch, wait at most `timeout` s, and return the run's metrics.json (ExecutionError if none)."""
        run = Path(run_dir).resolve()
        (run / "metrics.json").unlink(missing_ok=True)
        cmd = self.command(run, steps=steps, warmup=warmup, port=free_port())
        if shutil.which("setpriv"):
            cmd = ["setpriv", "--pdeathsig", "TERM", "--", *cmd]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if os.environ.get("DS_ACCELERATOR") == "cpu":
            env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, self.slots))))
        with open(run / log_name, "w") as log:
            proc = subprocess.Popen(cmd, cwd=str(run), env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _stop(proc)
                raise ExecutionError("--trial-timeout", f"the run did not finish within {timeout:g} s",
                                     f"raise --trial-timeout or see {run / log_name}") from None
            except BaseException:
                _stop(proc)
                raise
        try:
            metrics = read_json(run / "metrics.json", "metrics.json")
        except Exception:
            metrics = None
        if code != 0 or not isinstance(metrics, dict) or metrics.get("status") != "ok":
            why = (metrics or {}).get("error") if isinstance(metrics, dict) else None
            raise ExecutionError("launcher", f"exited with status {code}" + (f": {why}" if why else ""),
                                 f"see {run / log_name} and {run}/metrics.json")
        return metrics


def _read_hostfile(path: str) -> "OrderedDict[str, int]":
    from deepspeed.launcher import runner
    if not Path(path).is_file():
        raise SpecError("--hostfile", f"{path} does not exist", "give a file with lines '<host> slots=<n>'")
    try:
        pool = runner._parse_hostfile(Path(path).read_text().splitlines())
    except ValueError as exc:
        raise SpecError("--hostfile", f"{path}: {exc}", "write one '<host> slots=<n>' line per host") from None
    return OrderedDict(pool)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the launcher's session (the launcher stops its ranks), SIGKILL what is left."""
    stop_group(proc.pid, lambda: proc.poll() is None, (10.0, 5.0), sweep=True)


def dry_run_line(cmd: list[str], run_dir: str | Path) -> str:
    return f"(cd {shlex.quote(str(Path(run_dir).resolve()))} && {shlex.join(cmd)})"


__all__ = ["NodeGroup", "dry_run_line"]
