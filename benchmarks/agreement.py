"""Measured agreement, layout by layout (issue 8, point 5): the cost model against the runtime it
describes, per rank, on CPU processes of this machine (DeepSpeed, gloo).

    flock /tmp/planner-cpu.lock .venv/bin/python benchmarks/agreement.py
    .venv/bin/python benchmarks/agreement.py --lock /tmp/planner-cpu.lock     # the lock per run only
    .venv/bin/python benchmarks/agreement.py --reuse                          # re-analyse saved rounds

Every layout of the parity test (tests/integration/test_parity.py) and more with recompute,
accumulation and fp32, on chatglm3-6b tiny and small (GQA, SwiGLU, RMSNorm, rotary) and a few on
glm-10b tiny (LayerNorm, GELU, learned positions, tied embeddings, dropout 0.1), runs for real
(planner.runtime.train.launch.run_plan, worker --measure-activations), --rounds times round-robin
(planner.tune.bench). Per layout, worst over its ranks:
- states: model-state bytes the executor counts tensor by tensor, by the estimate's classes
  (params, grads, optimizer, buckets, other; metrics.json model_state_breakdown_gb_per_rank)
  against the cost model's prediction of the same count (metrics.json predicted, from
  planner.cost.states: after backward, or after the step under a pipeline), worst class;
  target 1%;
- allocated peak: the peak of live tensor bytes per rank during the warm-up steps
  (planner.runtime.observe.allocated.AllocatedMeter; a GPU's max_memory_allocated) against the
  estimate's allocated_memory of the rank's stage (no calibration); target 5%;
- activations: the bytes each block keeps for backward in a real step (ActivationRecorder:
  saved-tensor hooks + the checkpoints' inputs) against planner.cost.memory, worst block;
  target 5%. "extras" (not a target): the stage's shared tensors, embedding and head;
- peak RSS and step time held out: `planner calibrate` (planner.calibrate.calibrate) on
  this machine's `planner profile --quick` profile and every run here, each run predicted by
  a fit that did not see it (leave-one-out); targets 10% and 15%.
Then the search's regret: `planner search` (exhaustive) with the calibrated profile on 2xcpu and 4xcpu
for the tiny model at the benchmark's global batch and sequence; its pick is run if it was
not, and its measured step time is divided by the fastest measured plan of that cluster,
batch, precision and attention kernel.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from planner.calibrate import apply, calibrate
from planner.calibrate.accuracy import rel_error
from planner.tune.bench import Setup, measured_run, profile_machine, round_robin, step_time
from planner.cost import estimate, memory
from planner.cost.attention import attention_kernel
from planner.cost.model import rebuilds_shared_per_block
from planner.errors import PlannerError
from planner.runtime.preflight.lab import check_metrics, check_profile
from planner.rundir import atomic_write_json
from planner.search.driver import search
from planner.specs import Plan, TrainSpec, load_profile, parse_cluster, preset, scale

GLOBAL_BATCH, SEQ = 8, 128
TARGETS = {"states": 1.0, "activations": 5.0, "allocated": 5.0, "memory": 10.0, "time": 15.0}
REGRET_WORLDS = (2, 4)

CHATGLM = [  # (layout, plan, attention)
    ("DP2", Plan(dp=2, micro_batch=2, grad_accum=2), "flash"),
    ("TP2", Plan(tp=2, micro_batch=4, grad_accum=2), "flash"),
    ("PP2", Plan(pp=2, micro_batch=2, grad_accum=4), "flash"),
    ("DP2 ZeRO-2", Plan(dp=2, zero=2, micro_batch=2, grad_accum=2), "flash"),
    ("DP2 ZeRO-3", Plan(dp=2, zero=3, micro_batch=4, grad_accum=1), "flash"),
    ("DP2xPP2 ZeRO-1", Plan(dp=2, pp=2, zero=1, micro_batch=2, grad_accum=2), "flash"),
    ("TP2xPP2", Plan(tp=2, pp=2, micro_batch=2, grad_accum=4), "flash"),
    ("TP2xDP2 ZeRO-1", Plan(tp=2, dp=2, zero=1, micro_batch=2, grad_accum=2), "flash"),
    ("TP2xDP2 ZeRO-3", Plan(tp=2, dp=2, zero=3, micro_batch=4, grad_accum=1), "flash"),
    ("TP2xPP2xDP2 ZeRO-1", Plan(tp=2, pp=2, dp=2, zero=1, micro_batch=2, grad_accum=2), "flash"),
    ("DP4 full recompute", Plan(dp=4, zero=1, micro_batch=2, grad_accum=1, recompute="full"), "flash"),
    ("DP2xPP2 partial full", Plan(dp=2, pp=2, zero=1, micro_batch=2, grad_accum=2, recompute="full",
                                  recompute_layers=(1, 1)), "flash"),
    ("TP2xDP2 selective eager", Plan(tp=2, dp=2, zero=1, micro_batch=2, grad_accum=2, recompute="selective"),
     "eager"),
    ("DP4 ZeRO-1 accumulation", Plan(dp=4, zero=1, micro_batch=1, grad_accum=2), "flash"),
    ("DP2 fp32", Plan(dp=2, micro_batch=2, grad_accum=2, precision="fp32"), "flash"),
    ("TP2xPP2 fp32", Plan(tp=2, pp=2, micro_batch=2, grad_accum=4, precision="fp32"), "flash"),
]
GLM10B = [  # LayerNorm, GELU, learned positions, tied embeddings, dropout 0.1 (CPU: the math path)
    ("TP2xPP2 tied", Plan(tp=2, pp=2, micro_batch=2, grad_accum=4), "flash"),
    ("DP2 ZeRO-3 tied", Plan(dp=2, zero=3, micro_batch=4, grad_accum=1), "flash"),
    ("TP2 selective", Plan(tp=2, zero=1, micro_batch=2, grad_accum=4, recompute="selective"), "flash"),
]


def setups(out: Path, device, scales: list[str], only: str) -> list[Setup]:
    cases = [("chatglm3-6b", sc, *c) for sc in scales for c in CHATGLM]
    if "tiny" in scales:
        cases += [("glm-10b", "tiny", *c) for c in GLM10B]
    out_list = []
    for model_arg, sc, layout, plan, attention in cases:
        name = f"{model_arg} {sc} {layout}"
        if only and only.lower() not in name.lower():
            continue
        slug = name.replace(" ", "_").replace("/", "-")
        out_list.append(Setup(
            name=name, model=scale(preset(model_arg), sc), cluster=parse_cluster(f"{plan.world_size}xcpu", device),
            train=TrainSpec(global_batch=GLOBAL_BATCH, seq_len=SEQ, precision=plan.precision, attention=attention),
            plan=plan, run_dir=out / slug, scale=sc, model_arg=model_arg,
            tags={"layout": layout, "scale": sc, "model": model_arg}))
    return out_list


# --- predictions per rank ----------------------------------------------------------------------
def stage_blocks(s: Setup, stage: int) -> list[tuple[int, bool]]:
    """(global block index, fully checkpointed) of the blocks of `stage` (the first k of it)."""
    per = s.plan.layers_per_stage(s.model.layers)
    ck = s.plan.checkpointed_per_stage(s.model.layers)[stage]
    first = sum(per[:stage])
    return [(first + j, j < ck) for j in range(per[stage])]


def predicted_activations(s: Setup, stage: int) -> tuple[dict[int, float], float]:
    """Per block, what it keeps (planner.cost.memory.block_activation_bytes), and the stage's
    extras: its shared tensors (once per stage; under ZeRO-3 each plain block's own mask and
    cos/sin), the embedding's and the head's tensors."""
    model, plan, t = s.model, s.plan, s.plan.tp
    b, seq, e = plan.micro_batch, s.train.seq_len, 4.0 if plan.precision == "fp32" else 2.0
    kernel = attention_kernel(model, s.train, "cpu")
    sp = plan.sequence_parallel
    blocks, plain, recomputed = {}, 0, False
    for i, ckpt in stage_blocks(s, stage):
        mode = "full" if ckpt else plan.recompute if plan.recompute == "selective" else "none"
        blocks[i] = memory.block_activation_bytes(model, seq, b, t, sequence_parallel=sp, recompute=mode,
                                                  act_bytes=e, kernel=kernel)
        plain += mode == "none"
        recomputed |= mode != "none"
    per_set = memory.shared_bytes(model, seq, b, t, act_bytes=e, kernel=kernel, plain=True, recomputed=False)
    extras = (plain if rebuilds_shared_per_block(plan) else min(plain, 1)) * per_set
    extras += memory.ids_bytes(seq, b) if recomputed else 0.0
    if stage == 0:
        extras += memory.embedding_bytes(model, seq, b, t)
        if model.position == "learned" and recomputed:
            extras -= memory.INT64 * b * seq  # the position ids the embedding keeps are the checkpoints'
    if stage == plan.pp - 1:
        extras += memory.head_bytes(model, seq, b, t, sequence_parallel=sp, act_bytes=e)
    return blocks, extras


def rel(pred: float, meas: float) -> float:
    """|rel_error| in percent (0 when both are 0)."""
    if meas == 0:
        return 0.0 if pred == 0 else math.inf
    return 100.0 * abs(rel_error(pred, meas))


def check(s: Setup, m: dict[str, Any]) -> dict[str, Any]:
    """Worst per-rank errors of one run's states (class by class: metrics.json's measured and
    predicted model_state_breakdown_gb_per_rank, planner.cost.states), allocated peak (the
    estimate's allocated_memory of the rank's stage) and activations."""
    states_err = acts_err = extras_err = alloc_err = 0.0
    worst_states = worst_block = worst_alloc = ""
    pred_states = m["predicted"]["model_state_breakdown_gb_per_rank"]
    est = estimate(s.model, s.cluster, s.train, s.plan)
    for r, (meas_states, acts) in enumerate(zip(m["model_state_breakdown_gb_per_rank"], m["activations_per_rank"])):
        stage = s.plan.coords(r).pp
        for cls, got in meas_states.items():
            v = pred_states[r].get(cls, 0.0)
            err = rel(v, got)
            if err > states_err:
                states_err, worst_states = err, f"rank {r} {cls}: {got * 1e9:.0f} B measured, {v * 1e9:.0f} predicted"
        pa, ma = est.allocated_memory[stage].total, m["allocated_peak_gb_per_rank"][r] * 1e9
        if abs(100.0 * (pa - ma) / ma) >= abs(alloc_err):
            alloc_err, worst_alloc = 100.0 * (pa - ma) / ma, f"rank {r}: {ma / 1e6:.1f} MB measured, {pa / 1e6:.1f} predicted"
        blocks, extras = predicted_activations(s, stage)
        got = {int(k): v for k, v in acts["activation_bytes_per_block"].items()}
        if set(got) != set(blocks):
            raise RuntimeError(f"{s.name} rank {r}: blocks {sorted(got)} measured, {sorted(blocks)} expected")
        for i, v in blocks.items():
            err = rel(v, got[i])
            if err > acts_err:
                acts_err, worst_block = err, f"rank {r} block {i}: {got[i]} B measured, {v:.0f} predicted"
        meas_extras = acts["shared_bytes"] + acts["embedding_bytes"] + acts["head_bytes"]
        extras_err = max(extras_err, rel(extras, meas_extras))
    worst = max(range(len(pred_states)), key=lambda r: sum(m["model_state_breakdown_gb_per_rank"][r].values()))
    return {"states_err_pct": states_err, "states_worst": worst_states, "activations_err_pct": acts_err,
            "activations_worst": worst_block, "extras_err_pct": extras_err, "allocated_err_pct": alloc_err,
            "allocated_worst": worst_alloc, "allocated_gb": max(m["allocated_peak_gb_per_rank"]),
            "allocated_predicted_gb": est.allocated_peak_bytes / 1e9, "rss_gb": m["peak_memory_gb"],
            "states_gb": m["model_state_breakdown_gb_per_rank"][worst], "states_predicted_gb": pred_states[worst]}


# --- running -----------------------------------------------------------------------------------
def locked_runner(lock: str | None, hold_s: float = 0.0):
    """Each run under `lock`; with hold_s > 0 the lock is kept across consecutive runs until it
    has been held hold_s seconds (then released, so others' turns come between batches), not
    taken again for every run: one waiter among several gets few turns."""
    state: dict[str, Any] = {"fh": None, "since": 0.0}

    def run(run_dir: Path, steps: int, warmup: int) -> dict[str, Any]:
        from planner.runtime.train.launch import run_plan
        if not lock:
            return run_plan(run_dir, steps=steps, warmup=warmup)
        if state["fh"] is not None and time.monotonic() - state["since"] > hold_s:
            state["fh"].close()  # closing releases the flock
            state["fh"] = None
        if state["fh"] is None:
            fh = open(lock, "w")
            fcntl.flock(fh, fcntl.LOCK_EX)
            state["fh"], state["since"] = fh, time.monotonic()
        try:
            return run_plan(run_dir, steps=steps, warmup=warmup)
        finally:
            if hold_s <= 0:
                state["fh"].close()
                state["fh"] = None
    return run


def load_rounds(s: Setup, rounds: int) -> list[dict[str, Any]] | None:
    found = [s.run_dir / f"metrics-round{r}.json" for r in range(rounds)]
    if not all(p.exists() for p in found):
        return None
    return [check_metrics(json.loads(p.read_text()), str(p)) for p in found]


def plan_key(plan: Plan, layers: int) -> tuple:
    d = plan.to_dict()
    d["stage_layers"] = plan.layers_per_stage(layers)
    d["recompute_layers"] = plan.checkpointed_per_stage(layers)
    return tuple(sorted((k, str(v)) for k, v in d.items()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=None, help="a measured profile (default: planner profile --quick first)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--scales", default="tiny,small")
    ap.add_argument("--only", default="", help="run only layouts whose name contains this")
    ap.add_argument("--out-dir", default="reports/bench-agreement")
    ap.add_argument("--lock", default=None, help="take this lock around each run (instead of around the whole)")
    ap.add_argument("--lock-hold", type=float, default=0.0,
                    help="with --lock: keep it across runs for up to this many seconds (batches), not per run")
    ap.add_argument("--runs-only", action="store_true",
                    help="run the layouts without saved rounds and stop (analyse later with --reuse, e.g. niced)")
    ap.add_argument("--reuse", action="store_true", help="reuse the saved rounds of a previous invocation")
    ap.add_argument("--skip-regret", action="store_true", help="leave the search's regret out (it may run its pick)")
    ap.add_argument("--measured-only", action="store_true",
                    help="with --reuse: analyse only the layouts with saved rounds, run nothing (a stated subset)")
    args = ap.parse_args()
    t_start = time.perf_counter()
    out = Path(args.out_dir).resolve()  # run directories name the profile by its path
    out.mkdir(parents=True, exist_ok=True)
    profile_path = str(Path(args.profile).resolve()) if args.profile else None
    if profile_path is None:
        saved = out / "cpu-measured.json"
        profile_path = str(saved) if args.reuse and saved.exists() else profile_machine(saved)
    check_profile(profile_path, ("bf16", "fp32"), "--profile")
    device = load_profile(profile_path)
    os.environ["PLANNER_MEASURE_ACTIVATIONS"] = "1"
    runner = locked_runner(args.lock, args.lock_hold)
    cases = setups(out, device, [x for x in args.scales.split(",") if x], args.only)
    measured: dict[str, list[dict[str, Any]]] = {}
    todo = []
    for s in cases:
        old = load_rounds(s, args.rounds) if args.reuse else None
        if old is None and not args.measured_only:
            s.write("benchmarks/agreement.py")
            todo.append(s)
        elif old is not None:
            measured[s.name] = old
    measured.update(round_robin(todo, rounds=args.rounds, steps=args.steps, warmup=args.warmup, runner=runner,
                                echo=lambda line: print(line, flush=True)))
    ok = [s for s in cases if measured.get(s.name)]
    if args.runs_only:
        print(f"measured {len(ok)}/{len(cases)} layouts in {time.perf_counter() - t_start:.0f} s; runs in {out}")
        return 0
    checks = {s.name: check(s, measured[s.name][0]) for s in ok}

    # --- calibration, held out ---
    runs = [measured_run(s, measured[s.name]) for s in ok]
    t0 = time.perf_counter()
    cal = calibrate(device, runs)
    fit_s = time.perf_counter() - t0
    atomic_write_json(out / "cpu-calibrated.json", apply(json.loads(Path(profile_path).read_text()), cal))
    held = {}
    for s, row in zip(ok, cal.rows):
        t, mem = row["step_time_s"], row["peak_memory_gb"]
        held[s.name] = {"time_err_pct": 100.0 * (t["held_out"] - t["measured"]) / t["measured"],
                        "memory_err_pct": 100.0 * (mem["held_out"] - mem["measured"]) / mem["measured"],
                        "step_s": t["measured"], "peak_gb": mem["measured"], "step_held_out_s": t["held_out"],
                        "peak_held_out_gb": mem["held_out"]}

    # --- the search's regret, on 2 and 4 processes ---
    regrets = [] if args.skip_regret else \
        [r for w in REGRET_WORLDS if (r := search_regret(cases, measured, cal.device, args, runner, out, w))]

    # --- the table ---
    def mark(v: float, target: float) -> str:
        return f"{v:6.2f}% {'pass' if abs(v) <= target else 'FAIL'}"

    head = (f"{'layout':<27} {'scale':<5} {'procs':>5} | {'step s meas/held-out':>20} {'err':>12} | "
            f"{'allocated MB meas/pred':>22} {'err':>12} | {'RSS MB meas/held-out':>20} {'err':>12} | "
            f"{'states':>12} | {'activations':>12} | {'extras':>7}")
    print()
    print(head)
    print("-" * len(head))
    for s in ok:
        c, h = checks[s.name], held[s.name]
        label = s.tags["layout"] + (" (glm-10b)" if s.tags["model"] == "glm-10b" else "")
        print(f"{label:<27} {s.tags['scale']:<5} {s.plan.world_size:>5} | "
              f"{h['step_s']:>9.3f}/{h['step_held_out_s']:<10.3f} {mark(h['time_err_pct'], 15.0):>12} | "
              f"{c['allocated_gb'] * 1e3:>10.1f}/{c['allocated_predicted_gb'] * 1e3:<11.1f} "
              f"{mark(c['allocated_err_pct'], 5.0):>12} | "
              f"{h['peak_gb'] * 1e3:>9.1f}/{h['peak_held_out_gb'] * 1e3:<10.1f} {mark(h['memory_err_pct'], 10.0):>12} | "
              f"{mark(c['states_err_pct'], 1.0):>12} | {mark(c['activations_err_pct'], 5.0):>12} | "
              f"{c['extras_err_pct']:6.2f}%")
        print(f"{'':<27} model states MB, measured (predicted): " + ", ".join(
            f"{k} {v * 1e3:.2f} ({c['states_predicted_gb'].get(k, 0.0) * 1e3:.2f})" for k, v in c["states_gb"].items()))
    for s in cases:
        if s not in ok:
            print(f"{s.tags['layout']:<27} {s.tags['scale']:<5} {s.plan.world_size:>5} | "
                  + ("not measured (--measured-only)" if args.measured_only else "FAILED to run"))
    print()
    n = len(ok)
    cols = [("states within 1%", lambda x: checks[x]["states_err_pct"] <= 1.0),
            ("activations within 5%", lambda x: checks[x]["activations_err_pct"] <= 5.0),
            ("allocated peak within 5%", lambda x: abs(checks[x]["allocated_err_pct"]) <= 5.0),
            ("peak RSS held out within 10%", lambda x: abs(held[x]["memory_err_pct"]) <= 10.0),
            ("step time held out within 15%", lambda x: abs(held[x]["time_err_pct"]) <= 15.0)]
    print("; ".join(f"{label}: {sum(f(s.name) for s in ok)}/{n}" for label, f in cols)
          + " (targets: states, activations, allocated on every run; step time on at least 30 of 35)")
    print(f"worst: states {max(checks[s.name]['states_err_pct'] for s in ok):.3f}% "
          f"({max(ok, key=lambda s: checks[s.name]['states_err_pct']).name}: "
          f"{checks[max(ok, key=lambda s: checks[s.name]['states_err_pct']).name]['states_worst']}); "
          f"allocated {max(abs(checks[s.name]['allocated_err_pct']) for s in ok):.2f}% "
          f"({max(ok, key=lambda s: abs(checks[s.name]['allocated_err_pct'])).name}: "
          f"{checks[max(ok, key=lambda s: abs(checks[s.name]['allocated_err_pct'])).name]['allocated_worst']}); "
          f"activations {max(checks[s.name]['activations_err_pct'] for s in ok):.3f}%; "
          f"extras {max(checks[s.name]['extras_err_pct'] for s in ok):.3f}%")
    sm = cal.summary
    print(f"held-out MAPE: peak RSS {sm['memory_mape_pct']['held_out']:.1f}% (before calibration "
          f"{sm['memory_mape_pct']['before']:.1f}%), step time {sm['step_time_mape_pct']['held_out']:.1f}% "
          f"(before {sm['step_time_mape_pct']['before']:.1f}%); worst held out: memory "
          f"{max(abs(h['memory_err_pct']) for h in held.values()):.1f}%, time "
          f"{max(abs(h['time_err_pct']) for h in held.values()):.1f}% (targets: step time MAPE <= 10%)")
    print("fitted factors: " + ", ".join(f"{k}={v:.4g}" for k, v in cal.factors.items())
          + f" (ridge {sm['lambda']}; fit + leave-one-out {fit_s:.0f} s; {n} runs x {args.rounds} rounds)")
    for regret in regrets:
        if "error" in regret:
            print(f"search regret on {regret['cluster']}: the pick ({regret['pick']}) {regret['error']}")
            continue
        print(f"search regret on this machine ({regret['cluster']}, {regret['model']}, global batch {GLOBAL_BATCH}, "
              f"seq {SEQ}): the pick ({regret['pick']}{', run for this' if regret['pick_was_run'] else ''}) "
              f"measures {regret['pick_s']:.3f} s/step; the fastest of the {regret['pool']} measured plans "
              f"({regret['fastest']}) {regret['fastest_s']:.3f} s/step: regret {regret['regret']:.3f} "
              f"(target <= 1.05)")
    print(f"total {time.perf_counter() - t_start:.0f} s; profile {profile_path}; runs in {out}")
    atomic_write_json(out / "agreement.json", {
        "targets_pct": TARGETS, "global_batch": GLOBAL_BATCH, "seq_len": SEQ, "rounds": args.rounds,
        "steps": args.steps, "warmup": args.warmup, "profile": profile_path, "factors": cal.factors,
        "summary": cal.summary,
        "layouts": [{"name": s.name, **s.tags, "processes": s.plan.world_size, "plan": s.plan.describe(),
                     **checks[s.name], **held[s.name]} for s in ok],
        "failed": [] if args.measured_only else [s.name for s in cases if s not in ok],
        "not_measured": [s.name for s in cases if s not in ok] if args.measured_only else [], "regret": regrets})
    return 0


def search_regret(cases: list[Setup], measured: dict, device, args, runner, out: Path,
                  world: int) -> dict[str, Any] | None:
    """Search `world`xcpu with the calibrated profile; run its pick if no layout here is that plan;
    its measured step time over the fastest measured plan of the same inputs."""
    pool = [s for s in cases if measured.get(s.name) and s.tags["model"] == "chatglm3-6b"
            and s.tags["scale"] == "tiny" and s.plan.world_size == world
            and s.train.precision == "bf16" and s.train.attention == "flash"]
    if not pool:
        return None
    model, train = pool[0].model, TrainSpec(global_batch=GLOBAL_BATCH, seq_len=SEQ)
    cluster = parse_cluster(f"{world}xcpu", device)
    result = search(model, cluster, train, exhaustive=True)
    pick = result.best.plan
    key = plan_key(pick, model.layers)
    mine = [s for s in pool if plan_key(s.plan, model.layers) == key]
    if mine:
        pick_setup, was_run = mine[0], False
    else:
        pick_setup = Setup(name=f"chatglm3-6b tiny search pick {world}", model=model, cluster=cluster, train=train,
                           # one directory per plan: --reuse must not take another pick's saved rounds
                           plan=pick, run_dir=out / ("search_pick_" + "_".join(
                               "".join(c if c.isalnum() else "-" for c in part.strip())
                               for part in pick.describe().split(","))),
                           scale="tiny", model_arg="chatglm3-6b",
                           tags={"layout": "search pick", "scale": "tiny", "model": "chatglm3-6b"})
        rounds = load_rounds(pick_setup, args.rounds) if args.reuse else None
        if rounds is None:
            pick_setup.write("benchmarks/agreement.py (search pick)")
            rounds = round_robin([pick_setup], rounds=args.rounds, steps=args.steps, warmup=args.warmup,
                                 runner=runner, echo=lambda line: print(line, flush=True))[pick_setup.name]
        if not rounds:
            return {"pick": pick.describe(), "error": "the pick failed to run"}
        measured[pick_setup.name] = rounds
        pool.append(pick_setup)
        was_run = True
    times = {s.name: step_time(measured[s.name]) for s in pool}
    fastest = min(pool, key=lambda s: times[s.name])
    print()
    print(f"search pick on {world}xcpu (calibrated profile, exhaustive, {result.space_size} plans): "
          f"{pick.describe()}")
    for s in sorted(pool, key=lambda s: times[s.name]):
        print(f"  {times[s.name]:7.3f} s/step measured  {s.plan.describe()}{'  <- pick' if s is pick_setup else ''}")
    return {"cluster": f"{world}xcpu", "model": model.name, "pick": pick.describe(), "pick_was_run": was_run,
            "pick_s": times[pick_setup.name], "fastest": fastest.plan.describe(), "fastest_s": times[fastest.name],
            "pool": len(pool), "regret": times[pick_setup.name] / times[fastest.name],
            "times": {s.plan.describe(): times[s.name] for s in pool}}


if __name__ == "__main__":
    try:
        sys.exit(main())
    except PlannerError as exc:  # bad input: one line, exit 2
        print(f"error: {exc.line()}", file=sys.stderr)
        sys.exit(2)
