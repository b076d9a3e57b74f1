"""Hardware: device profiles (data files in profiles/); the cluster a plan runs on is
planner/specs/cluster.py.

A device profile is a JSON file with the same schema whether it is built in or measured by
`planner profile`. Every number carries its source in the file's "sources" map.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from planner.errors import ProfileError, SpecError
from planner.specs.kernels import KernelCurves, kernels_from_dict
from planner.specs.step import StepProbes, step_from_dict

SCHEMA_VERSION = 1
PROFILES_DIR = Path(__file__).resolve().parents[2] / "profiles"
PRECISIONS = ("bf16", "fp16", "fp32")
"""Precisions every profile gives a dense peak for."""
FP8 = "fp8"
TRAIN_PRECISIONS = PRECISIONS + (FP8,)
"""What a plan may train in: fp8 is bf16 mixed precision with the weight GEMMs in FP8 through
Transformer Engine (planner/cost/compute.py gemm_precision), for runtimes that offer it on GPUs
whose profile has `fp8: true` and a `peak_tflops.fp8`."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    """A communication tier, described as nccl-tests would measure it."""

    name: str
    """Human name, e.g. "NVLink3 (NVSwitch)" or "8x HDR 200Gb/s"."""
    busbw_gbps: float
    """Achievable all-reduce bus bandwidth in GB/s (nccl-tests busbw convention)."""
    latency_us: float
    """Per-step latency alpha of a collective on this tier, microseconds."""

    def __post_init__(self) -> None:
        if not (self.busbw_gbps > 0 and math.isfinite(self.busbw_gbps)):
            raise ProfileError("link.busbw_gbps", f"must be a positive number, got {self.busbw_gbps!r}",
                               "give the measured bus bandwidth in GB/s")
        if not (self.latency_us >= 0 and math.isfinite(self.latency_us)):
            raise ProfileError("link.latency_us", f"must be >= 0, got {self.latency_us!r}",
                               "give the latency in microseconds")


HOST_FIELDS = ("cpu_memory_gb", "pcie_gbps", "cpu_adam_gparams", "nvme_gbps", "nvme_gb", "checkpoint_gbps")


@dataclass(frozen=True, slots=True, kw_only=True)
class Host:
    """The host side of a node, for ZeRO-Offload and ZeRO-Infinity (planner/cost/offload.py)."""

    cpu_memory_gb: float = 0.0
    """Host memory per node usable for offloaded model states, GB (0 = unknown: no offload)."""
    pcie_gbps: float = 0.0
    """Host <-> device bandwidth per device, one direction, GB/s (0 = unknown: no offload)."""
    cpu_adam_gparams: float = 0.0
    """DeepSpeedCPUAdam throughput of the whole node, billion parameters updated per second
    (0 = unknown: no offload)."""
    nvme_gbps: float = 0.0
    """NVMe read/write bandwidth per node, GB/s (0 = no NVMe: no NVMe offload)."""
    nvme_gb: float = 0.0
    """NVMe capacity per node, GB, for ZeRO-Infinity's swap files (0 = unknown: not checked)."""
    checkpoint_gbps: float = 0.0
    """Checkpoint write bandwidth per node, GB/s (0 = unknown: no checkpoint time, planner/cost/bill.py)."""

    def __post_init__(self) -> None:
        for f in HOST_FIELDS:
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ProfileError(f"host.{f}", f"must be a number >= 0, got {v!r}", "fix the profile or the flag")

    @property
    def can_offload(self) -> bool:
        return self.cpu_memory_gb > 0 and self.pcie_gbps > 0 and self.cpu_adam_gparams > 0


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceProfile:
    """One accelerator type (or the CPU), with its links and the runtime's fitted factors."""

    name: str
    kind: str
    """gpu or cpu."""
    aliases: tuple[str, ...] = ()
    memory_gb: float
    """Device memory, GB: as marketed in the shipped profiles (the "80" of an A100 80GB); a profile
    `planner profile` measured holds torch's total_memory / 1e9 here (the driver's total)."""
    memory_total_mib: float = 0.0
    """What a training process can allocate: the device's total memory as the CUDA driver reports
    it (torch.cuda.get_device_properties(i).total_memory, printed in MiB; the "GiB total capacity"
    of torch's out-of-memory message), with its source in "sources". 0: unknown, memory_gb x 1e9."""
    peak_tflops: Mapping[str, float]
    """Dense peak per precision (bf16, fp16, fp32), TFLOP/s."""
    hbm_bandwidth_gbps: float
    """Memory bandwidth, GB/s; bounds element-wise kernels."""
    gemm_efficiency: tuple[tuple[float, float], ...]
    """Achievable fraction of peak vs GEMM size: (flops of one GEMM, efficiency) points,
    interpolated in log(flops); clamped at both ends."""
    gpus_per_node: int
    """Default devices per node."""
    gemm_efficiency_by_precision: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    """Optional per-precision curves (measured profiles); a precision without one uses gemm_efficiency."""
    intra_node: Link
    inter_node: Link
    factors: Mapping[str, float] = field(default_factory=dict)
    """Named runtime factors (DeepSpeed on this device); see planner/cost/factors.py."""
    host: Host = field(default_factory=Host)
    """The node's host memory, PCIe, CPU Adam and NVMe (offload); zeros where unknown."""
    sources: Mapping[str, str] = field(default_factory=dict)
    """Where each number came from (field path -> citation or measurement)."""
    measured: Mapping[str, Any] = field(default_factory=dict)
    """Raw measurements of a profiled machine (empty for built-in profiles)."""
    fp8: bool = False
    """Hardware FP8 (E4M3/E5M2) tensor cores: Ada (SM 8.9) and Hopper (SM 9.0) yes, Ampere and
    older no. Serving (planner/serve) offers an fp8 KV cache only where this is true."""
    lab: Mapping[str, float] = field(default_factory=dict)
    """Limits observed on a CPU host running the lab's ranks (profiles/cpu.json: host_memory_fraction,
    ranks_per_core; "sources" says how each was observed); empty for GPUs."""
    kernels: KernelCurves = field(default_factory=KernelCurves)
    """Measured kernel curves (planner/specs/kernels.py): SMs, GEMM tiles and ceiling, achievable
    HBM bandwidth, attention kernels' throughput. Empty: GEMMs from gemm_efficiency alone."""
    step: StepProbes = field(default_factory=StepProbes)
    """Measured step probes of a profiled CPU (planner/specs/step.py): the executor's block per
    precision against the cost model's compute terms, TP all-reduces as they run in autograd.
    Empty: the compute terms and links alone."""
    path: str = ""

    @property
    def memory_bytes(self) -> float:
        """Capacity a plan's peak may fill: the driver's total (memory_total_mib) where the
        profile states it, else memory_gb x 1e9."""
        return self.memory_total_mib * 2.0 ** 20 if self.memory_total_mib else self.memory_gb * 1e9

    def supports(self, precision: str) -> bool:
        return self.peak_tflops.get(precision, 0.0) > 0

    def peak_flops(self, precision: str) -> float:
        """Dense peak in FLOP/s for a precision (0 when unsupported)."""
        return self.peak_tflops.get(precision, 0.0) * 1e12

    def gemm_eff(self, flops: float, precision: str | None = None) -> float:
        """Achievable GEMM efficiency for one GEMM of `flops` floating-point operations."""
        pts = self.gemm_efficiency_by_precision.get(precision, self.gemm_efficiency) if precision \
            else self.gemm_efficiency
        if flops <= pts[0][0]:
            return pts[0][1]
        if flops >= pts[-1][0]:
            return pts[-1][1]
        x = math.log(flops)
        for (f0, e0), (f1, e1) in zip(pts, pts[1:]):
            if f0 <= flops <= f1:
                w = (x - math.log(f0)) / (math.log(f1) - math.log(f0))
                return e0 + w * (e1 - e0)
        return pts[-1][1]

    @property
    def hbm_bytes_per_s(self) -> float:
        """Achievable memory bandwidth, bytes/s: the datasheet figure x the measured streaming
        efficiency (kernels.hbm_efficiency; 1 where not measured)."""
        return self.hbm_bandwidth_gbps * 1e9 * self.kernels.hbm_efficiency

    def factor(self, name: str, default: float) -> float:
        """The fitted value of a named factor (profile "factors"), or `default`."""
        return float(self.factors.get(name, default))

    def oversubscription(self, processes: int) -> float:
        """How many times more processes share a CPU host than this profile was measured with:
        its per-"device" rates are measured with one of gpus_per_node processes per host (each
        with cores / processes threads); more processes divide the same cores, so every compute-
        and memory-bound time stretches by this ratio. GPUs are never shared: 1."""
        if self.kind != "cpu":
            return 1.0
        return max(1.0, processes / self.gpus_per_node)


