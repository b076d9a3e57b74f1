"""An output path that cannot be written is refused up front, in one line naming it, exit 2,
for every command that writes (issue 21): before a search runs, a profile measures, a baseline
trains or a tokenizer is trained. Before, these ended in an OSError "internal error", a
SQLAlchemy message with a URL, or (profile) a hang."""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

from planner.cli import main
from planner.errors import SpecError
from planner.rundir import check_writable

TINY = ["--model", "chatglm3-6b", "--scale", "tiny", "--gpus", "2xcpu"]


def _writable(d: Path) -> bool:
    try:
        fd, p = tempfile.mkstemp(dir=d)
    except OSError:
        return False
    os.close(fd)
    os.unlink(p)
    return True


@pytest.fixture
def locked(tmp_path: Path):
    """A directory this process cannot create entries in: a read-only one (chmod 0555), or for
    root, whom permission bits do not stop, /sys/kernel (sysfs refuses new files)."""
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    if _writable(d):
        d = Path("/sys/kernel")
    if not d.is_dir() or _writable(d):
        pytest.skip("no unwritable directory on this machine")
    yield d
    (tmp_path / "ro").chmod(0o755)


def test_check_writable_names_the_path_and_the_existing_parent(locked: Path, tmp_path: Path) -> None:
    with pytest.raises(SpecError) as info:
        check_writable(locked / "a" / "b", "--out-dir")
    line = info.value.line()
    assert line.startswith(f"--out-dir: cannot write to {locked / 'a' / 'b'} (its nearest existing directory "
                           f"{locked}): ") and "(fix: give a directory you can write to" in line
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(SpecError, match="cannot be created: .*file is not a directory"):
        check_writable(f / "sub", "--write")
    check_writable(tmp_path / "new" / "deeper", "--write")          # creatable: fine, nothing left
    assert not (tmp_path / "new").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["file", "ro"]


@pytest.fixture
def run_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("w") / "run"
    assert main(["estimate", *TINY, "--zero", "1", "--write", str(d)]) == 0
    return d


def _one_line(capsys, argv: list[str], flag: str, path: Path) -> None:
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert "\n" not in err and err.startswith(f"error: {flag}: cannot write to {path}"), err


@pytest.mark.parametrize("command", ["search", "estimate", "export", "prepare-data", "serve", "profile"])
def test_each_command_refuses_an_unwritable_output(capsys, locked: Path, run_dir: Path, tmp_path: Path,
                                                   command: str) -> None:
    text = tmp_path / "a.txt"
    text.write_text("one document\n\nanother one\n")
    cases = {
        "search": (["search", *TINY, "--trials", "2", "--out-dir", str(locked), "--name", "x"], "--out-dir",
                   locked / "x"),
        "estimate": (["estimate", *TINY, "--write", str(locked / "w")], "--write", locked / "w"),
        "export": (["export", str(run_dir), "--to", "torchrun", "--out", str(locked / "e")], "--out", locked / "e"),
        "prepare-data": (["prepare-data", str(text), "--out", str(locked / "corpus"), "--train-tokenizer", "300",
                          "--no-progress"], "--out", locked),
        "serve": (["serve", "--model", "chatglm3-6b", "--scale", "tiny", "--gpus", "1xcpu", "--out-dir", str(locked),
                   "--name", "s"], "--out-dir", locked / "s"),
        "profile": (["profile", "--quick", "--out", str(locked / "p.json")], "--out", locked),
    }
    argv, flag, path = cases[command]
    _one_line(capsys, argv, flag, path)


def test_verify_refuses_a_run_directory_it_cannot_write(capsys, locked: Path, run_dir: Path, monkeypatch) -> None:
    from planner import rundir
    real = rundir.check_writable

    def as_if_locked(path, field):          # the run directory itself, made unwritable
        real(locked if Path(path) == run_dir else path, field)
    monkeypatch.setattr(rundir, "check_writable", as_if_locked)
    rc = main(["verify", str(run_dir)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith(f"error: RUN_DIR: cannot write to {locked}") and "\n" not in err
    assert not (run_dir / "verify").exists()
