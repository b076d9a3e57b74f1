"""Search speed: GLM-130B on 96x8xA100-40GB, global batch 4224, sequence 2048 (issue 2).

Prints the exhaustive sweep's plan count and wall time (target: under 2 s on the 2-core
development machine), and for Optuna, per seed: wall time, trials, plans evaluated and
whether it reached the exhaustive optimum. Numbers are printed, never asserted.

    .venv/bin/python benchmarks/search_speed.py [--seeds 5] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import optuna

from planner.cli.search import _sqlite_storage
from planner.search import Evaluator, Space, rank
from planner.search.exhaustive import exhaustive
from planner.search.heuristic import heuristic
from planner.search.optuna_search import optuna_search
from planner.specs import TrainSpec, parse_cluster, preset


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--trials", type=int, default=100)
    args = ap.parse_args()
    model, cluster = preset("glm-130b"), parse_cluster("96x8xA100-40GB")
    train = TrainSpec(global_batch=4224, seq_len=2048)
    space = Space(model=model, cluster=cluster, train=train)
    exhaustive(space, Evaluator(model, cluster, train))          # warm-up (imports, caches)

    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        trials = exhaustive(Space(model=model, cluster=cluster, train=train), Evaluator(model, cluster, train))
        times.append(time.perf_counter() - t0)
    best = rank(trials)[0]
    feasible = sum(t.feasible for t in trials)
    print(f"GLM-130B on {cluster.spec}, global batch {train.global_batch}, seq {train.seq_len}")
    print(f"exhaustive: {len(trials)} plans ({feasible} fit), wall {min(times):.2f} s best of {args.repeats} "
          f"(all: {', '.join(f'{t:.2f}' for t in times)}) -> target < 2 s: {'met' if min(times) < 2 else 'MISSED'}")
    print(f"  optimum: {best.plan.describe()}, {best.tokens_per_s:,.0f} tokens/s, MFU {best.estimate.mfu:.1%}, "
          f"{best.needs_gb:.1f} GB/GPU")

    # one planner.cost.estimate call (the search's picks, as `planner estimate` prices a plan):
    # cold = the cost model's lru caches emptied before each call, warm = repeated
    import planner.cost as cost_pkg
    caches = [v for mod in list(sys.modules.values()) if mod and mod.__name__.startswith("planner.cost")
              for v in vars(mod).values() if callable(getattr(v, "cache_clear", None))]
    plans = [t.plan for t in rank(trials)[:50]]
    cold = []
    for plan in plans:
        for c in caches:
            c.cache_clear()
        t0 = time.perf_counter()
        cost_pkg.estimate(model, cluster, train, plan)
        cold.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(4):
        for plan in plans:
            cost_pkg.estimate(model, cluster, train, plan)
    warm = (time.perf_counter() - t0) / (4 * len(plans))
    print(f"estimate(): {statistics.median(cold) * 1e6:,.0f} us per call cold (median of {len(plans)} plans, caches "
          f"emptied), {warm * 1e6:,.0f} us warm")

    found = 0
    for seed in range(args.seeds):
        for label in ("in-memory", "sqlite"):
            ev = Evaluator(model, cluster, train)
            with tempfile.TemporaryDirectory() as tmp:
                # sqlite: the storage `planner search` uses (a study.db without an fsync per trial)
                storage = None if label == "in-memory" else _sqlite_storage(Path(tmp) / "study.db")
                t0 = time.perf_counter()
                start = heuristic(space, ev)
                got, study = optuna_search(space, ev, start, n_trials=args.trials, seed=seed, storage=storage)
                wall = time.perf_counter() - t0
                n_trials = len(study.trials)
                if storage is not None:
                    storage.engine.dispose()
            top = rank(got)[0]
            hit = top.plan == best.plan
            found += hit and label == "sqlite"
            print(f"optuna seed {seed} ({label:9s}): {n_trials} trials, {len(got)} plans evaluated, wall {wall:.2f} s, "
                  f"best {top.tokens_per_s:,.0f} tokens/s -> "
                  f"{'found the exhaustive optimum' if hit else 'MISSED: ' + top.plan.describe()}")
    shapes = sum(1 for _ in space.shapes())
    print(f"optuna reached the exhaustive optimum in {found}/{args.seeds} seeds "
          f"({args.trials} TPE trials + neighbour polish over {shapes} shapes = layout x recompute)")


if __name__ == "__main__":
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    main()
