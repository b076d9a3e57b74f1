"""The run directory: the files every stage reads and writes (DESIGN.md "The run directory").

    plan.json      {"version": 1, "plan": Plan.to_dict(), "description": str,
                    "inputs": {"model": ModelSpec.to_dict(), "cluster": ClusterSpec.to_dict(),
                               "train": TrainSpec.to_dict(), "scale": str|None, "model_arg": str,
                               "profile": path, "command": str}}
    estimate.json  {"plan": ..., "estimate": Estimate.to_json(),
                    "baseline": {"plan": ..., "estimate": ...} | {"plan": ..., "fits": false, "needs_gb": x}}
    ds_config.json DeepSpeed config (no "auto")
    launch.sh      deepspeed command line (+ hostfile for multi-node)
    trials.csv     one row per evaluated plan (see planner/search)
    study.db       the Optuna study
    metrics.json   the executor's measurements
    report.html    the report

Every write goes to a temporary file in the same directory and is renamed into place, so an
interrupted run never leaves a half-written file.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.errors import SpecError
from planner.specs.hardware import Host, Link, find_device, load_profile
from planner.specs.cluster import ClusterSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import Plan
from planner.specs.train import TrainSpec

VERSION = 1


def check_writable(path: str | Path, field: str) -> None:
    """Refuse, before any work, an output directory that cannot be written: one line naming the
    path (a read-only or foreign directory otherwise fails late, as an OSError or a storage
    error, or leaves a command waiting). `path` is the directory the command writes into; it
    may not exist yet, then the nearest existing directory above it must take a new entry. The
    test is a real one: a temporary file created and removed there."""
    p = Path(path)
    probe = p
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        where = "is not a directory" if probe == p else f"cannot be created: {probe} is not a directory"
        raise SpecError(field, f"{p} {where}", "give a directory path")
    try:
        fd, tmp = tempfile.mkstemp(dir=probe, prefix=".planner-write-check-")
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        at = "" if probe == p else f" (its nearest existing directory {probe})"
        raise SpecError(field, f"cannot write to {p}{at}: {exc.strerror or exc}",
                        "give a directory you can write to, or fix its permissions") from None


def atomic_write_text(path: str | Path, text: str, mode: int | None = None) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        # mkstemp creates 0600; run-directory files are ordinary files (0644 unless told)
        os.chmod(tmp, mode if mode is not None else 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def atomic_write_json(path: str | Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False, default=_json_default) + "\n")


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (tuple, set, frozenset)):
        return list(obj)
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def read_json(path: str | Path, what: str) -> Any:
    p = Path(path)
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise SpecError(what, f"{p} does not exist", "run `planner search` first or give the right directory") from None
    except OSError as exc:
        raise SpecError(what, f"cannot read {p}: {exc.strerror}", "check the path") from None
    except json.JSONDecodeError as exc:
        raise SpecError(what, f"{p} is not valid JSON ({exc.msg} at line {exc.lineno})",
                        "re-create it with `planner search`") from None


def plan_document(plan: Plan, model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, *,
                  scale: str | None = None, model_arg: str = "", command: str = "") -> dict[str, Any]:
    return {"version": VERSION, "plan": plan.to_dict(), "description": plan.describe(),
            "inputs": {"model": model.to_dict(), "cluster": cluster.to_dict(), "train": train.to_dict(),
                       "scale": scale, "model_arg": model_arg, "profile": cluster.device.path,
                       "command": command}}


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSpecs:
    """A run directory's plan.json read back into specs (load_run): what every reader of a run
    directory starts from (the exports' RunFiles and the report's RunData extend it)."""

    run_dir: Path
    plan: Plan
    model: ModelSpec
    cluster: ClusterSpec
    train: TrainSpec
    doc: dict[str, Any]
    """plan.json as read."""


def load_run(path: str | Path) -> tuple[Plan, ModelSpec, ClusterSpec, TrainSpec, dict[str, Any]]:
    """Read plan.json (a run directory or the file itself) back into specs."""
    p = Path(path)
    plan_file = p / "plan.json" if p.is_dir() else p
    doc = read_json(plan_file, "plan.json")
    if not isinstance(doc, dict) or "plan" not in doc or "inputs" not in doc:
        raise SpecError(str(plan_file), "is not a planner plan.json (no plan/inputs sections)",
                        "give a directory written by `planner search`")
    if doc.get("version") != VERSION:
        raise SpecError(str(plan_file), f"has version {doc.get('version')!r}, this planner reads {VERSION}",
                        "re-run `planner search`")
    inputs = doc["inputs"]
    try:
        plan = Plan.from_dict(doc["plan"])
        model = ModelSpec.from_dict(inputs["model"])
        train = TrainSpec(**inputs["train"])
        c = inputs["cluster"]
        prof = load_profile(c["profile"]) if c.get("profile") and Path(c["profile"]).exists() \
            else find_device(c["device"])[0]
        cluster = ClusterSpec(nodes=c["nodes"], gpus_per_node=c["gpus_per_node"], device=prof,
                              intra_node=Link(**c["intra_node"]), inter_node=Link(**c["inter_node"]),
                              spec=c.get("spec", ""), note=c.get("note", ""),
                              host=Host(**c["host"]) if "host" in c else None,
                              memory_headroom=c.get("memory_headroom"))
    except (KeyError, TypeError) as exc:
        raise SpecError(str(plan_file), f"is missing or has a malformed field ({exc})", "re-run `planner search`") from None
    return plan, model, cluster, train, doc
