"""The report renders what the real `planner search` writes (not only the sample fixture)."""
from __future__ import annotations

import re
from pathlib import Path

from planner.cli import main
from planner.report.data import load


def test_real_search_output_renders_completely(tmp_path: Path, capsys) -> None:
    assert main(["search", "--model", "glm-10b", "--gpus", "8xA100", "--trials", "40",
                 "--out-dir", str(tmp_path), "--name", "g"]) == 0
    capsys.readouterr()
    run_dir = tmp_path / "g"
    assert (run_dir / "report.html").exists(), "planner search did not write the report"
    run = load(run_dir)
    assert run.trials is not None and len(run.trials) >= 40 and run.study is not None and not run.notes
    html = (run_dir / "report.html").read_text()
    ids = set(re.findall(r'<img src="data:image/png;base64,[^"]+" alt="[^"]*" id="img-([a-z]+)"', html))
    assert {"frontier", "memory", "time", "gantt", "history", "importances", "cluster"} <= ids
    assert "could not be drawn" not in html and 'class="note"' not in html
    assert run.plan.describe() in html and "planner search --model glm-10b" in html
