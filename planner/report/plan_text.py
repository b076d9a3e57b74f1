"""Words about one plan that `planner search`, `planner estimate` and the HTML report share:
its ZeRO variants in a few letters, the host memory it needs per node, and the flag for a
plan whose peak device memory comes within 2% of the memory it may use.

Standard library and planner.specs only, so `planner estimate` imports it without the
report's pandas, matplotlib and jinja2.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from planner.specs.estimate import GB, NEAR_LIMIT
from planner.specs.plan import Plan

_DEFAULT_PLAN = Plan()


def short_variants(plan: Plan) -> tuple[str, ...]:
    """ZeRO variants in a few letters: off-opt:cpu, off-par:nvme, hpZ8, qwZ, qgZ, MiCS16."""
    return tuple(short for _, short in plan.variant_labels())


def _elements(n: int) -> str:
    return f"{n:.0e}".replace("e+0", "e").replace("e+", "e")


def option_labels(plan: Plan) -> tuple[str, ...]:
    """Every ZeRO option the plan sets away from its default, in a few letters: the variants
    (short_variants), then overlap=off, bucket=1e9, prefetch=, live=, persist= . Two plans that
    differ only here must not look the same in a table or a chart label (issue 25)."""
    d = _DEFAULT_PLAN
    out = list(short_variants(plan))
    if plan.overlap_comm != d.overlap_comm:
        out.append("overlap=off" if not plan.overlap_comm else "overlap=on")
    for name, field in (("bucket", "bucket_elements"), ("prefetch", "prefetch_elements"),
                        ("live", "live_elements"), ("persist", "persistence_elements")):
        v = getattr(plan, field)
        if v != getattr(d, field):
            out.append(f"{name}={_elements(v)}")
    return tuple(out)


def distinct_labels(labels: list[str], plans: list[Plan | None]) -> list[str]:
    """The labels, each one that another shares extended by what its plan sets differently
    ("#1 TP1·PP1·DP2" twice -> "... stages 2,2" / "... stages 3,1"); plans that are equal keep
    the shared label."""
    out = list(labels)
    for i, lab in enumerate(labels):
        twins = [j for j, other in enumerate(labels) if other == lab and j != i]
        if not twins or plans[i] is None:
            continue
        mine = plans[i].to_dict()
        diff = []
        for j in twins:
            theirs = plans[j].to_dict() if plans[j] is not None else {}
            diff += [k for k in mine if mine[k] != theirs.get(k) and k not in diff]
        if diff:
            out[i] = lab + " (" + ", ".join(f"{k}={_compact(mine[k])}" for k in diff) + ")"
    return out


def _compact(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return ",".join(str(x) for x in v) or "-"
    if isinstance(v, int) and not isinstance(v, bool) and v >= 10_000:
        return _elements(v)
    return str(v)


def headroom_gb(cluster: Any, est: Any = None) -> float | None:
    """GB per device the plan leaves free inside its estimate (--memory-headroom): the
    cluster's when given, else the allowance the estimate counted (Estimate.headroom_bytes or
    estimate.json headroom_gb); None when neither says."""
    h = getattr(cluster, "memory_headroom", None)
    if _num(h):
        return float(h)
    if isinstance(est, Mapping):
        v = est.get("headroom_gb")
        return float(v) if _num(v) else None
    v = getattr(est, "headroom_bytes", None)
    return v / GB if _num(v) and v > 0 else None


def headroom_text(gb: float | None) -> str:
    """1.0 -> "1 GB", 2.5 -> "2.5 GB", None -> "the profile's"."""
    return "the profile's" if gb is None else f"{gb:.3g} GB"


@dataclass(frozen=True, slots=True)
class MemoryFlag:
    """A plan at (or over) the edge of the usable device memory."""

    peak_gb: float
    usable_gb: float
    headroom_gb: float | None
    over: bool
    """Peak above the usable memory."""

    def text(self) -> str:
        what = "over the usable memory" if self.over else "near the memory limit"
        return (f"{what}: {self.peak_gb:.1f} of {self.usable_gb:.1f} GB usable "
                f"(headroom {headroom_text(self.headroom_gb)})")

    @property
    def short(self) -> str:
        return "over usable memory" if self.over else "near memory limit"


def memory_flag(peak_bytes: float | None, usable_bytes: float | None, headroom: float | None) -> MemoryFlag | None:
    """The flag for a plan whose peak is within NEAR_LIMIT of the usable memory or above it;
    None for one further away, or when either number is unknown. `headroom` (GB) is only
    quoted in the text."""
    if not _num(peak_bytes) or not _num(usable_bytes) or usable_bytes <= 0 or peak_bytes <= 0:
        return None
    if peak_bytes <= usable_bytes * (1.0 - NEAR_LIMIT):
        return None
    return MemoryFlag(peak_gb=peak_bytes / GB, usable_gb=usable_bytes / GB,
                      headroom_gb=float(headroom) if _num(headroom) else None, over=peak_bytes > usable_bytes)


def plan_memory_flag(est: Any, cluster: Any) -> MemoryFlag | None:
    """memory_flag for an Estimate on a cluster: its peak against cluster.usable_bytes."""
    return memory_flag(est.peak_memory_bytes, cluster.usable_bytes, headroom_gb(cluster, est))


def host_bytes_per_rank(est: Any) -> float:
    """Host memory one rank needs (offloaded states, pinned buffers), from an Estimate or its
    JSON (estimate.json); 0 when the estimate does not say."""
    if isinstance(est, Mapping):
        v = est.get("host_memory_bytes")
        if not _num(v):
            gb = est.get("host_memory_gb")
            v = gb * GB if _num(gb) else 0.0
    else:
        v = getattr(est, "host_memory_bytes", 0.0)
    return float(v) if _num(v) and v > 0 else 0.0


@dataclass(frozen=True, slots=True)
class HostMemory:
    """The host memory a plan's offloaded states take on one node."""

    per_rank_gb: float
    ranks: int
    capacity_gb: float
    """The node's host memory (0: unknown)."""

    @property
    def per_node_gb(self) -> float:
        return self.per_rank_gb * self.ranks

    @property
    def over(self) -> bool:
        return 0 < self.capacity_gb < self.per_node_gb

    def text(self) -> str:
        """"158.0 GB per node (19.8 GB per rank x 8) of 2048 GB"."""
        of = f" of {self.capacity_gb:g} GB" if self.capacity_gb > 0 else \
            " (the node's host memory is unknown: --cpu-mem-gb)"
        over = ": MORE THAN THE NODE HAS" if self.over else ""
        return (f"{self.per_node_gb:.1f} GB per node ({self.per_rank_gb:.1f} GB per rank x {self.ranks})"
                f"{of}{over}")


def host_memory(est: Any, ranks_per_node: int, cpu_memory_gb: float) -> HostMemory | None:
    """The host memory per node of a plan, from an Estimate or its JSON; None when it needs none."""
    per_rank = host_bytes_per_rank(est)
    if per_rank <= 0:
        return None
    return HostMemory(per_rank_gb=per_rank / GB, ranks=int(ranks_per_node), capacity_gb=float(cpu_memory_gb))


def host_memory_text(est: Any, ranks_per_node: int, cpu_memory_gb: float) -> str | None:
    """host_memory(...).text(), or None when the plan needs no host memory."""
    h = host_memory(est, ranks_per_node, cpu_memory_gb)
    return h.text() if h else None


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


__all__ = ["NEAR_LIMIT", "HostMemory", "MemoryFlag", "headroom_gb", "headroom_text", "host_bytes_per_rank",
           "host_memory", "host_memory_text", "memory_flag", "plan_memory_flag", "short_variants", "option_labels", "distinct_labels"]
