"""The closed loop behind `planner search --refine K`: run the search's top plans with the
training runtime, refit the factors to what they measured (planner/calibrate), re-rank.

- refine.py  one worker: run the top K plans, refit, re-rank, write refine.json;
- shared.py  several workers on a cluster sharing the runs through one Optuna study;
- bench.py   what the measuring benchmarks share (profile this machine, round-robin runs).

    from planner.tune.refine import refine
    result = refine("reports/glm", k=4, steps=5)
"""
