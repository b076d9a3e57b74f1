"""Calibrate the named runtime factors on DeepSpeed's own published runs (issue 9, point 3).

The rows are shared reference/deepspeed-at-scale.md, sections A-E, encoded with their source
tags and every assumption in profiles/reference/deepspeed-rows.json: BigScience's Megatron-DeepSpeed
pipeline runs on Jean Zay (A100) and a 13B run on DGX-2 (V100), ZeRO-3 at up to 1024 A100s on
Azure, ZeRO-3 vs ZeRO++ on 64 V100s, ZeRO-Offload on one V100, ZeRO-2 data parallel on 128 V100s.

For each row the script builds (model, cluster, train, plan), runs planner.cost.estimate, and
compares in the row's own convention: the step time where the source gives s/iter or ms/iter,
else TFLOP/s per GPU = the source's FLOPs formula per step (Megatron's 96 B s l h^2 (1 + s/6h +
V/16lh), or 8 N tokens) / predicted step time / GPUs. Error = predicted / measured - 1.

Then one set of named factors per GPU generation (A100: sections A and B; V100: A's 13B row, C,
D, E), never one per row, minimising the mean squared log error over the rows marked "fit" (plus
a small ridge toward the generation's fixed anchor in the rows file, which keeps a factor the
rows cannot determine where it was, and makes the fit independent of what the profile holds
now: run on the factors it wrote, the command returns them): the package's one fitter, planner/calibrate/solver.py fit_relative
(Levenberg-Marquardt polished by Nelder-Mead: the cost model's max/min kinks stop LM at
corners), from several starting points, in a transformed space (multipliers bounded to a
physical range, logit for dp_overlap as in planner/calibrate/fit.py, seconds linear and >= 0). The factor list per generation is a
parameter (--factors); by default BASE_FACTORS plus every time factor planner/cost/factors.py
has gained since (latency_scale, zero3_fetch_overhead_s, cpu_adam_scale, ...). Every row is
also predicted by a fit that did not see it (leave-one-out, warm-started at the full fit; a
held-out row's leave-one-out is its after-fit prediction). Rows whose point is a ZeRO variant the cost
model does not represent yet (its estimate is unchanged with the variant switched off) print
with a note and stay out of the fit.

Modules: rows.py (the rows and each row's estimate), fit.py (what is fitted, per generation),
report.py (the table, MAPE, leave-one-out, `apply` to profiles/).

    .venv/bin/planner calibrate --reference                 # fit, write the shipped factors into profiles/
    .venv/bin/python benchmarks/ds_reference.py            # table; writes reports/bench-ds-reference/calibration.json
    .venv/bin/python benchmarks/ds_reference.py --json     # the same as JSON on stdout
    .venv/bin/python benchmarks/ds_reference.py --factors A100=compute_scale,network_efficiency --inter-gbps jean-zay=10.5

Megatron-LM's Table 1 stays the separate check for --megatron-features plans (benchmarks/fidelity.py).
"""
from __future__ import annotations

from planner.calibrate.fit import with_factors
from planner.calibrate.reference.fit import (BASE_FACTORS, BOUNDS, CAPS, FTOL, KNOWN_FACTORS, LAM, LOO_NM, MEMORY_WORDS,
                                             PER_GENERATION, PHYSICS, STARTS, UNITS, XTOL, Fit, default_factor_names,
                                             factor_value, fit_factors, fit_generations, transform)
from planner.calibrate.reference.report import OUT, apply, main, profile_provenance, render, run
from planner.calibrate.reference.rows import (DATA, VARIANTS, Row, _world, cluster_for, load_rows, memory_of,
                                              phases_of, predict, run_estimate, source_flops, unrepresented, value_of)
from planner.specs import find_device

__all__ = ["BASE_FACTORS", "BOUNDS", "CAPS", "DATA", "FTOL", "KNOWN_FACTORS", "LAM", "LOO_NM", "MEMORY_WORDS", "OUT",
           "PER_GENERATION", "PHYSICS", "STARTS", "UNITS", "VARIANTS", "XTOL", "Fit", "Row", "_world", "apply",
           "cluster_for", "default_factor_names", "factor_value", "find_device", "fit_factors", "fit_generations",
           "load_rows", "main", "memory_of", "phases_of", "predict", "profile_provenance", "render", "run",
           "run_estimate", "source_flops", "transform", "unrepresented", "value_of", "with_factors"]
