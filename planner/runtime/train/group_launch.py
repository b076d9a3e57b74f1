"""Run a plan's run directory on a node group through the DeepSpeed launcher.

    group = NodeGroup.parse(hostfile="hosts", include="localhost:0,1", cores="0")
    group.check(cluster)                          # refuses a group of the wrong size or shape
    cmd = group.command(run_dir, steps=5, warmup=1, port=29511)
    metrics = group.run(run_dir, steps=5, warmup=1, timeout=900)   # -> metrics.json of the run

A group is what the `deepspeed` launcher is given: a hostfile (`<host> slots=<n>` lines) and
optionally `--include` / `--exclude` (NODE[:SLOT,...][@NODE...]); it is resolved with the
launcher's own parser (deepspeed.launcher.runner), so the hosts and slots here are the ones
the launch uses.

- A group of one local host (localhost, 127.0.0.1 or this host's name) runs without ssh on
  127.0.0.1, so on one machine several workers can each own some of its slots; `cores` pins
  such a group's launcher and ranks to its own CPU cores (`taskset -c`), so that workers
  sharing a machine do not share cores.
- Any other group starts its ranks over ssh with the launcher's pdsh backend (`--force_multi`
  for a single host that is not this one: without it the launcher would run the ranks here).
  The run directory is made to exist on those hosts and metrics.json is brought back from the
  group's first host (rank 0) over the same ssh, unless the hosts share the directory
  (planner/runtime/train/remote.py). The worker's DS_ACCELERATOR, OMP_NUM_THREADS,
  TORCH_EXTENSIONS_DIR and MALLOC_MMAP_THRESHOLD_ reach the remote ranks through the
  directory's `.deepspeed_env` (the launcher exports PYTHON* itself).

The launcher runs in its own session (a timeout stops the whole tree) under
`setpriv --pdeathsig TERM` where util-linux has it, so a worker killed with SIGKILL does not
leave its ranks running: the launcher gets SIGTERM and stops its ranks (remote ones through
pdsh, as the launcher's own SIGTERM handler does).
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
from planner.rundir import atomic_write_text, read_json
from planner.runtime.procs import free_port, stop_group
from planner.runtime.train import remote

_LOCAL = ("localhost", "127.0.0.1")
_REMOTE_ENV = ("DS_ACCELERATOR", "OMP_NUM_THREADS", "TORCH_EXTENSIONS_DIR", "MALLOC_MMAP_THRESHOLD_")
"""What the worker's environment gives remote ranks besides PYTHON* (.deepspeed_env)."""


def is_here(host: str) -> bool:
    """Whether `host` names this machine (as the launcher would reach it without ssh)."""
    return host in (*_LOCAL, socket.gethostname(), socket.getfqdn())


