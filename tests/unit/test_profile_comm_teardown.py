"""The collectives job's parent (planner/profiler/comm.run_group) against ranks that die: results are
taken only when rank 0 wrote them whole; a rank that dies after that (in the interpreter's teardown,
as once in CI: "terminate called without an active exception", exit -6) does not throw them away, and
a rank that dies before it is one clear ProfilingError. The children are stand-ins here (the real job
runs in tests/integration/test_profile_cli.py); what is checked is the parent's reading."""
from __future__ import annotations

import json

import pytest
import torch.multiprocessing as mp

from planner.profiler import comm


class _Ctx:
    """A stand-in for torch.multiprocessing's context: 'rank 0' writes `payload` (or not), then
    join raises the exit of rank `dead` with `code`, or reports success."""

    def __init__(self, out_path: str, payload: str | None, dead: int | None, code: int = -6):
        self.out_path, self.payload, self.dead, self.code = out_path, payload, dead, code
        self.processes: list = []

    def join(self, timeout: float | None = None) -> bool:
        if self.payload is not None:
            with open(self.out_path, "w") as fh:
                fh.write(self.payload)
        if self.dead is not None:
            raise mp.ProcessExitedException("died", error_index=self.dead, error_pid=1, exit_code=self.code)
        return True


def _run(monkeypatch, payload: str | None, dead: int | None):
    def start(fn, args, nprocs, join, start_method):
        return _Ctx(args[5], payload, dead)
    monkeypatch.setattr(mp, "start_processes", start)
    return comm.run_group(2, [4096], backend="gloo", timeout_s=5)


RESULTS = json.dumps({"collectives": [{"op": "all_reduce", "n": 2, "bytes": 4096, "iters": 1, "times": [1e-4]}],
                      "in_step": []})


def test_a_rank_dying_after_the_results_were_written_keeps_them_and_says_so(monkeypatch):
    raw = _run(monkeypatch, RESULTS, dead=0)
    assert raw["collectives"][0]["bytes"] == 4096
    assert raw["teardown"] == "rank 0 exited (-6) after the measurements were written"


def test_a_rank_dying_before_the_results_is_one_clear_error(monkeypatch):
    with pytest.raises(comm.ProfilingError) as exc:
        _run(monkeypatch, None, dead=1)
    assert "rank 1 exited (-6)" in str(exc.value.line())


def test_half_written_results_are_not_taken(monkeypatch):
    with pytest.raises(comm.ProfilingError):
        _run(monkeypatch, RESULTS[: len(RESULTS) // 2], dead=0)


def test_a_clean_exit_without_results_is_an_error_not_an_empty_profile(monkeypatch):
    with pytest.raises(comm.ProfilingError) as exc:
        _run(monkeypatch, None, dead=None)
    assert "wrote no results" in exc.value.line()


def test_a_clean_exit_returns_the_results_without_a_teardown_note(monkeypatch):
    raw = _run(monkeypatch, RESULTS, dead=None)
    assert "teardown" not in raw and raw["in_step"] == []
