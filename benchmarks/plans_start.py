"""Feasible means starts (issue 8, point 6): every plan the search marks feasible must start
under DeepSpeed as written.

For each tiny model (`--scale tiny`) and each world size (`--gpus Nxcpu`) this runs the real
search over its whole space (planner.search.driver.search, exhaustive: the same Space,
Evaluator and exact inner solvers as `planner search`), writes each distinct feasible plan's
run directory with `planner search`'s own writer (planner.search.outputs.write_outputs:
plan.json, estimate.json, ds_config.json, launch.sh, trials.csv) and starts it for ONE
optimizer step exactly as `planner run` does (planner.runtime.train.launch.run_plan, default
batching and data workers). A plan "started" when the run ends with status ok and a finite
loss. Prints one row per plan (processes, started, wall seconds, the one-line cause of a
failure) and the totals.

Two more cases come from the search, not from the default spaces:
- partial full recompute: on this machine's CPU profile nothing needs checkpointing, so the
  search is rerun with a copy of the profile whose memory sits between a plan's need with no
  block and with every block checkpointed (`planner search --profile tight.json`); the
  checkpoint solver then checkpoints part of the blocks;
- the GLM-130B pick (`planner search --model glm-130b --gpus 96x8xA100-40GB --global-batch
  4224 --seq-len 2048`, run as a subprocess) shrunk to TP2 x PP2 x DP2 on glm-130b tiny with
  the pick's ZeRO stage, recompute mode and checkpointing pattern (scaled), micro-batch,
  precision and attention kernel, for a few steps (`shrink_pick`).

    flock /tmp/planner-cpu.lock .venv/bin/python benchmarks/plans_start.py            # everything
    .venv/bin/python benchmarks/plans_start.py --lock /tmp/planner-cpu.lock --budget-s 7200
    .venv/bin/python benchmarks/plans_start.py --limit 40 --seed 1 --models glm-10b --worlds 8
    .venv/bin/python benchmarks/plans_start.py --list                                  # count only
    # mixture of experts (DeepSpeed-MoE, EP) and Ulysses context parallelism (issue 22): every
    # feasible plan of tiny GLM-4.5-Air, and of tiny ChatGLM3 with cp > 1 (its cp-free plans are
    # the sweep above), with the search offering cp at the tiny models' 128-token sequences:
    .venv/bin/python benchmarks/plans_start.py --moe-cp --lock /tmp/planner-cpu.lock
    # the same with up to 40 plans of one world size per launch of the ranks (import and
    # profiler start paid once per launch; planner/runtime/train/batch.py):
    nice -n 19 .venv/bin/python -u benchmarks/plans_start.py --moe-cp --batch 40

The feasible plans are started in a seeded random order (`--seed`), so `--limit N` or a time
budget (`--budget-s S`: no new start after S seconds; the rest are counted as not tried) give
a uniform sample of all the spaces. `--lock PATH` takes the lock around each start instead
of the whole sweep, so other jobs on shared cores run between plans. Sequence-parallel
plans are ordinary feasible plans (the executor's TP layers run them). The exhaustive sweep's feasible plans include every plan the default Optuna search can mark
feasible (the same Evaluator). tests/integration/test_plans_start.py starts a seeded sample
of the same plans with these functions.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

REPO = Path(__file__).resolve().parents[1]

from planner import dsconfig
from planner.cli.common import load_cluster, load_model, load_train
from planner.cost import estimate
from planner.errors import PlannerError
from planner.rundir import atomic_write_json, load_run, plan_document
from planner.runtime.files import RANKS_DIR
from planner.search.driver import SearchResult, search
from planner.search.evaluate import Trial
from planner.specs import Plan, TrainSpec, parse_cluster
from planner.specs.cluster import ClusterSpec
from planner.specs.model import ModelSpec
from planner.specs.validate import plan_problems

os.environ.setdefault("DS_ACCELERATOR", "cpu")

MODELS = ("chatglm3-6b", "glm-10b", "glm-130b")
"""The tiny models: GQA + SwiGLU + RMSNorm (ChatGLM3), MHA + GELU + LayerNorm + learned
positions + tied embeddings + dropout (GLM-10B), DeepNorm + GeGLU + dropout (GLM-130B)."""
WORLDS = (2, 4, 8)
ATTENTIONS = ("flash", "eager")
MOE_CP_MODELS = ("glm-4.5-air", "chatglm3-6b")
"""--moe-cp: a tiny MoE (GLM-4.5-Air: 4 experts top-2, a shared expert, a dense first block,
sigmoid router) and a GLM for Ulysses (ChatGLM3: 32 heads, 2 KV groups); searched with
Space.context_parallel "on", flash attention (cp is modelled with the flash kernel only)."""


def moe_or_cp(c: "Case") -> bool:
    """A plan with the issue-22 layers: a MoE model's (every such plan runs DeepSpeed-MoE), or cp > 1."""
    return c.searched.model.moe is not None or c.plan.cp > 1


