"""Where the executor keeps its per-run state inside a run directory.

    DIR/.ranks/rank<r>.json    pid, phase, step, error of rank r (the launcher reads it to name a failing rank)
    DIR/.ranks/rank<r>.log     the rank's stdout and stderr
    DIR/.ranks/progress.jsonl  rank 0: one line per step and event
    DIR/.ranks/result.json     rank 0: every rank's measurements, gathered at the end
    DIR/checkpoints/           DeepSpeed checkpoints

Shared by the launcher, the worker and the training loop (none of them imports another for it).
"""
from __future__ import annotations

import json
from pathlib import Path

RANKS_DIR = ".ranks"
CKPT_DIR = "checkpoints"


def progress(run_dir: Path, record: dict) -> None:
    """Append one progress record (rank 0 only)."""
    with open(run_dir / RANKS_DIR / "progress.jsonl", "a") as fh:
        fh.write(json.dumps(record) + "\n")
