"""Hugging Face checkpoints: layout.py (HF tensor names and shapes <-> the model's canonical names,
config.json out), weights.py (load and save, TP- and PP-sharded). Reading an HF config.json into
a ModelSpec is planner/specs/hf.py (no torch)."""