GLM130B_SEARCH = ("--model", "glm-130b", "--gpus", "96x8xA100-40GB", "--global-batch", "4224", "--seq-len", "2048")
"""The flagship search of the README and issue 8 (Zeng et al. 2022: global batch 4224, seq 2048)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Searched:
    """One `planner search --scale tiny --exhaustive` and its inputs."""

    model_arg: str
    gpus: str
    model: ModelSpec
    cluster: ClusterSpec
    train: TrainSpec
    result: SearchResult
    command: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    """One plan to start: a feasible trial of a search (or a plan derived from one)."""

    searched: Searched
    plan: Plan
    trial: Trial | None = None
    """The search's trial; None for a derived plan (the shrunk GLM-130B pick)."""
    kind: str = ""
    """Why it is in a sample (tp x pp, zero-3 + tp, ...); empty for an ordinary plan."""

    @property
    def processes(self) -> int:
        return self.plan.world_size

    def label(self) -> str:
        p = self.plan
        rc = p.recompute
        if rc == "full":
            rc = f"full {list(p.recompute_layers)}"
        parts = [f"{self.searched.model.name}", f"TP{p.tp}xPP{p.pp}xDP{p.dp}", f"ZeRO-{p.zero}",
                 f"mb{p.micro_batch}x{p.grad_accum}", rc, self.searched.train.attention]
        if p.sequence_parallel:
            parts.append("SP")
        if p.ep > 1:
            parts.append(f"EP{p.ep}")
        if p.cp > 1:
            parts.append(f"{'Ulysses' if p.cp_kind == 'ulysses' else 'ring'}{p.cp}")
        if p.pp > 1:
            parts.append(f"stages {list(p.stage_layers)}")
        return " ".join(parts)


def run_search(model_arg: str, gpus: str, attention: str = "flash", profile: str | None = None,
               context_parallel: str = "auto") -> Searched:
    """`planner search --model M --scale tiny --gpus G [--attention A] [--profile P] --exhaustive`
    (default batch and sequence for CPU), as a library call."""
    model = load_model(model_arg, "tiny")
    cluster = load_cluster(gpus, profile, None, None, None)
    train = load_train(model, cluster, None, None, None, attention)
    result = search(model, cluster, train, exhaustive=True, context_parallel=context_parallel)
    cmd = f"planner search --model {model_arg} --scale tiny --gpus {gpus} --exhaustive"
    if context_parallel != "auto":
        cmd += f" (Space.context_parallel {context_parallel})"
    if attention != "flash":
        cmd += f" --attention {attention}"
    if profile:
        cmd += f" --profile {profile}"
    return Searched(model_arg=model_arg, gpus=gpus, model=model, cluster=cluster, train=train, result=result,
                    command=cmd)


def feasible(s: Searched) -> list[Case]:
    """Every distinct plan the search marked feasible (SearchResult.ranked), fastest first."""
    return [Case(searched=s, plan=t.plan, trial=t) for t in s.result.ranked]


def spaces(models: Iterable[str] = MODELS, worlds: Iterable[int] = WORLDS,
           attentions: Iterable[str] = ATTENTIONS, context_parallel: str = "auto") -> list[Searched]:
    return [run_search(m, f"{w}xcpu", a, context_parallel=context_parallel)
            for m in models for w in worlds for a in attentions]


