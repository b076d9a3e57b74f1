"""Serving on this machine: generate.py (KV cache, continuous batching on the GLM model),
loadgen.py (seeded Poisson requests), run.py (`planner serve-bench`: the engine driven by the
load generator, TP ranks as processes)."""