@dataclasses.dataclass(frozen=True)
class NodeGroup:
    """The hosts and slots one worker's trials run on."""

    hostfile: str
    include: str = ""
    exclude: str = ""
    resources: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """(host, slots) in launch order, as the DeepSpeed launcher resolves the filters."""
    cores: tuple[int, ...] = ()
    """CPU cores a local group's launcher and ranks run on (empty: wherever the OS puts them)."""

    @classmethod
    def parse(cls, hostfile: str | None, include: str = "", exclude: str = "",
              cores: str = "") -> "NodeGroup | None":
        """None without a hostfile, include or exclude (trials then run locally with `planner run`)."""
        if not (hostfile or include or exclude):
            if cores:
                raise SpecError("--cores", "pins a node group's ranks, and no --hostfile is given",
                                "give --hostfile with a local host (e.g. 'localhost slots=2') and --include")
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
        group = cls(hostfile=str(Path(hostfile).resolve()), include=include, exclude=exclude, resources=res)
        return dataclasses.replace(group, cores=_cores(cores, group)) if cores else group

    @property
    def slots(self) -> int:
        return sum(len(s) for _, s in self.resources)

    @property
    def hosts(self) -> list[str]:
        return [h for h, _ in self.resources]

    @property
    def local(self) -> bool:
        return len(self.resources) == 1 and is_here(self.resources[0][0])

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
        cmd = ["taskset", "-c", ",".join(map(str, self.cores))] if self.cores else []
        cmd += [str(launcher) if launcher.exists() else "deepspeed", "--hostfile", self.hostfile]
        if self.include:
            cmd += ["--include", self.include]
        if self.exclude:
            cmd += ["--exclude", self.exclude]
        if self.local:
            cmd += ["--no_ssh_check", "--master_addr", "127.0.0.1"]
        elif len(self.resources) == 1:
            cmd += ["--force_multi"]         # one host that is not this one: over pdsh, not here
        cmd += ["--master_port", str(port), "--module", ENTRY_MODULE, "--run-dir", str(Path(run_dir).resolve()),
                "--steps", str(steps), "--warmup", str(warmup)]
        return cmd

    def run(self, run_dir: str | Path, *, steps: int, warmup: int, timeout: float,
            log_name: str = "launcher.log") -> dict[str, Any]:
        """Launch, wait at most `timeout` s, and return the run's metrics.json (ExecutionError if none)."""
        run = Path(run_dir).resolve()
        (run / "metrics.json").unlink(missing_ok=True)
        fetch_from = self._stage(run)
        cmd = self.command(run, steps=steps, warmup=warmup, port=free_port())
        if shutil.which("setpriv"):
            cmd = ["setpriv", "--pdeathsig", "TERM", "--", *cmd]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if os.environ.get("DS_ACCELERATOR") == "cpu" and self.local:
            env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
            cpus = len(self.cores) or os.cpu_count() or 1
            env.setdefault("OMP_NUM_THREADS", str(max(1, cpus // max(1, self.slots))))
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
        if fetch_from:
            try:
                atomic_write_text(run / "metrics.json", remote.collect(run, fetch_from))
            except ExecutionError:
                if code == 0:           # the run says it succeeded: the lost metrics are the error
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

    def _stage(self, run: Path) -> str:
        """For a group reached over ssh: the run directory (and .deepspeed_env) on each host
        that does not share it; returns the first host when metrics.json must be fetched from it."""
        if self.local:
            return ""
        lines = [f"{k}={os.environ[k]}" for k in _REMOTE_ENV if os.environ.get(k)]
        (run / ".deepspeed_env").unlink(missing_ok=True)
        if lines:
            atomic_write_text(run / ".deepspeed_env", "\n".join(lines) + "\n")
        away = [h for h in self.hosts if not is_here(h)]
        shared = remote.stage(run, away)
        first = self.hosts[0]
        return first if not is_here(first) and first not in shared else ""


def _cores(spec: str, group: NodeGroup) -> tuple[int, ...]:
    """--cores LIST (the launcher's --bind_core_list syntax: 0-3,8) for a local group."""
    from deepspeed.utils.numa import parse_range_list
    if not group.local:
        raise SpecError("--cores", f"pins a group on this machine; {group.describe()} starts its ranks over ssh",
                        "drop --cores, and bind remote ranks with your scheduler (e.g. Slurm's --cpu-bind)")
    try:
        cores = tuple(parse_range_list(spec))
    except ValueError as exc:
        raise SpecError("--cores", f"{spec!r} is not a core list: {exc}", "write e.g. 0-3,8") from None
    have = sorted(os.sched_getaffinity(0))
    if not set(cores) <= set(have):
        raise SpecError("--cores", f"{spec!r} names cores this process may not use (it may use "
                        f"{','.join(map(str, have))})", "give cores of this machine (see `taskset -p $$`)")
    if not shutil.which("taskset"):
        raise SpecError("--cores", "taskset (util-linux) is not installed", "install util-linux or drop --cores")
    return cores


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
