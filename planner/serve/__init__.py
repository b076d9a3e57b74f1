"""Serving plans: a pure cost model of vLLM-style serving (prefill, decode, KV cache, TP), a
seeded continuous-batching simulation for latency percentiles and QPS at a target, and the
deployment search behind `planner serve`. Like planner/cost it imports no torch.
"""
from planner.serve.spec import Deployment, ServeEstimate, Target, Workload

__all__ = ["Deployment", "ServeEstimate", "Target", "Workload"]
