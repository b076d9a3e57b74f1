"""The suite collects as one pytest session: test folders are not packages, so two test
modules with the same file name (one in tests/unit, one in tests/integration) stop the whole
run at collection ("import file mismatch"). Twice this session a new module did just that."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_modules_share_a_file_name() -> None:
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert [n for n, k in names.items() if k > 1] == []
    assert names["test_suite_layout.py"] == 1 and len(names) > 40
