"""Fixtures for runs that more than one integration module reads (shared_runs.py says why)."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def dp2_bare_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str], list[int]]:
    """shared_runs.start_dp2_bare, once per session. test_trainer checks what launch.sh's path prints
    and writes on it; test_executor takes its losses as the uninterrupted curve a killed and resumed
    run must continue (that test used to launch the same plan through run_plan for the curve alone)."""
    from shared_runs import start_dp2_bare
    return start_dp2_bare(tmp_path_factory.mktemp("dp2-bare"))
