"""The optimisation ladder (issue 12): from the conventional baseline to the chosen plan, one
technique a rung, predicted by the cost model and, where a rung runs here, measured.

planner.ladder.techniques  the techniques, the Plan fields each owns, the rung a set makes
planner.ladder.predict     the predicted ladder (pure: cost model and the data stream's padding)
planner.ladder.claims      the source article's figure per technique and ours beside it
planner.ladder.measure     runs the rungs with the executor (imports it lazily)
planner.ladder.text        the CLI's table
planner.ladder.plots       waterfall PNGs of throughput and memory
"""
from planner.ladder.predict import build
from planner.ladder.techniques import LABELS, TECHNIQUES, parse_order

__all__ = ["build", "LABELS", "TECHNIQUES", "parse_order"]
