"""Two searches into one --name (issue 25): the second printed "wrote reports/same/" and
silently replaced the first. Now a search of other inputs is refused unless --overwrite (which
moves the old plan to previous/), and a search while another holds the directory is refused."""
from __future__ import annotations

import json
from pathlib import Path

from planner.cli import main
from planner.search.claim import claim

TINY = ["--model", "chatglm3-6b", "--scale", "tiny", "--gpus", "2xcpu", "--exhaustive"]


def _search(capsys, tmp_path: Path, *extra: str) -> tuple[int, str, str]:
    rc = main(["search", *TINY, "--out-dir", str(tmp_path), "--name", "same", *extra])
    out, err = capsys.readouterr()
    return rc, out, err


def test_other_inputs_into_the_same_name_are_refused_unless_overwrite(capsys, tmp_path: Path) -> None:
    d = tmp_path / "same"
    assert _search(capsys, tmp_path)[0] == 0
    first = (d / "plan.json").read_text()
    rc, out, err = _search(capsys, tmp_path, "--global-batch", "16")
    assert rc == 2 and "wrote" not in out
    line = err.strip()
    assert "\n" not in line and line.startswith(f"error: --name: {d} holds a plan for other inputs")
    assert "(chatglm3-6b-tiny on 2xcpu: train.global_batch 8 -> 16)" in line
    assert "--overwrite" in line and (d / "plan.json").read_text() == first          # untouched
    rc, out, _ = _search(capsys, tmp_path, "--global-batch", "16", "--overwrite")
    assert rc == 0 and f"wrote {d}/" in out
    (prev,) = (d / "previous").iterdir()
    assert (prev / "plan.json").read_text() == first and "trials.csv" in {p.name for p in prev.iterdir()}
    assert json.loads((d / "plan.json").read_text())["inputs"]["train"]["global_batch"] == 16
    assert "moved plan.json" in out


def test_the_same_search_again_resumes_without_a_flag(capsys, tmp_path: Path) -> None:
    assert _search(capsys, tmp_path)[0] == 0
    rc, out, _ = _search(capsys, tmp_path)
    assert rc == 0 and not (tmp_path / "same" / "previous").exists()


def test_a_search_while_another_holds_the_directory_is_refused(capsys, tmp_path: Path) -> None:
    d = tmp_path / "same"
    held = claim(d, {"model": {}, "cluster": {}, "train": {}}, overwrite=False)
    try:
        rc, out, err = _search(capsys, tmp_path)
    finally:
        held.release()
    assert rc == 2 and "wrote" not in out and not (d / "plan.json").exists()
    assert err.strip() == (f"error: --name: {d} is being written by another search (pid {__import__('os').getpid()}) "
                           "(fix: wait for it to finish, or pick another --name)")
    assert _search(capsys, tmp_path)[0] == 0            # released: the next one runs
