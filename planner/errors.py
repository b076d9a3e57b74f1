"""Errors a user can act on.

Library code raises these; only the CLI turns them into one line and an exit code.
Every message names the field at fault and the fix, so the CLI never shows a traceback.
"""
from __future__ import annotations


class PlannerError(Exception):
    """A problem with the user's input or environment, reported as one line."""

    def __init__(self, field: str, problem: str, fix: str = "") -> None:
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(self.line())

    def line(self) -> str:
        text = f"{self.field}: {self.problem}"
        if self.fix:
            text += f" (fix: {self.fix})"
        return text


class SpecError(PlannerError):
    """A model, cluster, training or plan specification is malformed or inconsistent."""


class ProfileError(PlannerError):
    """A hardware profile file is malformed, from another schema, or missing a field."""


class ExecutionError(PlannerError):
    """Running a plan failed: DeepSpeed rejected it, a rank died, or it hung."""
