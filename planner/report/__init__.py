"""The HTML report: one self-contained page that explains a run directory.

    from planner.report import write_report
    write_report("reports/glm-10b")          # -> reports/glm-10b/report.html
"""
from planner.report.build import write_report

__all__ = ["write_report"]
