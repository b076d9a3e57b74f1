"""A problem with a plan, as a value: which field, a stable code, what is wrong, and the fix.

Rules return Problems (planner/specs/validate.py); each consumer takes what it needs: the cost
model's `reasons` and trials.csv's `reason` keep the sentence (`line`), the run's preflight
names `field` in its error, the CLI and the search filter by `code`, and the report groups
infeasible plans by `code` (trials.csv `reason_code`). Nobody reads a sentence to find out
what it means: rewording a message changes no behaviour.
"""
from __future__ import annotations

from dataclasses import dataclass

from planner.errors import PlannerError, SpecError


@dataclass(frozen=True, slots=True)
class Problem:
    field: str
    """What to change: a Plan field ("plan.tp"), a training input ("train.seq_len"), a flag."""
    code: str
    """Stable identifier of the rule ("tp-heads", "memory:activations")."""
    message: str
    """What is wrong, one sentence without the fix."""
    fix: str = ""
    """What to do instead (may be empty)."""
    detail: str = ""
    """Where the rule comes from, shown in parentheses after the message (may be empty)."""

    @property
    def statement(self) -> str:
        """What is wrong with where the rule comes from: "message (detail)"."""
        return f"{self.message} ({self.detail})" if self.detail else self.message

    @property
    def line(self) -> str:
        """The whole sentence: "message (detail): fix"."""
        return f"{self.statement}: {self.fix}" if self.fix else self.statement

    def error(self, kind: type[PlannerError] = SpecError, field: str | None = None, fix: str | None = None) -> PlannerError:
        """The one-line error of this problem: `field`, what is wrong, the fix (defaults: its own)."""
        return kind(self.field if field is None else field, self.statement, self.fix if fix is None else fix)

    def __str__(self) -> str:
        return self.line


MEMORY = "memory"
"""Code prefix of the memory problems (the estimate's): "memory:<MemoryBreakdown field>" names
what dominates a stage that does not fit; "memory" alone, a split the solvers proved cannot fit."""


def lines(problems: list[Problem] | tuple[Problem, ...]) -> list[str]:
    return [p.line for p in problems]


__all__ = ["MEMORY", "Problem", "lines"]
