"""The HTML report: one self-contained page that explains a run directory.

    from planner.report import write_report
    write_report("reports/glm-10b")          # -> reports/glm-10b/report.html

write_report is loaded on first use, so planner.report.plan_text (the words the CLI shares
with the page) imports without pandas, matplotlib and jinja2.
"""
from __future__ import annotations

from typing import Any

__all__ = ["write_report"]


def __getattr__(name: str) -> Any:
    if name == "write_report":
        from planner.report.build import write_report
        return write_report
    raise AttributeError(f"module 'planner.report' has no attribute {name!r}")
