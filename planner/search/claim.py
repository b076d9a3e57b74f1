"""Who may write a run directory: one search at a time, and a new search only over one of the
same inputs (a re-search resumes its study) unless told to set the old plan aside.

Two searches into one `--name` both printed "wrote reports/same/" and the second silently
replaced the first (issue 25). `claim` holds an exclusive lock (fcntl.flock on a file in the
temp directory named by the run directory's path, released when the search ends or its process
dies) and compares the inputs recorded in an existing plan.json with this search's model,
cluster and training spec.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, TextIO

from planner.errors import SpecError
from planner.search.outputs import MEASUREMENTS, SEARCH_FILES, set_aside, set_aside_line

PLAN_FILES = ("plan.json", "estimate.json", "ds_config.json", "launch.sh", "hostfile", "export")
"""What a plan leaves besides its search files and measurements (planner/search/outputs.py)."""

COMPARED = ("model", "cluster", "train")
"""plan.json inputs that make two searches the same search (the command line may differ: more
--trials resume the same study)."""


def _normal(x: Any) -> Any:
    """As plan.json holds it (tuples as lists)."""
    return json.loads(json.dumps(x))


def _recorded(run_dir: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads((run_dir / "plan.json").read_text())
        return doc["inputs"] if isinstance(doc, dict) and isinstance(doc.get("inputs"), dict) else {}
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}          # unreadable: not this search's


def _what(inputs: dict[str, Any]) -> str:
    model, cluster = inputs.get("model") or {}, inputs.get("cluster") or {}
    return f"{model.get('name', '?')} on {cluster.get('spec') or '?'}"


def _differences(old: dict[str, Any], new: dict[str, Any], most: int = 3) -> str:
    """What differs, e.g. "train.global_batch 8 -> 16" (at most `most` fields, then "...")."""
    out = []
    for section in COMPARED:
        a, b = old.get(section), new.get(section)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{section}.{k} {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        else:
            out.append(f"{section} differs")
    return ", ".join(out[:most]) + (", ..." if len(out) > most else "")


class Claim:
    """The lock on one run directory (release it once; the process's exit releases it too)."""

    def __init__(self, fh: TextIO, moved: str | None) -> None:
        self._fh, self.moved = fh, moved

    def release(self) -> None:
        if not self._fh.closed:
            fcntl.flock(self._fh, fcntl.LOCK_UN)
            self._fh.close()


def lock_path(run_dir: Path) -> Path:
    """The lock of one run directory: in the temp directory, named by the directory's absolute
    path, so a refused or failed search leaves nothing in OUT_DIR."""
    key = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
    d = Path(tempfile.gettempdir()) / "planner-run-locks"
    d.mkdir(exist_ok=True)
    return d / f"{key}.lock"


def claim(run_dir: Path, inputs: dict[str, Any], *, overwrite: bool) -> Claim:
    """Lock run_dir for this search, or refuse (SpecError on --name) while another search holds
    it, or when it holds a plan of other inputs and not `overwrite`; with `overwrite` that plan,
    its search files and measurements move to run_dir/previous/<time>/ (Claim.moved says so)."""
    fh = open(lock_path(run_dir), "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        pid = fh.read().strip() or "?"
        fh.close()
        raise SpecError("--name", f"{run_dir} is being written by another search (pid {pid})",
                        "wait for it to finish, or pick another --name") from None
    fh.seek(0)
    fh.truncate()
    fh.write(str(os.getpid()))
    fh.flush()
    moved = None
    try:
        old = _recorded(run_dir)
        new = _normal({k: inputs[k] for k in COMPARED})
        if old is not None and {k: old.get(k) for k in COMPARED} != new:
            if not overwrite:
                raise SpecError("--name", f"{run_dir} holds a plan for other inputs ({_what(old)}: "
                                f"{_differences(old, new)})", f"pass --overwrite to move it to {run_dir}/previous/<time>/, or "
                                "pick another --name")
            moved = set_aside_line(*set_aside(run_dir, PLAN_FILES + SEARCH_FILES + MEASUREMENTS))
    except BaseException:
        fcntl.flock(fh, fcntl.LOCK_UN)
        fh.close()
        raise
    return Claim(fh, moved)
