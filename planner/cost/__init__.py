"""Pure analytical cost model: FLOPs, memory, communication and pipeline schedule -> Estimate.

Imports only planner.specs and the standard library (never torch, deepspeed or optuna).
"""
from planner.cost.estimate import estimate
from planner.cost.factors import DEFAULTS as FACTOR_DEFAULTS
from planner.cost.layers import LayerCosts
from planner.cost.model import layer_costs, stage_memory, stage_times

__all__ = ["FACTOR_DEFAULTS", "LayerCosts", "estimate", "layer_costs", "stage_memory", "stage_times"]