def tight_profile(s: Searched, path: Path) -> Path | None:
    """A copy of `s`'s CPU profile whose memory lies between a feasible plan's need with no
    block checkpointed and with every block checkpointed (three quarters of the way up), so
    that the checkpoint solver must checkpoint some blocks but not all. The plan chosen is the
    first in the search's order with a pipeline (per-stage counts) and at least two blocks
    per stage. None when no plan qualifies."""
    for t in s.result.ranked:
        p = t.plan
        if p.recompute != "none" or p.pp < 2 or min(p.layers_per_stage(s.model.layers)) < 2:
            continue
        every = dataclasses.replace(p, recompute="full", recompute_layers=p.layers_per_stage(s.model.layers))
        need_none = estimate(s.model, s.cluster, s.train, p).peak_memory_bytes
        need_all = estimate(s.model, s.cluster, s.train, every).peak_memory_bytes
        if need_all >= need_none:
            continue
        per_device = need_all + 0.75 * (need_none - need_all)
        doc = json.loads(Path(s.cluster.device.path).read_text())
        # CPU "devices" share the host: ClusterSpec.memory_bytes = memory_gb * 1e9 / devices per node
        doc["memory_gb"] = per_device * s.cluster.gpus_per_node / 1e9
        doc["source"] = (f"benchmarks/plans_start.py: {Path(s.cluster.device.path).name} with memory between "
                         f"{need_all / 1e9:.4f} and {need_none / 1e9:.4f} GB per process ({p.describe()})")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=2) + "\n")
        return path
    return None


def partial_recompute(model_arg: str, gpus: str, workdir: Path, attention: str = "flash") -> list[Case]:
    """Feasible plans of `planner search --profile tight.json` that checkpoint some blocks but
    not all (recompute full, 0 < checkpointed < layers)."""
    base = run_search(model_arg, gpus, attention)
    prof = tight_profile(base, workdir / f"tight-{model_arg}-{gpus}.json")
    if prof is None:
        return []
    s = run_search(model_arg, gpus, attention, profile=str(prof))
    return [c for c in feasible(s)
            if c.plan.recompute == "full" and 0 < sum(c.plan.recompute_layers) < s.model.layers]


def write_run(case: Case, run_dir: Path) -> Path:
    """The run directory `planner search` would write had it chosen this plan."""
    from planner.search.outputs import write_outputs
    s = case.searched
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    if case.trial is not None:
        chosen = dataclasses.replace(s.result, ranked=(case.trial,))
        write_outputs(run_dir, chosen, s.model, s.cluster, s.train, scale="tiny", model_arg=s.model_arg,
                       command=s.command, top=1)
    else:  # a derived plan: the files `planner search --refine` writes per plan
        est = estimate(s.model, s.cluster, s.train, case.plan)
        atomic_write_json(run_dir / "plan.json", plan_document(case.plan, s.model, s.cluster, s.train, scale="tiny",
                                                               model_arg=s.model_arg, command=s.command))
        atomic_write_json(run_dir / "estimate.json", {"plan": case.plan.to_dict(), "estimate": est.to_json()})
        atomic_write_json(run_dir / "ds_config.json", dsconfig.ds_config(case.plan, s.model, s.train, s.cluster))
    return run_dir


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    case: Case
    started: bool
    wall_s: float
    loss: tuple[float, ...] = ()
    cause: str = ""


def start(case: Case, run_dir: Path, *, steps: int = 1, warmup: int = 0, timeout: float = 300.0) -> Outcome:
    """Write the run directory and run the plan as `planner run DIR --steps 1 --warmup 0` does."""
    from planner.runtime.train.launch import run_plan
    write_run(case, run_dir)
    t0 = time.perf_counter()
    try:
        m = run_plan(run_dir, steps=steps, warmup=warmup, timeout=timeout)
    except PlannerError as exc:
        return Outcome(case=case, started=False, wall_s=time.perf_counter() - t0, cause=exc.line())
    return outcome(case, m, time.perf_counter() - t0, steps)


def start_batch(cases: list[Case], run_dirs: list[Path], *, steps: int = 1, warmup: int = 0,
                timeout: float = 300.0) -> list[Outcome]:
    """start() for plans of one world size with one launch of the ranks for all of them
    (planner.runtime.train.batch.run_plans: the same run directories and trainer, fresh engine,
    groups and data per plan, DeepSpeed's process-wide state restored between plans). The wall
    time of each is the batch's divided evenly."""
    from planner.runtime.train.batch import run_plans
    for c, d in zip(cases, run_dirs):
        write_run(c, d)
    t0 = time.perf_counter()
    results = run_plans(run_dirs, steps=steps, warmup=warmup, timeout=timeout)
    wall = (time.perf_counter() - t0) / max(1, len(cases))
    return [Outcome(case=c, started=False, wall_s=wall, cause=m.line()) if isinstance(m, PlannerError)
            else outcome(c, m, wall, steps) for c, m in zip(cases, results)]


