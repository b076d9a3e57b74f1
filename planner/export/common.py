"""What every export target reads: the run directory's plan, specs and DeepSpeed config."""
from __future__ import annotations

import copy
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner import dsconfig
from planner.errors import SpecError
from planner.rundir import RunSpecs, load_run, read_json
from planner.specs.validate import runtime_problems

PLANNER_ONLY_KEYS = (("pipeline", "stage_layers"),)
"""ds_config keys the planner's executor reads and DeepSpeed ignores (planner/dsconfig.py)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunFiles(RunSpecs):
    ds_config: dict[str, Any]
    """ds_config.json as written (or as planner.dsconfig would write it, when absent)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Export:
    files: dict[str, str | dict[str, Any]]
    """File name -> text or JSON document, in the order written."""
    warnings: tuple[str, ...] = ()
    """What the target expresses differently from the plan (printed, and in the README)."""
    run: str = ""
    """How to start it, one line."""


def load_files(run_dir: str | Path) -> RunFiles:
    run = Path(run_dir)
    if not run.is_dir():
        raise SpecError("RUN_DIR", f"{run} is not a directory",
                        "give a run directory written by `planner search` or `planner estimate --write`")
    plan, model, cluster, train, doc = load_run(run)
    cfg_path = run / "ds_config.json"
    cfg = read_json(cfg_path, "ds_config.json") if cfg_path.exists() \
        else dsconfig.ds_config(plan, model, train, cluster)
    if not isinstance(cfg, dict):
        raise SpecError(str(cfg_path), "is not a JSON object", "re-create it with `planner search`")
    return RunFiles(run_dir=run, plan=plan, model=model, cluster=cluster, train=train, doc=doc, ds_config=cfg)


def refuse_runtime(run: RunFiles, target: str) -> None:
    """A plan DeepSpeed cannot run (interleaved 1F1B, MiCS) is no plan for these tools either."""
    problems = runtime_problems(run.plan)
    if problems:
        raise SpecError("--to", f"{target} cannot run this plan: {problems[0]}",
                        "use --to megatron-lm" if run.plan.runtime == "megatron-core" else
                        "export a plan DeepSpeed runs (search with --runtime deepspeed)")


def refuse_3d(run: RunFiles, target: str) -> None:
    p = run.plan
    if p.tp > 1 or p.pp > 1:
        raise SpecError("--to", f"{target} cannot express TP/PP (the plan is TP {p.tp} x PP {p.pp})",
                        "use --to megatron-deepspeed (or --to torchrun for the planner's own worker)")


def plain_ds_config(run: RunFiles) -> dict[str, Any]:
    """ds_config.json without the planner-only keys, every number as the plan has it."""
    cfg = copy.deepcopy(run.ds_config)
    for section, key in PLANNER_ONLY_KEYS:
        if isinstance(cfg.get(section), dict):
            cfg[section].pop(key, None)
    return cfg


def optimizer_params(run: RunFiles) -> dict[str, Any]:
    """AdamW hyperparameters: the config's optimizer block, else the executor's (planner.dsconfig.OPTIMIZER)."""
    opt = run.ds_config.get("optimizer")
    params = opt.get("params") if isinstance(opt, dict) else None
    out = dict(dsconfig.OPTIMIZER)
    if isinstance(params, dict):
        out.update({k: v for k, v in params.items() if k in out})
    return out


def clip(run: RunFiles) -> float:
    v = run.ds_config.get("gradient_clipping", dsconfig.GRADIENT_CLIPPING)
    return float(v) if isinstance(v, (int, float)) else dsconfig.GRADIENT_CLIPPING


def schedule(run: RunFiles) -> dict[str, Any]:
    """The learning-rate schedule of the config's "scheduler" block, when it has one:
    {"kind": cosine|constant, "warmup_steps", "total_steps" (cosine), "min_ratio" (cosine)}; {} otherwise."""
    s = run.ds_config.get("scheduler")
    if not isinstance(s, dict) or not isinstance(s.get("params"), dict):
        return {}
    p = s["params"]
    if s.get("type") == "WarmupCosineLR":
        return {"kind": "cosine", "warmup_steps": int(p.get("warmup_num_steps", 0)),
                "total_steps": int(p.get("total_num_steps", 0)), "min_ratio": float(p.get("cos_min_ratio", 0.0))}
    if s.get("type") == "WarmupLR":
        return {"kind": "constant", "warmup_steps": int(p.get("warmup_num_steps", 0))
                if p.get("warmup_min_lr") != p.get("warmup_max_lr") else 0}
    return {}


def readme(title: str, run: RunFiles, lines: list[str], warnings: tuple[str, ...] | list[str]) -> str:
    out = [f"# {title}", "", f"Plan: {run.plan.describe()} ({run.model.name}, {run.cluster.world_size} devices)",
           f"From: {run.run_dir.resolve()}", ""] + lines
    if warnings:
        out += ["", "## Differences from the plan", ""] + [f"- {w}" for w in warnings]
    return "\n".join(out) + "\n"


def arg_lines(args: list[str]) -> list[str]:
    """A bash array body: one flag (and its value) per line; ${VAR} placeholders double-quoted,
    everything else shell-quoted."""
    out, i = [], 0
    while i < len(args):
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            v = args[i + 1]
            out.append(f"  {args[i]} " + (f'"{v}"' if v.startswith("${") else shlex.quote(v)))
            i += 2
        else:
            out.append(f"  {args[i]}")
            i += 1
    return out
