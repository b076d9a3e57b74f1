"""A GPU's capacity is what the CUDA driver reports (profiles/*.json memory_total_mib, issue 19):
an A100 "80GB" holds 81,039 MiB = 84.98e9 bytes, not 80e9. Values by hand from each profile's
sources (the smaller of two reports of torch's get_device_properties / out-of-memory message)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.cost import estimate
from planner.errors import ProfileError
from planner.specs import Plan, TrainSpec, parse_cluster, preset, scale
from planner.specs.hardware import load_profile, profile_from_dict

PROFILES = Path(__file__).resolve().parents[2] / "profiles"
MIB = 2.0 ** 20


@pytest.mark.parametrize("name, mib", [("A100-80GB", 81039), ("A100-40GB", 40448), ("H100-SXM", 81082),
                                       ("B200", 182631), ("V100", 32510), ("H200", 143156), ("L40S", 45455),
                                       ("A6000", 48676), ("RTX-4090", 24248)])
def test_capacity_is_the_drivers_total(name, mib):
    dev = load_profile(PROFILES / f"{name}.json")
    assert dev.memory_total_mib == mib and dev.memory_bytes == mib * MIB
    assert "smaller" in dev.sources["memory_total_mib"]     # two reports named, the smaller taken


def test_a100_80gb_holds_85_gb_and_40gb_42_gb():
    assert load_profile(PROFILES / "A100-80GB.json").memory_bytes == pytest.approx(84.975e9, abs=1e6)
    assert load_profile(PROFILES / "A100-40GB.json").memory_bytes == pytest.approx(42.413e9, abs=1e6)


def test_without_the_drivers_total_memory_gb_is_1e9_bytes():
    data = json.loads((PROFILES / "L40S.json").read_text())
    del data["memory_total_mib"]
    dev = profile_from_dict(data)
    assert dev.memory_total_mib == 0.0 and dev.memory_bytes == 48e9


def test_every_gpu_profile_states_the_drivers_total():
    for path in sorted(PROFILES.glob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and data.get("kind") == "gpu":
            assert data.get("memory_total_mib", 0) > 0 and data["sources"]["memory_total_mib"], path.name


def test_the_estimate_compares_with_the_drivers_total():
    m, c = scale(preset("chatglm3-6b"), "tiny"), parse_cluster("8xA100")
    est = estimate(m, c, TrainSpec(global_batch=8, seq_len=512), Plan(dp=8))
    assert est.capacity_bytes == 81039 * MIB


@pytest.mark.parametrize("bad", [0, -1, "80", True])
def test_a_bad_total_is_one_error_naming_the_field(bad):
    data = json.loads((PROFILES / "A100-80GB.json").read_text())
    data["memory_total_mib"] = bad
    with pytest.raises(ProfileError) as e:
        profile_from_dict(data)
    assert "memory_total_mib" in str(e.value)
