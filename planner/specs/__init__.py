"""Frozen value types and strict loaders. Imports only the standard library."""
from planner.specs.estimate import GB, Estimate, MemoryBreakdown, TimeBreakdown
from planner.specs.hardware import DeviceProfile, Link, find_device, load_profile, profile_from_dict
from planner.specs.cluster import ClusterSpec, parse_cluster
from planner.specs.model import ModelSpec
from planner.specs.presets import PRESETS, preset, scale
from planner.specs.plan import Plan
from planner.specs.train import TrainSpec

__all__ = ["GB", "ClusterSpec", "DeviceProfile", "Estimate", "Link", "MemoryBreakdown", "ModelSpec",
           "PRESETS", "Plan", "TimeBreakdown", "TrainSpec", "find_device", "load_profile",
           "parse_cluster", "preset", "profile_from_dict", "scale"]
