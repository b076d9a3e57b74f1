"""Pure analytical cost model: FLOPs, memory, communication and pipeline schedule -> Estimate.

Imports only planner.specs and the standard library (never torch, deepspeed or optuna).
"""
from planner.cost.estimate import estimate
from planner.cost.factors import Factors
from planner.cost.layers import LayerCosts
from planner.cost.model import layer_costs
from planner.cost.stage import stage_memory, stage_times

__all__ = ["Factors", "LayerCosts", "estimate", "layer_costs", "stage_memory", "stage_times"]
