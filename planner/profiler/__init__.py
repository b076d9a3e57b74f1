"""Profiler: measure the machine it runs on -> a device profile (planner/specs/hardware.py schema).

    from planner.profiler import profile_machine, ProfileOptions
    data = profile_machine(ProfileOptions(model=spec, quick=True, procs=2), name="cpu-measured")

Imports torch lazily, so importing this package stays cheap.
"""
from __future__ import annotations

from typing import Any, Callable

from planner.profiler.run import ProfileOptions, WorkList, make_plan, measure_all

__all__ = ["ProfileOptions", "WorkList", "profile_machine"]


def profile_machine(opts: ProfileOptions, *, name: str | None = None, force_cpu: bool = False,
                    tick: Callable[[str], None] = lambda _: None,
                    on_plan: Callable[[WorkList], None] = lambda _: None) -> dict[str, Any]:
    """Measure this machine and return the profile dict (validated, not yet written)."""
    from planner.profiler import device, write
    target = device.detect(force_cpu)
    plan = make_plan(opts, target)
    on_plan(plan)
    raw = measure_all(opts, target, plan, tick)
    env = device.environment(target)  # after measure_all set the thread count it used
    return write.build(raw, env, opts, name=name or f"{write.slug(target.name if target.kind == 'gpu' else 'cpu')}-measured",
                       kind=target.kind, memory_gb=device.memory_gb(target),
                       per_node=device.devices_per_node(target, opts.procs))