def _need(data: Mapping[str, Any], key: str, where: str, kind: type | tuple = (int, float)) -> Any:
    if key not in data:
        raise ProfileError(f"{where}.{key}" if where else key, "missing", "add it (see profiles/A100-80GB.json)")
    value = data[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ProfileError(f"{where}.{key}" if where else key, f"has the wrong type ({type(value).__name__})",
                           "see profiles/A100-80GB.json for the schema")
    return value


def _positive(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ProfileError(where, f"must be a positive number, got {value!r}", "fix the profile file")
    return float(value)


def _curve(raw: Any, where: str) -> tuple[tuple[float, float], ...]:
    try:
        points = tuple(sorted((float(f), float(e)) for f, e in raw))
    except (TypeError, ValueError):
        raise ProfileError(where, "must be a list of [flops, efficiency] pairs", "see profiles/A100-80GB.json") from None
    if not points or any(not (0 < e <= 1) or f <= 0 for f, e in points):
        raise ProfileError(where, "needs at least one point with flops > 0 and 0 < efficiency <= 1", "fix the curve")
    return points


def profile_from_dict(data: Any, path: str = "") -> DeviceProfile:
    """Validate and build a DeviceProfile from parsed JSON."""
    if not isinstance(data, Mapping):
        raise ProfileError(path or "profile", "must be a JSON object", "see profiles/A100-80GB.json")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ProfileError("schema_version", f"is {version!r}, this planner reads {SCHEMA_VERSION}",
                           "re-create the profile with `planner profile`")
    name = _need(data, "name", "", str)
    kind = _need(data, "kind", "", str)
    if kind not in ("gpu", "cpu"):
        raise ProfileError("kind", f"unknown kind {kind!r}", "use gpu or cpu")
    peaks = _need(data, "peak_tflops", "", dict)
    for p in PRECISIONS:
        if p not in peaks:
            raise ProfileError(f"peak_tflops.{p}", "missing", "give the dense peak for bf16, fp16 and fp32")
        v = peaks[p]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ProfileError(f"peak_tflops.{p}", f"must be >= 0 (0 = unsupported), got {v!r}", "fix the profile file")
    fp8_peak = peaks.get(FP8, 0.0)
    if isinstance(fp8_peak, bool) or not isinstance(fp8_peak, (int, float)) or not math.isfinite(fp8_peak) \
            or fp8_peak < 0:
        raise ProfileError("peak_tflops.fp8", f"must be >= 0, got {fp8_peak!r}", "fix the profile file")
    if fp8_peak and data.get("fp8") is not True:
        raise ProfileError("peak_tflops.fp8", "is given but the profile says fp8: false",
                           "set fp8: true (FP8 tensor cores) or drop peak_tflops.fp8")
    if peaks["fp32"] <= 0:
        raise ProfileError("peak_tflops.fp32", "must be positive", "fix the profile file")
    points = _curve(_need(data, "gemm_efficiency", "", list), "gemm_efficiency")
    by_prec = data.get("gemm_efficiency_by_precision", {})
    if not isinstance(by_prec, dict) or any(k not in PRECISIONS for k in by_prec):
        raise ProfileError("gemm_efficiency_by_precision", f"must map {', '.join(PRECISIONS)} to curves",
                           "fix the profile file or drop the field")
    curves = {k: _curve(v, f"gemm_efficiency_by_precision.{k}") for k, v in by_prec.items()}
    links = {}
    for tier in ("intra_node", "inter_node"):
        raw = _need(data, tier, "", dict)
        links[tier] = Link(name=str(raw.get("name", tier)),
                           busbw_gbps=_positive(_need(raw, "busbw_gbps", tier), f"{tier}.busbw_gbps"),
                           latency_us=float(_need(raw, "latency_us", tier)))
    factors = data.get("factors", {})
    if not isinstance(factors, dict) or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) for v in factors.values()):
        raise ProfileError("factors", "must map names to numbers", "see planner/cost/factors.py")
    raw_host = data.get("host", {})
    if not isinstance(raw_host, dict) or set(raw_host) - set(HOST_FIELDS):
        raise ProfileError("host", f"must map {', '.join(HOST_FIELDS)} to numbers", "see profiles/A100-80GB.json")
    host = Host(**raw_host)
    lab = data.get("lab", {})
    if not isinstance(lab, dict) or any(isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0
                                        for v in lab.values()):
        raise ProfileError("lab", "must map names to positive numbers", "see profiles/cpu.json")
    fp8 = data.get("fp8", False)
    if not isinstance(fp8, bool):
        raise ProfileError("fp8", f"must be true or false, got {fp8!r}", "true only for GPUs with FP8 tensor cores")
    gpn = _need(data, "gpus_per_node", "", int)
    if gpn <= 0:
        raise ProfileError("gpus_per_node", f"must be positive, got {gpn}", "fix the profile file")
    return DeviceProfile(
        name=name, kind=kind, aliases=tuple(str(a) for a in data.get("aliases", [])),
        memory_gb=_positive(_need(data, "memory_gb", ""), "memory_gb"),
        memory_total_mib=_positive(data["memory_total_mib"], "memory_total_mib") if "memory_total_mib" in data else 0.0,
        peak_tflops={**{p: float(peaks[p]) for p in PRECISIONS}, **({FP8: float(fp8_peak)} if fp8_peak else {})},
        hbm_bandwidth_gbps=_positive(_need(data, "hbm_bandwidth_gbps", ""), "hbm_bandwidth_gbps"),
        gemm_efficiency=points, gemm_efficiency_by_precision=curves, gpus_per_node=gpn,
        intra_node=links["intra_node"], inter_node=links["inter_node"],
        factors={k: float(v) for k, v in factors.items()}, host=host,
        sources=dict(data.get("sources", {})), measured=dict(data.get("measured", {})), fp8=fp8,
        lab={k: float(v) for k, v in lab.items()},
        kernels=kernels_from_dict(data.get("kernels"), TRAIN_PRECISIONS),
        step=step_from_dict(data.get("step"), PRECISIONS), path=path)


