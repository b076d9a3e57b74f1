"""Bad input to the lab's comparisons (issue 20): a run directory planned with another machine's
profile, a profile without a probe the prediction needs, a metrics.json from an older planner --
one line naming what is missing and how to regenerate it, exit 2, nothing run."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from planner.cli import main
from planner.errors import SpecError
from planner.runtime.preflight.lab import check_metrics, check_profile, check_run_dir
from planner.runtime.observe.metrics import VERSION
from planner.profiler.device import cpu_name

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model", "chatglm3-6b", "--scale", "tiny", "--gpus", "2xcpu"]


def measured_profile(tmp_path: Path, *, cpu: str | None = None, cores: int | None = None,
                     precisions: tuple[str, ...] = ("bf16", "fp32"), step: tuple[str, ...] | None = None) -> Path:
    """The built-in cpu profile dressed as one `planner profile` measured on (cpu, cores)."""
    data = json.loads((ROOT / "profiles" / "cpu.json").read_text())
    curve = data["gemm_efficiency"]
    step = precisions if step is None else step
    # as planner/profiler/write.py writes it: the profiled precision's curve is gemm_efficiency
    data.update({"name": "cpu-measured", "builtin": False,
                 "gemm_efficiency_by_precision": {p: curve for p in precisions[1:]},
                 "step": {"block": {p: {"scale": 1.0, "overhead_s": 0.0} for p in step}},
                 "measured": {"options": {"precision": precisions[0]},
                              "environment": {"kind": "cpu", "cpu": cpu or cpu_name(),
                                              "cpu_count": cores or os.cpu_count()}}})
    out = tmp_path / "cpu-measured.json"
    out.write_text(json.dumps(data))
    return out


def test_this_machines_profile_passes(tmp_path: Path) -> None:
    check_profile(str(measured_profile(tmp_path)), ("fp32", "bf16"), "--profile")
    check_profile(None, ("fp32",), "--profile")  # the built-in one


def test_another_machines_profile_is_named(tmp_path: Path) -> None:
    p = measured_profile(tmp_path, cpu="Some Other CPU @ 9 GHz", cores=128)
    with pytest.raises(SpecError) as e:
        check_profile(str(p), ("fp32",), "--profile")
    line = e.value.line()
    assert "was measured on another machine (Some Other CPU @ 9 GHz, 128 cores" in line
    assert "run `planner profile` on this machine" in line


def test_a_missing_precision_curve_is_named(tmp_path: Path) -> None:
    p = measured_profile(tmp_path, precisions=("bf16",))
    check_profile(str(p), ("bf16",), "--profile")  # the profiled precision: gemm_efficiency itself
    with pytest.raises(SpecError, match=r"has no fp32 GEMM curve \(gemm_efficiency_by_precision.fp32\)"):
        check_profile(str(p), ("fp32", "bf16"), "--profile")


def test_a_missing_step_probe_is_named(tmp_path: Path) -> None:
    p = measured_profile(tmp_path, step=("bf16",))
    check_profile(str(p), ("bf16",), "--profile")
    with pytest.raises(SpecError) as e:
        check_profile(str(p), ("fp32", "bf16"), "--profile")
    line = e.value.line()
    assert "has no step probe of the fp32 block (step.block.fp32)" in line and "re-run `planner profile`" in line


def test_old_metrics_are_refused_with_how_to_regenerate() -> None:
    assert check_metrics({"version": VERSION}, "m.json") == {"version": VERSION}
    with pytest.raises(SpecError) as e:
        check_metrics({"version": 1}, "reports/x/metrics.json")
    assert "is metrics.json version 1, this planner reads 2" in e.value.line()
    assert "`planner run RUN_DIR`" in e.value.line()


def test_verify_of_a_run_dir_planned_elsewhere_exits_2_before_running(tmp_path: Path, capsys) -> None:
    prof = measured_profile(tmp_path)
    d = tmp_path / "run"
    assert main(["estimate", *TINY, "--profile", str(prof), "--write", str(d)]) == 0
    check_run_dir(d, ("fp32", "bf16"))
    prof.unlink()  # the run directory copied from the machine that had it
    capsys.readouterr()
    assert main(["verify", str(d)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "inputs.cluster.profile" in err[0] and "does not exist on this machine" in err[0]
    assert not (d / "verify").exists() and not (d / "verify.json").exists()
