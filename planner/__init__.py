"""planner: an auto-tuning parallelism planner for GLM-family training with DeepSpeed."""
__version__ = "0.1.0"