def outcome(case: Case, m: dict[str, Any], wall: float, steps: int) -> Outcome:
    """A run's metrics.json as a start's outcome: started when status ok and `steps` finite losses."""
    loss = tuple(float(x) for x in m.get("loss") or ())
    if m.get("status") != "ok":
        return Outcome(case=case, started=False, wall_s=wall, loss=loss, cause=f"status {m.get('status')}: {m.get('error')}")
    if len(loss) != steps or not all(math.isfinite(x) for x in loss):
        return Outcome(case=case, started=False, wall_s=wall, loss=loss, cause=f"loss {list(loss)} over {steps} step(s)")
    return Outcome(case=case, started=True, wall_s=wall, loss=loss)


# ---- the GLM-130B pick, shrunk ---------------------------------------------------------------

def glm130b_pick(workdir: Path) -> tuple[Plan, ModelSpec, TrainSpec, dict[str, Any]]:
    """Run `planner search` for GLM-130B on 96x8xA100-40GB (the CLI, as a user would) and read
    its plan.json back."""
    out = workdir / "glm130b-search"
    cmd = [sys.executable, "-m", "planner", "search", *GLM130B_SEARCH, "--out-dir", str(out), "--name", "pick"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    plan, model, _cluster, train, doc = load_run(out / "pick")
    return plan, model, train, doc


def _split(weights: list[float], total: int, lo: int) -> list[int]:
    """`total` split in proportion to `weights` (largest remainder), each part at least `lo`."""
    n = len(weights)
    free = total - lo * n
    raw = [free * w / sum(weights) for w in weights]
    out = [math.floor(x) for x in raw]
    for i in sorted(range(n), key=lambda i: raw[i] - out[i], reverse=True)[:free - sum(out)]:
        out[i] += 1
    return [lo + x for x in out]


def shrink_pick(pick: Plan, pick_layers: int, pick_train: TrainSpec, tiny: ModelSpec,
                seq_len: int = 128) -> tuple[Plan, TrainSpec]:
    """The pick's layout on `tiny`: each parallel degree above 1 becomes 2 (TP2 x PP2 x DP2 for a
    TP x PP x DP pick); ZeRO stage, micro-batch, recompute mode, sequence parallelism, schedule,
    precision and attention kernel kept; the blocks per stage in the proportions of the pick's
    (pick stages grouped contiguously onto the shrunk ones); under full recompute each shrunk
    stage checkpoints the share of its blocks that its group of pick stages checkpointed,
    rounded, and kept partial where the pick was partial (at least one block if the group
    checkpointed any, at least one block left if the group left any). Accumulation: two
    micro-batches per stage (at least 2, at most the pick's), so the pipeline fills."""
    tp, pp, dp = (2 if d > 1 else 1 for d in (pick.tp, pick.pp, pick.dp))
    stages = pick.layers_per_stage(pick_layers)
    groups = [list(range(len(stages)))[i * len(stages) // pp:(i + 1) * len(stages) // pp] for i in range(pp)]
    stage_layers = tuple(_split([sum(stages[j] for j in g) for g in groups], tiny.layers, 1))
    recompute_layers: tuple[int, ...] = ()
    if pick.recompute == "full":
        ck = pick.recompute_layers or stages  # empty = every block (Plan semantics)
        counts = []
        for g, n in zip(groups, stage_layers):
            done, of = sum(ck[j] for j in g), sum(stages[j] for j in g)
            k = round(n * done / of)
            if done > 0:
                k = max(k, 1)
            if done < of and n > 1:
                k = min(k, n - 1)
            counts.append(k)
        recompute_layers = tuple(counts)
    ga = max(2, min(pick.grad_accum, 2 * pp))
    plan = Plan(dp=dp, tp=tp, pp=pp, zero=pick.zero, micro_batch=pick.micro_batch, grad_accum=ga,
                stage_layers=stage_layers if pp > 1 else (), recompute=pick.recompute,
                recompute_layers=recompute_layers, sequence_parallel=pick.sequence_parallel,
                schedule=pick.schedule, interleave=pick.interleave, precision=pick.precision,
                overlap_comm=pick.overlap_comm, bucket_elements=min(pick.bucket_elements, 2_000_000))
    train = TrainSpec(global_batch=plan.global_batch, seq_len=seq_len, precision=pick.precision,
                      attention=pick_train.attention)
    return plan, train


def shrunk_glm130b(workdir: Path) -> tuple[Case, Plan]:
    """(the shrunk case on glm-130b tiny, the real pick it was derived from)."""
    pick, model, train, _doc = glm130b_pick(workdir)
    tiny = load_model("glm-130b", "tiny")
    plan, tiny_train = shrink_pick(pick, model.layers, train, tiny)
    cluster = parse_cluster(f"{plan.world_size}xcpu")
    problems = plan_problems(tiny, cluster, tiny_train, plan)
    if problems:
        raise RuntimeError(f"shrunk plan {plan.describe()} is not legal: {[p.line for p in problems]}")
    est = estimate(tiny, cluster, tiny_train, plan)
    from planner.search.baseline import conventional_baseline
    base_plan, base = conventional_baseline(tiny, cluster, tiny_train)
    result = SearchResult(method="shrunk", trials=(), ranked=(), baseline_plan=base_plan, baseline=base,
                          space_size=0, wall_s=0.0)
    s = Searched(model_arg="glm-130b", gpus=cluster.spec, model=tiny, cluster=cluster, train=tiny_train,
                 result=result, command=f"benchmarks/plans_start.py: shrunk from `planner search "
                                        f"{' '.join(GLM130B_SEARCH)}` ({pick.describe()}); predicted "
                                        f"{est.peak_memory_gb:.3f} GB per rank")
    return Case(searched=s, plan=plan, kind="glm-130b pick, shrunk"), pick


# ---- the table ---------------------------------------------------------------------------------

def row(o: Outcome) -> str:
    started = "yes" if o.started else "NO"
    cause = f"  {o.loss[0]:.6f}" if o.started else f"  {o.cause[:300]}"
    return f"{o.case.label():78s} {o.case.processes:>3d} {started:>7s} {o.wall_s:8.1f}{cause}"


HEADER = f"{'plan':78s} {'np':>3s} {'started':>7s} {'wall s':>8s}  first loss, or the cause"


class _Lock:
    """`flock PATH` around each start (None: no lock), so other jobs sharing the cores can run
    between plans of a long sweep."""

    def __init__(self, path: str | None) -> None:
        self.path, self.fh = path, None

    def __enter__(self) -> Self:
        if self.path:
            import fcntl
            self.fh = open(self.path, "a")
            fcntl.flock(self.fh, fcntl.LOCK_EX)
        return self

    def __exit__(self, *_: object) -> None:
        if self.fh is not None:
            self.fh.close()  # closing the descriptor releases the lock
            self.fh = None


def run_all(cases: list[Case], root: Path, *, budget_s: float | None = None, steps: int = 1, warmup: int = 0,
            lock: str | None = None, echo: Callable[[str], None] = print, batch: int = 1) -> tuple[list[Outcome], int]:
    """Start the cases in order; returns the outcomes and how many were not tried (budget).
    batch > 1: up to `batch` plans of one world size per launch (start_batch), the cases
    grouped by world size in their order."""
    if batch > 1:
        return _run_batched(cases, root, budget_s=budget_s, steps=steps, warmup=warmup, lock=lock, echo=echo,
                            batch=batch)
    outcomes: list[Outcome] = []
    t0 = time.perf_counter()
    for i, c in enumerate(cases):
        if budget_s is not None and time.perf_counter() - t0 > budget_s:
            return outcomes, len(cases) - i
        with _Lock(lock):
            o = start(c, root / f"plan-{i:04d}", steps=steps, warmup=warmup)
        if o.started:
            shutil.rmtree(root / f"plan-{i:04d}", ignore_errors=True)
        outcomes.append(o)
        echo(row(o))
    return outcomes, 0


def _run_batched(cases: list[Case], root: Path, *, budget_s: float | None, steps: int, warmup: int,
                 lock: str | None, echo: Callable[[str], None], batch: int) -> tuple[list[Outcome], int]:
    """run_all with `batch` plans per launch: per world size (in order of first appearance), the
    cases in their order, in chunks of `batch`."""
    by_np: dict[int, list[tuple[int, Case]]] = {}
    for i, c in enumerate(cases):
        by_np.setdefault(c.processes, []).append((i, c))
    chunks = [g[j:j + batch] for g in by_np.values() for j in range(0, len(g), batch)]
    outcomes: list[Outcome] = []
    t0 = time.perf_counter()
    for n, chunk in enumerate(chunks):
        if budget_s is not None and time.perf_counter() - t0 > budget_s:
            return outcomes, sum(len(ch) for ch in chunks[n:])
        dirs = [root / f"plan-{i:04d}" for i, _ in chunk]
        with _Lock(lock):
            got = start_batch([c for _, c in chunk], dirs, steps=steps, warmup=warmup)
        echo(_live_line(dirs))
        for o, d in zip(got, dirs):
            if o.started:
                shutil.rmtree(d, ignore_errors=True)
            outcomes.append(o)
            echo(row(o))
    return outcomes, 0


def _live_line(dirs: list[Path]) -> str:
    """Rank 0's threads and process groups at each plan's start in a batch (the `live` counts
    planner/runtime/train/batch.py writes): flat after the first plan of a launch unless plans
    leak (docs/moe.md "Batched starts")."""
    live = []
    for d in dirs:
        try:
            v = json.loads((d / RANKS_DIR / "rank0.json").read_text()).get("live") or {}
        except (OSError, ValueError):
            v = {}
        live.append(f"{v.get('threads', '?')}/{v.get('process_groups', '?')}")
    return f"  batch of {len(dirs)}: rank 0 threads/process groups at each plan's start: {' '.join(live)}"


def _summary(outcomes: list[Outcome]) -> None:
    by_np: dict[int, list[Outcome]] = {}
    for o in outcomes:
        by_np.setdefault(o.case.processes, []).append(o)
    for n in sorted(by_np):
        group = by_np[n]
        print(f"  {n} processes: {sum(o.started for o in group)}/{len(group)} started, "
              f"mean {sum(o.wall_s for o in group) / len(group):.1f} s per plan")
    for what, pred in (("EP > 1", lambda c: c.plan.ep > 1), ("Ulysses cp > 1", lambda c: c.plan.cp > 1),
                       ("EP > 1 and cp > 1", lambda c: c.plan.ep > 1 and c.plan.cp > 1)):
        group = [o for o in outcomes if pred(o.case)]
        if group:
            print(f"  {what}: {sum(o.started for o in group)}/{len(group)} started")
    for m in sorted({o.case.searched.model.name for o in outcomes}):
        group = [o for o in outcomes if o.case.searched.model.name == m]
        print(f"  {m}: {sum(o.started for o in group)}/{len(group)} started")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--worlds", default=",".join(map(str, WORLDS)))
    ap.add_argument("--attention", default=",".join(ATTENTIONS))
    ap.add_argument("--limit", type=int, default=0, help="start at most N feasible plans (0: all)")
    ap.add_argument("--seed", type=int, default=0, help="order (and, with --limit or --budget-s, sample) seed")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop starting feasible plans after S seconds (the rest: not tried)")
    ap.add_argument("--no-extra", action="store_true", help="skip the partial-recompute and GLM-130B cases")
    ap.add_argument("--lock", default=None, metavar="PATH",
                    help="take `flock PATH` around each start instead of for the whole sweep")
    ap.add_argument("--shrunk-steps", type=int, default=20, help="steps of the shrunk GLM-130B pick")
    ap.add_argument("--list", action="store_true", help="count the plans, start nothing")
    ap.add_argument("--context-parallel", default="auto", choices=("auto", "on", "off"),
                    help="Space.context_parallel: 'on' searches Ulysses/ring cp at the tiny models' short "
                         "sequences (auto offers it from 16,384 tokens)")
    ap.add_argument("--moe-cp", action="store_true",
                    help=f"the issue-22 sweep: models {','.join(MOE_CP_MODELS)}, flash attention, --context-parallel "
                         "on, --no-extra, and only the plans with MoE layers or cp > 1")
    ap.add_argument("--batch", type=int, default=1, metavar="N",
                    help="start up to N plans of one world size per launch of the ranks (planner.runtime.train.batch; "
                         "1: one launch per plan, as `planner run`)")
    ap.add_argument("--keep", default="", help="directory for the run directories (default: a temporary one, "
                                               "removed unless a run failed)")
    args = ap.parse_args(argv)
    if args.moe_cp:
        args.models, args.attention, args.context_parallel, args.no_extra = \
            ",".join(MOE_CP_MODELS), "flash", "on", True
    models = [m for m in args.models.split(",") if m]
    worlds = [int(w) for w in args.worlds.split(",") if w]
    attentions = [a for a in args.attention.split(",") if a]
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="plans-start-"))
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    searched = spaces(models, worlds, attentions, args.context_parallel)
    keep = moe_or_cp if args.moe_cp else (lambda c: True)
    cases = [c for s in searched for c in feasible(s) if keep(c)]
    for s in searched:
        ranked = s.result.ranked
        print(f"{s.command}: {len(ranked)} feasible distinct plans of {s.result.distinct} evaluated "
              f"({sum(t.plan.sequence_parallel for t in ranked)} with sequence parallelism, "
              f"{sum(t.plan.ep > 1 for t in ranked)} with EP > 1, {sum(t.plan.cp > 1 for t in ranked)} with cp > 1, "
              f"{sum(t.plan.pp > 1 for t in ranked)} with pp > 1)")
    rng = random.Random(args.seed)
    rng.shuffle(cases)  # a budget-limited sweep is then a uniform sample of all spaces
    n_feasible = len(cases)
    if args.limit:
        cases = cases[:args.limit]
    extra: list[Case] = []
    if not args.no_extra:
        for m in models:
            extra += partial_recompute(m, f"{4 if 4 in worlds else worlds[0]}xcpu", root, attentions[0])[:1]
    print(f"{n_feasible} feasible plans in {len(searched)} searches ({time.perf_counter() - t0:.1f} s): starting "
          f"{len(cases)}; + {len(extra)} partial-recompute plans from a tighter profile")
    if args.list:
        return 0
    print(HEADER)
    outcomes, untried = run_all(cases, root, budget_s=args.budget_s, lock=args.lock, batch=args.batch,
                                echo=lambda line: print(line, flush=True))
    more, _ = run_all(extra, root / "partial", lock=args.lock)
    shrunk_line = ""
    if not args.no_extra and "glm-130b" in models:
        case, pick = shrunk_glm130b(root)
        with _Lock(args.lock):
            o = start(case, root / "glm130b-shrunk", steps=args.shrunk_steps, warmup=1)
        print(row(o))
        more.append(o)
        k = max(1, len(o.loss) // 4)  # mean of the last quarter vs the first (single steps are noisy)
        falling = len(o.loss) > 1 and sum(o.loss[-k:]) / k < sum(o.loss[:k]) / k
        shrunk_line = (f"GLM-130B pick: {pick.describe()}, blocks per stage {list(pick.layers_per_stage(70))}"
                       + (f", checkpointed {list(pick.recompute_layers)}" if pick.recompute_layers else "")
                       + f", {case.searched.train.attention} attention\n  shrunk: {case.label()}: "
                       + (f"{len(o.loss)} steps, loss {' '.join(f'{x:.3f}' for x in o.loss)} ({'falling' if falling else 'NOT falling'})"
                          if o.started else f"FAILED: {o.cause}"))
    print()
    ok = sum(o.started for o in outcomes)
    print(f"feasible plans: {n_feasible} in the spaces, {len(outcomes)} tried, {ok} started, "
          f"{len(outcomes) - ok} failed, {n_feasible - len(outcomes)} not tried"
          + (f" ({untried} for the budget)" if untried else ""))
    _summary(outcomes)
    if more:
        print(f"partial recompute and shrunk GLM-130B: {sum(o.started for o in more)}/{len(more)} started")
    if shrunk_line:
        print(shrunk_line)
    print(f"wall {time.perf_counter() - t0:.0f} s")
    failed = [o for o in outcomes + more if not o.started]
    if failed:
        print(f"failed runs kept under {root}")
    elif not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
