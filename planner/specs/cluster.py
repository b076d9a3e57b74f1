"""The cluster a plan runs on: nodes x devices per node of one device profile
(planner/specs/hardware.py), the links between them and the host side, and the `--gpus` syntax
that names it (`8xA100`, `4x8xH100`, `96x8xA100-40GB`, `2xcpu`).
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

from planner.errors import SpecError
from planner.specs.hardware import DeviceProfile, Host, Link, find_device


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterSpec:
    """Nodes x devices per node of one device type, and the links between them."""

    nodes: int
    gpus_per_node: int
    device: DeviceProfile
    intra_node: Link
    inter_node: Link
    spec: str = ""
    """The --gpus string as the user wrote it."""
    note: str = ""
    """e.g. "A100 means A100-80GB"."""
    host: Host | None = None
    """The node's host side (offload); None: the device profile's (with --cpu-mem-gb / --nvme-gbps applied)."""
    memory_headroom: float | None = None
    """GB per device a plan leaves free for what DeepSpeed needs besides model states and
    activations -- CUDA context, NCCL's communicator buffers, the allocator's reserve
    (--memory-headroom). None: the profile's memory_overhead_gb factor (planner/cost/factors.py,
    default 1 GB); allocator fragmentation is counted on top, as memory_fragmentation x the
    dynamic memory. The estimate's "runtime allowance" line is the two together."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise SpecError("--gpus", f"needs at least one node and one GPU, got {self.nodes}x{self.gpus_per_node}",
                            "write e.g. 8xA100 or 4x8xH100")
        h = self.memory_headroom
        if h is not None and (isinstance(h, bool) or not isinstance(h, (int, float)) or not math.isfinite(h)
                              or not 0 <= h < self.device.memory_gb):
            raise SpecError("--memory-headroom", f"must be GB in [0, {self.device.memory_gb:g}), got {h!r}",
                            "give e.g. 2 (GB left free per device)")
        if self.host is None:
            object.__setattr__(self, "host", self.device.host)


    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def usable_bytes(self) -> float:
        """Device memory a plan's estimate may fill: the capacity (the headroom is inside the
        estimate, as its fixed allowance)."""
        return self.memory_bytes

    @property
    def memory_bytes(self) -> float:
        """Capacity of one device. CPU "devices" are processes sharing the host's memory."""
        if self.device.kind == "cpu":
            return self.device.memory_bytes / self.gpus_per_node
        return self.device.memory_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"spec": self.spec, "nodes": self.nodes, "gpus_per_node": self.gpus_per_node,
                "device": self.device.name, "profile": self.device.path,
                "intra_node": {"name": self.intra_node.name, "busbw_gbps": self.intra_node.busbw_gbps,
                               "latency_us": self.intra_node.latency_us},
                "inter_node": {"name": self.inter_node.name, "busbw_gbps": self.inter_node.busbw_gbps,
                               "latency_us": self.inter_node.latency_us},
                "note": self.note, "memory_headroom": self.memory_headroom,
                "host": dataclasses.asdict(self.host)}


_GPUS_RE = re.compile(r"^\s*(?:(\d+)\s*[xX]\s*)?(?:(\d+)\s*[xX]\s*)?([A-Za-z][A-Za-z0-9_.\-]*)\s*$")


def parse_cluster(text: str, profile: DeviceProfile | None = None, *, inter_gbps: float | None = None,
                  inter_latency_us: float | None = None, intra_gbps: float | None = None,
                  cpu_mem_gb: float | None = None, nvme_gbps: float | None = None,
                  memory_headroom: float | None = None, nvme_gb: float | None = None,
                  checkpoint_gbps: float | None = None) -> ClusterSpec:
    """Parse `8xA100`, `4x8xH100`, `96x8xA100-40GB`, `2xcpu`.

    One number is GPUs on one node; two are nodes x GPUs per node. `profile` (from
    --profile) replaces the built-in profile of the named type. Flags override the network.
    """
    if not isinstance(text, str):
        raise SpecError("--gpus", "missing", "write e.g. 8xA100")
    m = _GPUS_RE.match(text)
    if not m:
        raise SpecError("--gpus", f"cannot read {text!r}", "write COUNTxTYPE or NODESxGPUSxTYPE, e.g. 96x8xA100-40GB")
    a, b, kind = m.groups()
    if a is None:
        nodes, per_node = 1, 1
    elif b is None:
        nodes, per_node = 1, int(a)
    else:
        nodes, per_node = int(a), int(b)
    if nodes < 1 or per_node < 1 or nodes > 100_000 or per_node > 1024:
        raise SpecError("--gpus", f"{nodes} node(s) x {per_node} GPU(s) is not a cluster",
                        "use positive counts, e.g. 8xA100")
    note = ""
    if profile is None:
        profile, note = find_device(kind)
    intra = profile.intra_node
    inter = profile.inter_node
    if intra_gbps is not None:
        intra = Link(name=f"{intra.name} (--intra-gbps)", busbw_gbps=intra_gbps, latency_us=intra.latency_us)
    if inter_gbps is not None or inter_latency_us is not None:
        inter = Link(name=f"{inter.name} (overridden)",
                     busbw_gbps=inter_gbps if inter_gbps is not None else inter.busbw_gbps,
                     latency_us=inter_latency_us if inter_latency_us is not None else inter.latency_us)
    host = profile.host
    if per_node != profile.gpus_per_node and host.can_offload:
        # a profile's host numbers describe its node of profile.gpus_per_node devices; a node
        # with a different count is taken as that server scaled (memory, CPU, NVMe per device)
        k = per_node / profile.gpus_per_node
        host = dataclasses.replace(host, cpu_memory_gb=host.cpu_memory_gb * k,
                                   cpu_adam_gparams=host.cpu_adam_gparams * k, nvme_gbps=host.nvme_gbps * k,
                                   nvme_gb=host.nvme_gb * k, checkpoint_gbps=host.checkpoint_gbps * k)
    for flag, key, v in (("--cpu-mem-gb", "cpu_memory_gb", cpu_mem_gb), ("--nvme-gbps", "nvme_gbps", nvme_gbps),
                         ("--nvme-gb", "nvme_gb", nvme_gb), ("--checkpoint-gbps", "checkpoint_gbps", checkpoint_gbps)):
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise SpecError(flag, f"must be a number >= 0, got {v!r}", "give GB (memory) or GB/s (NVMe) per node")
        host = dataclasses.replace(host, **{key: float(v)})
    return ClusterSpec(nodes=nodes, gpus_per_node=per_node, device=profile, intra_node=intra,
                       inter_node=inter, spec=text.strip(), note=note, host=host,
                       memory_headroom=memory_headroom)
