"""benchmarks/gpu_check.py --dry-run: every phase of the GPU check (profile, search, verify, the
printed verdict) on this CPU with the tiny model, so that the day a GPU is lent only the GPU is
new. Run alone (2 cores): `flock /tmp/planner-cpu.lock .venv/bin/pytest -q tests/integration/test_gpu_check.py`."""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
os.environ.setdefault("DS_ACCELERATOR", "cpu")
ROOT = Path(__file__).resolve().parents[2]


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_runs_every_phase_and_prints_the_verdict(tmp_path: Path, capsys) -> None:
    mod = _gpu_check()
    assert mod.main(["--dry-run", "--out-dir", str(tmp_path), "--steps", "3"]) == 0
    out = capsys.readouterr().out
    prof = json.loads((tmp_path / "profile.json").read_text())
    assert prof["kind"] == "cpu" and prof["builtin"] is False
    # one process (--procs 1): the collectives are skipped and the profile says the links are not measured
    assert "collectives skipped" in (tmp_path / "profile.log").read_text()
    assert prof["measured"]["comm"]["groups"] == {} and "not measured" in prof["sources"]["intra_node"]
    v = json.loads((tmp_path / "plan" / "verify.json").read_text())
    for key in ("baseline", "planned"):
        m = v[key]
        assert m["status"] == "ok" and m["allocated_peak_gb"] > 0 and m["predicted"]["allocated_peak_gb"] > 0
        assert f"{m['step_time_s']:.3f} s measured" in out
        assert f"{m['allocated_peak_gb']:.2f} GB measured" in out
    assert "3x MET" in out or "3x NOT MET" in out
    assert "one-third less MET" in out or "one-third less NOT MET" in out
    assert "of the 480 s budget" in out and "dry run on CPU" in out
