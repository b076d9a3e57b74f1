"""`planner estimate`'s plan options, generated from planner/specs/knobs.py: one click option per
Plan field that has a flag, with the field's type, default, choices and help. The command gets
them under the fields' names (`plan_fields(kw)`), and a Plan rule is reported under its flag."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import click

from planner.errors import SpecError
from planner.specs.knobs import KNOBS
from planner.specs.plan import Plan

_FIELDS = {f.name: f for f in dataclasses.fields(Plan)}
FLAGS = {name: k.flag for name, k in KNOBS.items() if k.flag}
"""Plan field -> its `planner estimate` option."""


def _option(name: str) -> Callable:
    knob, default = KNOBS[name], _FIELDS[name].default
    if isinstance(default, bool):
        return click.option(knob.flag, name, is_flag=True, help=knob.help)
    if isinstance(default, tuple):  # comma-separated integers, read by int_list
        metavar = "K0,K1,..." if name == "recompute_layers" else "N0,N1,..."
        return click.option(knob.flag, name, default=None, metavar=metavar, help=knob.help)
    kind = click.Choice(list(knob.choices)) if knob.choices else type(default)
    return click.option(knob.flag, name, type=kind, default=default, show_default=True, help=knob.help or None)


def plan_options(f: Callable) -> Callable:
    """Add an option for every Plan field with a flag (in the Plan's field order)."""
    for name in reversed(list(FLAGS)):
        f = _option(name)(f)
    return f


def int_list(text: str | None, flag: str) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise SpecError(flag, f"cannot read {text!r}", "give comma-separated integers, e.g. 9,9,9,8") from None


def plan_fields(kw: dict[str, Any]) -> dict[str, Any]:
    """The Plan fields the options gave (tuples parsed)."""
    out = {}
    for name in FLAGS:
        v = kw[name]
        out[name] = int_list(v, FLAGS[name]) if isinstance(_FIELDS[name].default, tuple) else v
    return out


def build_plan(**fields: Any) -> Plan:
    """Plan(**fields); a rule it breaks is reported under the flag that set the field."""
    try:
        return Plan(**fields)
    except SpecError as exc:
        name = exc.field.removeprefix("plan.")
        flag = FLAGS.get(name) or ("--interleave" if name == "schedule" else None)
        if flag is None:
            raise
        raise SpecError(flag, exc.problem, exc.fix) from None


__all__ = ["FLAGS", "build_plan", "int_list", "plan_fields", "plan_options"]
