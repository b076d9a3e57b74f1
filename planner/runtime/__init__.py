"""Running a plan for real on this machine (torch and DeepSpeed; nothing below imports this).

- procs.py     the one place that starts and stops rank processes;
- files.py     where a run keeps its per-rank state inside the run directory;
- preflight/   refusals before any rank starts, the op build, stale build locks, lab inputs;
- train/       the launcher, the worker and its training loop, verify;
- serve/       the generation engine, the serving lab and its load generator;
- observe/     metrics.json, memory and model-state measurement, progress, Prometheus, stability.
The model itself is planner/model, the data pipeline planner/data, checkpoints in Hugging Face
format planner/hf.
"""
