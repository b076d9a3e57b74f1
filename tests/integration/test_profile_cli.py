"""`planner profile --quick` for real on this machine: a loadable profile with measured figures.
(One process, which skips the collectives: the profile phase of test_gpu_check.py.)"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from planner.specs import load_profile

pytestmark = pytest.mark.integration
PLANNER = str(Path(sys.executable).with_name("planner"))


def _profile(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    r = subprocess.run([PLANNER, "profile", "--quick", *args], capture_output=True, text=True, timeout=180)
    return r, time.perf_counter() - t0


def test_quick_profile_writes_a_usable_profile(tmp_path):
    out = tmp_path / "cpu-quick.json"
    r, wall = _profile(tmp_path, "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    # quiet 2-core machine, 2026-12-02: 66-81 s (engine probes 63 s of it: DP2, PP2, ZeRO-3, ZeRO-2 at two
    # model sizes); the full pass takes ~240 s, so 150 s still tells a quick pass from a full one
    assert wall < 150, f"--quick took {wall:.0f} s"
    prof = load_profile(out)  # the planner's own loader accepts it
    data = json.loads(out.read_text())
    assert data["builtin"] is False and prof.kind in ("cpu", "gpu")
    assert prof.peak_tflops["bf16"] > 0 and prof.peak_tflops["fp32"] > 0 and prof.hbm_bandwidth_gbps > 0
    m = prof.measured
    assert m["environment"]["torch"] and m["environment"]["date"]
    ar = m["comm"]["groups"]["2"]["all_reduce"]
    assert ar["fit"]["busbw_gbps"] > 0 and len(ar["points"]) >= 5
    assert all(p["time_s"]["n"] >= 3 for p in ar["points"])
    assert set(m["comm"]["groups"]["2"]) == {"all_reduce", "all_gather", "reduce_scatter", "send_recv", "in_step"}
    # the step probes (planner/specs/step.py): the block per precision, the TP all-reduce in autograd
    # (tiny: micro-batch 1, 4, 16 x TP 1, 2; small beside it: micro-batch 1, 4 x TP 1, 2)
    assert set(prof.step.block) == {"bf16", "fp32"} and all(b.points == 10 for b in prof.step.block.values())
    assert set(prof.step.framework) == {"bf16", "fp32"}, m["notes"]  # the engine probe ran
    assert {r["grad_accum"] for r in m["engine"]} == {1, 4}
    # the 2-process engine probe: DP2 and PP2 in both precisions, DP2 ZeRO-3 and ZeRO-2 in the
    # profiled one, and DP2 ZeRO-0 / ZeRO-2 of the small model (ZeRO-2's line over two sizes)
    assert {(r.get("layout", "1"), r["precision"]) for r in m["engine"]} == \
        {(lay, p) for lay in ("1", "dp", "pp") for p in ("bf16", "fp32")} | {("z3", "bf16"), ("z2", "bf16")}
    assert {(r["layout"], r["micro_batch"]) for r in m["engine"] if r.get("model") == "chatglm3-6b-small"} == \
        {("dp", 1), ("z2", 1)}
    assert [p["model"] for p in data["step"]["parallel"]["bf16"]["measured_zero2"]] == \
        ["chatglm3-6b-tiny", "chatglm3-6b-small"]
    assert set(prof.step.parallel) == {"bf16", "fp32"}, m["notes"]
    assert {r["precision"] for r in m["comm"]["groups"]["2"]["in_step"]["rows"]} == {"bf16", "fp32"}
    assert 2 in prof.step.tp_allreduce and prof.step.tp_allreduce[2].busbw_gbps > 0
    assert prof.intra_node.busbw_gbps == pytest.approx(ar["fit"]["busbw_gbps"])
    layer = m["layers"][0]
    assert layer["saved_activation_bytes"] > layer["saved_activation_bytes_checkpointed"] > 0
    assert layer["backward_checkpointed_s"]["median"] > 0
    assert {p["tp"] for p in m["layers"]} == {1, 2}
    assert not list(tmp_path.glob(".*.tmp"))
    assert f"wrote {out}" in r.stdout
