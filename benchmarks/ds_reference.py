"""The fitter of DeepSpeed's runtime factors on its published runs, as a benchmark.

The fitter lives in the package (planner/calibrate/reference/): `planner calibrate
--reference` fits and writes the factors shipped in profiles/; this script prints its table.

    .venv/bin/python benchmarks/ds_reference.py            # table; writes reports/bench-ds-reference/calibration.json
    .venv/bin/python benchmarks/ds_reference.py --json     # the same as JSON on stdout
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.calibrate.reference import *  # noqa: E402,F401,F403  (benchmarks import it as ds_reference)
from planner.calibrate.reference import main  # noqa: E402

if __name__ == "__main__":
    main()
