"""The strict-loader check every spec's `from_dict` starts with: a JSON object, and only the
dataclass's own field names (a typo in plan.json is an error naming it, never a silent default)."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from planner.errors import SpecError


def check_fields(cls: type, data: Any, where: str, fix: str) -> None:
    """Raise SpecError(where) unless `data` is a mapping whose keys are all fields of `cls`;
    `fix` says what to pass when it is not a mapping."""
    if not isinstance(data, Mapping):
        raise SpecError(where, "must be a JSON object", fix)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise SpecError(where, f"unknown field(s) {sorted(unknown)}", f"use only {sorted(names)}")