def load_profile(path: str | Path) -> DeviceProfile:
    """Read a profile JSON file; any problem is one ProfileError line."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ProfileError("--profile", f"cannot read {p}: {exc.strerror}", "give an existing profile JSON") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(str(p), f"is not valid JSON ({exc.msg} at line {exc.lineno})",
                           "re-create it with `planner profile`") from None
    return profile_from_dict(data, str(p))


def builtin_profiles() -> dict[str, Path]:
    """Built-in profile files by lower-case name and alias."""
    out: dict[str, Path] = {}
    for f in sorted(PROFILES_DIR.glob("*.json")):
        try:
            data = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
            continue
        if data.get("builtin") is False:
            continue
        for key in [data.get("name", f.stem), *data.get("aliases", [])]:
            out.setdefault(str(key).lower(), f)
    return out


def find_device(name: str) -> tuple[DeviceProfile, str]:
    """Look up a device by name or alias. Returns the profile and a note when an alias was resolved."""
    table = builtin_profiles()
    key = name.strip().lower()
    if key not in table:
        names = sorted({json.loads(p.read_text())["name"] for p in table.values()})
        raise SpecError("--gpus", f"unknown GPU type {name!r}", f"use one of {', '.join(names)}")
    prof = load_profile(table[key])
    note = "" if key == prof.name.lower() else f"{name} means {prof.name}"
    return prof, note
