"""Executor: run a plan for real under DeepSpeed and measure it (issue 3)."""
