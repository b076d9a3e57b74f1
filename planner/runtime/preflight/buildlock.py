"""Stale torch-extensions build locks: found, named, and never left behind by our ranks.

DeepSpeed JIT-builds its CPU ops (the `deepspeed_shm_comm` op every CPU run loads, `cpu_adam`
for offload) through torch.utils.cpp_extension.load, which serialises builds with a FileBaton:
`os.open(<build dir>/lock, O_CREAT | O_EXCL)`, the descriptor kept open until the build (or the
check that nothing needs building) is done, then the file is removed (torch/utils/file_baton.py,
torch/utils/cpp_extension.py `_jit_compile`). Every other process polls until the file goes.
A process killed inside that section leaves the file, and every later DeepSpeed start on the
machine waits on it forever. The owner keeps the file open, so a lock file no process holds
open is stale (`stale_locks`); the launcher refuses to start ranks while one exists and its
watch loop names one that appears during start-up. The worker's SIGTERM handler unwinds the
stack (so the FileBaton's `finally` removes the file) instead of exiting on the spot.

Pure Python (no torch import): the launcher calls it before any rank starts.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

RECHECK_S = 0.3
"""Pause before a lock found unheld is looked at again (a release in progress is not stale)."""


def extension_roots(environ: dict[str, str] | None = None) -> list[Path]:
    """Where torch.utils.cpp_extension builds: $TORCH_EXTENSIONS_DIR/<name>/, else
    <user cache>/torch_extensions/py<XY>_<accelerator>/<name>/ (get_default_build_root: the
    user cache dir is $XDG_CACHE_HOME or ~/.cache, torch/_appdirs.py)."""
    env = os.environ if environ is None else environ
    if env.get("TORCH_EXTENSIONS_DIR"):
        return [Path(env["TORCH_EXTENSIONS_DIR"])]
    cache = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [Path(cache) / "torch_extensions"]


def lock_files(roots: list[Path]) -> list[Path]:
    """Every build lock under the roots (<root>/<name>/lock or <root>/<py_acc>/<name>/lock)."""
    found: list[Path] = []
    for root in roots:
        for pattern in ("*/lock", "*/*/lock"):
            found.extend(p for p in root.glob(pattern) if p.is_file())
    return sorted(set(found))


def _open_files(proc: Path = Path("/proc")) -> set[str]:
    """Paths of the files open in every process this user may inspect (/proc/<pid>/fd links)."""
    held: set[str] = set()
    try:
        pids = [d for d in os.listdir(proc) if d.isdigit()]
    except OSError:
        return held
    for pid in pids:
        fd_dir = proc / pid / "fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:  # gone, or another user's process
            continue
        for fd in fds:
            try:
                held.add(os.readlink(fd_dir / fd))
            except OSError:
                continue
    return held


def stale_locks(roots: list[Path] | None = None, open_files: set[str] | None = None) -> list[Path]:
    """Build locks no process on this machine holds open: a build that was killed."""
    locks = lock_files(extension_roots() if roots is None else roots)
    if not locks:
        return []
    def unheld(paths: list[Path], held: set[str]) -> list[Path]:
        return [p for p in paths if p.exists() and str(p) not in held and os.path.realpath(p) not in held]
    if open_files is not None:
        return unheld(locks, open_files)
    stale = unheld(locks, _open_files())
    if stale:  # FileBaton.release closes the file a moment before removing it: look twice
        time.sleep(RECHECK_S)
        stale = unheld(stale, _open_files())
    return stale


def stale_lock_problem(roots: list[Path] | None = None, open_files: set[str] | None = None) -> tuple[str, str] | None:
    """(message, fix) naming the first stale lock, or None."""
    stale = stale_locks(roots, open_files)
    if not stale:
        return None
    lock = stale[0]
    more = f" (and {len(stale) - 1} more)" if len(stale) > 1 else ""
    return (f"stale torch-extensions build lock {lock}{more}: no process holds it (a build of the "
            f"{lock.parent.name} op was killed), and every DeepSpeed start on this machine waits on it",
            f"delete it: rm {' '.join(str(p) for p in stale)}")
