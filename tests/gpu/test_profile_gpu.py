"""`planner profile --quick` on a CUDA GPU (skipped without one)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_quick_gpu_profile(tmp_path):
    from planner.specs import load_profile
    out = tmp_path / "gpu.json"
    r = subprocess.run([str(Path(sys.executable).with_name("planner")), "profile", "--quick", "--model", "glm-4-9b",
                        "--scale", "full", "--max-tp", "1", "--out", str(out)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    prof = load_profile(out)
    assert prof.kind == "gpu" and prof.peak_tflops["bf16"] > 0
    assert prof.measured["environment"]["cuda"]
    row = prof.measured["layers"][0]
    assert row["allocator_forward_growth_bytes"] > 0
