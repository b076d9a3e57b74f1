"""Tuning on a cluster without a cluster: storage URLs, study ownership, node groups, the
shared refine loop with a stand-in runner (the real runs: tests/integration/test_distributed_tuning.py)."""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import optuna
import pytest

from planner.tune.shared import _pop, refine_shared, retried_trial, runs_study_name
from planner.cli import main
from planner.errors import ExecutionError, SpecError
from planner.runtime.train.group_launch import NodeGroup
from planner.search.storage import claim_study, open_storage, safe_url
from planner.specs import parse_cluster

INPUTS = ["--model", "chatglm3-6b", "--scale", "tiny", "--gpus", "2xcpu", "--global-batch", "8", "--seq-len", "64",
          "--trials", "12"]
S = optuna.trial.TrialState


def test_urls_hide_their_password() -> None:
    assert safe_url("postgresql://tuner:hunter2@db:5432/optuna") == "postgresql://tuner:***@db:5432/optuna"
    assert safe_url("sqlite:///x.db") == "sqlite:///x.db"
    assert safe_url("no url") == "(not a URL)"


@pytest.mark.parametrize("url, words", [
    ("nosuchdb://u:hunter2@h/d", "unknown database scheme 'nosuchdb'"),
    ("just-a-path.db", "is not a URL"),
    ("postgresql://u:hunter2@127.0.0.1:1/d", "Connection refused"),     # psycopg 3, SQLAlchemy's default
    ("postgresql+psycopg2://u@127.0.0.1:1/d", "Failed to import DB access module"),   # no psycopg2
])
def test_bad_storage_urls_are_one_line_without_the_password(url: str, words: str) -> None:
    with pytest.raises(SpecError) as info:
        open_storage(url)
    line = info.value.line()
    assert info.value.field == "--storage" and words in line and "hunter2" not in line and "\n" not in line


def test_a_study_made_for_other_inputs_is_refused_untouched(tmp_path: Path) -> None:
    storage = open_storage(f"sqlite:///{tmp_path}/s.db")
    study = claim_study(storage, "s", "key-a", "model A on 8xA100")
    study.enqueue_trial({"x": 1})
    with pytest.raises(SpecError, match="was created for model A on 8xA100; this search is for model B") as info:
        claim_study(storage, "s", "key-b", "model B on 8xA100")
    assert info.value.field == "--study" and len(study.get_trials()) == 1
    assert claim_study(storage, "s", "key-a", "model A on 8xA100").user_attrs["planner_inputs"]["key"] == "key-a"
    optuna.create_study(storage=storage, study_name="foreign").enqueue_trial({"x": 1})
    with pytest.raises(SpecError, match="was not created by `planner search`"):
        claim_study(storage, "foreign", "key-a", "model A")


def _hostfile(tmp_path: Path, text: str) -> str:
    (tmp_path / "hosts").write_text(text)
    return str(tmp_path / "hosts")


def test_node_groups_resolve_like_the_deepspeed_launcher(tmp_path: Path) -> None:
    hf = _hostfile(tmp_path, "# two workers share this host\nlocalhost slots=4\n")
    g = NodeGroup.parse(hf, include="localhost:2,3")
    assert g.resources == (("localhost", (2, 3)),) and g.slots == 2 and g.local
    g.check(parse_cluster("2xcpu"))
    cmd = g.command(tmp_path / "run", steps=3, warmup=1, port=29511)
    assert cmd[0].endswith("deepspeed") and cmd[1:5] == ["--hostfile", hf, "--include", "localhost:2,3"]
    assert "--no_ssh_check" in cmd and cmd[cmd.index("--master_addr") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--run-dir") + 1] == str((tmp_path / "run").resolve()) and cmd[-4:] == ["--steps", "3",
                                                                                               "--warmup", "1"]
    assert NodeGroup.parse(hf, exclude="localhost:0").resources == (("localhost", (1, 2, 3)),)
    assert NodeGroup.parse(None) is None
    two = NodeGroup.parse(_hostfile(tmp_path, "node-a slots=8\nnode-b slots=8\n"))
    assert not two.local and "--no_ssh_check" not in two.command(tmp_path, steps=2, warmup=1, port=1)
    two.check(parse_cluster("2x8xA100"))
    with pytest.raises(SpecError, match="names fewer slots than the plan needs: 2 host"):
        two.check(parse_cluster("4x8xA100"))


@pytest.mark.parametrize("text, kw, field, words", [
    ("localhost slots=4\n", {}, "--hostfile", "names more slots than the plan needs: 1 host(s), 4 slot(s)"),
    ("localhost slots=4\n", {"include": "localhost:0"}, "--include", "names fewer slots"),
    ("localhost slots=4\n", {"include": "nohost"}, "--include", "does not select slots"),
    ("localhost slots=4\n", {"include": "localhost:0", "exclude": "localhost:1"}, "--include/--exclude", "not both"),
    ("localhost 4\n", {}, "--hostfile", "bad entry"),
])
def test_bad_node_groups_name_their_flag(tmp_path: Path, text: str, kw: dict, field: str, words: str) -> None:
    with pytest.raises(SpecError) as info:
        NodeGroup.parse(_hostfile(tmp_path, text), **kw).check(parse_cluster("2xcpu"))
    assert info.value.field == field and words in info.value.line()


def test_a_run_past_its_timeout_is_stopped_with_its_children(tmp_path: Path, monkeypatch) -> None:
    g = NodeGroup.parse(_hostfile(tmp_path, "localhost slots=2\n"))
    pidfile = tmp_path / "child.pid"
    script = f"import subprocess,time; p=subprocess.Popen(['sleep','60']); open({str(pidfile)!r},'w').write(str(p.pid)); time.sleep(60)"
    monkeypatch.setattr(NodeGroup, "command", lambda self, run, **kw: [sys.executable, "-c", script])
    t0 = time.monotonic()
    with pytest.raises(ExecutionError, match="did not finish within 1 s") as info:
        g.run(tmp_path, steps=2, warmup=1, timeout=1)
    assert info.value.field == "--trial-timeout" and time.monotonic() - t0 < 20
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5.0  # SIGKILL is delivered asynchronously: on a loaded host it takes a moment
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)                                  # the whole tree, not just the launcher


def _alive(pid: int) -> bool:
    """Running (a zombie that no init reaped in this container counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("search")
    assert main(["search", *INPUTS, "--out-dir", str(out), "--name", "r"]) == 0
    return out / "r"


def _fake_runner(calls: list, pause: float = 0.0):
    def run(sub: Path, steps: int, warmup: int) -> dict:
        calls.append(sub.name)
        time.sleep(pause)
        est = json.loads((sub / "estimate.json").read_text())["estimate"]
        return {"step_time_s": est["step_time_s"] * 1.5, "tokens_per_s": est["tokens_per_s"] / 1.5,
                "peak_memory_gb": est["peak_memory_gb"]}
    return run


def test_shared_loop_retries_a_dead_workers_trial_once(run_dir: Path, tmp_path: Path) -> None:
    """A worker that took a trial and died (its heartbeat stops) loses it to the next worker."""
    url = f"sqlite:///{tmp_path}/s.db"
    storage = open_storage(url, heartbeat_s=1)
    kw = dict(warmup=1, storage=storage, study="u", key="k", label="tiny on 2xcpu", url=url)
    # the dead worker: it created the study, took plan 0 and stopped beating
    dead = threading.Thread(target=lambda: _refine_dead(run_dir, 3, 3, runner=_raise_dead, **kw))
    dead.start()
    dead.join()
    st = optuna.load_study(study_name=runs_study_name("u"), storage=storage)
    assert [t.state for t in st.get_trials()] == [S.RUNNING, S.WAITING, S.WAITING]
    calls: list = []
    result = refine_shared(run_dir, 3, 3, runner=_fake_runner(calls), **kw)
    trials = st.get_trials()
    assert [t.state for t in trials] == [S.FAIL, S.COMPLETE, S.COMPLETE, S.COMPLETE]
    assert sorted(t.params["plan"] for t in trials if t.state == S.COMPLETE) == [0, 1, 2]
    assert retried_trial(trials[3]) == 0
    assert sorted(calls) == ["plan-0", "plan-1", "plan-2"]
    t = trials[1]
    assert t.user_attrs["measured"]["tokens_per_s"] == t.value
    assert t.user_attrs["predicted"]["tokens_per_s"] == pytest.approx(1.5 * t.value)
    assert t.user_attrs["plan"] == st.user_attrs["plans"][t.params["plan"]]["plan"] and t.user_attrs["host"]
    assert result["summary"]["runs"] == 3 and result["best_measured"]["trial"] in (1, 2, 3)
    assert json.loads((run_dir / "refine.json").read_text())["study"] == "u.runs"
    # a second look finds nothing to do and runs nothing
    again: list = []
    refine_shared(run_dir, 3, 3, runner=_fake_runner(again), **kw)
    assert again == [] and len(st.get_trials()) == 4


class _Dead(BaseException):
    pass


def _raise_dead(sub: Path, steps: int, warmup: int) -> dict:
    raise _Dead()          # leaves the trial RUNNING, as a kill -9 would


def _refine_dead(*a, **kw):
    try:
        return refine_shared(*a, **kw)
    except _Dead:
        return None


def test_two_workers_in_threads_share_the_plans_without_repeats(run_dir: Path, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/s.db"
    calls: list = []
    errors: list = []

    def worker() -> None:
        try:
            refine_shared(run_dir, 3, 3, warmup=1, storage=open_storage(url, heartbeat_s=1), study="w", key="k",
                          label="l", runner=_fake_runner(calls, pause=0.3), url=url)
        except BaseException as exc:   # noqa: BLE001 - reported below
            errors.append(exc)
    threads = [threading.Thread(target=worker) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == [] and sorted(calls) == ["plan-0", "plan-1", "plan-2"]


def test_pop_hands_a_waiting_trial_to_one_caller(tmp_path: Path) -> None:
    storage = open_storage(f"sqlite:///{tmp_path}/s.db", heartbeat_s=1)
    st = optuna.create_study(storage=storage, study_name="p")
    st.enqueue_trial({"plan": 0})
    sid = storage.get_study_id_from_name("p")
    assert _pop(storage, sid) is not None and _pop(storage, sid) is None


def test_cli_refuses_tuning_flags_without_refine_and_dry_run_writes_no_study(tmp_path: Path, capsys) -> None:
    hf = _hostfile(tmp_path, "localhost slots=4\n")
    assert main(["search", *INPUTS, "--out-dir", str(tmp_path), "--hostfile", hf]) == 2
    assert "--hostfile: only applies to --refine K" in capsys.readouterr().err
    url = f"sqlite:///{tmp_path}/s.db"
    code = main(["search", *INPUTS, "--out-dir", str(tmp_path), "--name", "d", "--refine", "2", "--storage", url,
                 "--study", "dry", "--hostfile", hf, "--include", "localhost:0,1", "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0 and out.count("--include localhost:0,1 --no_ssh_check --master_addr 127.0.0.1") == 2
    assert f"--run-dir {tmp_path / 'd' / 'refine' / 'plan-1'}" in out and "--steps 5 --warmup 1" in out
    assert (tmp_path / "d" / "refine" / "plan-1" / "ds_config.json").exists()
    assert runs_study_name("dry") not in optuna.get_all_study_names(storage=url)
    assert main(["search", *INPUTS, "--out-dir", str(tmp_path), "--refine", "2", "--hostfile", hf]) == 2
    assert "--hostfile: names more slots than the plan needs" in capsys.readouterr().err


def test_a_failed_trial_is_named_in_one_line(run_dir: Path) -> None:
    """One machine's loop: each failed plan is echoed with its error, and when none ran the
    refusal carries the first plan's error (a host ssh cannot reach, a lost metrics.json)."""
    from planner.tune.refine import refine

    def unreachable(sub: Path, steps: int, warmup: int) -> dict:
        raise ExecutionError("--hostfile", "checking the run directory on node-3: ssh exited with status 255",
                             "make `ssh node-3` work")
    seen: list[str] = []
    with pytest.raises(SpecError) as info:
        refine(run_dir, 2, steps=3, runner=unreachable, echo=seen.append)
    assert [ln.split(": ")[0] for ln in seen if "failed" in ln] == ["refine 1/2 failed", "refine 2/2 failed"]
    line = info.value.line()
    assert line.startswith("--refine: no plan ran successfully; the first: ") and "on node-3: ssh exited" in line


def test_refine_plans_name_positions_of_the_ranking(run_dir: Path) -> None:
    """--refine-plans: the ranking is the plans table's (fastest predicted first, ties by less
    memory); positions pick from it in the order given; a position past its end is one line."""
    from planner.tune.refine import top_plans
    ranking = top_plans(run_dir / "trials.csv", 10 ** 9)
    steps = [(s, p.to_dict()) for _, p, s in ranking]
    assert [s for s, _ in steps] == sorted(s for s, _ in steps) and len(ranking) >= 5
    picked = top_plans(run_dir / "trials.csv", 2, (1, 5))
    assert picked == [ranking[0], ranking[4]] and top_plans(run_dir / "trials.csv", 2) == ranking[:2]
    with pytest.raises(SpecError, match=f"names plan 9999, but the search ranked {len(ranking)} distinct") as info:
        top_plans(run_dir / "trials.csv", 2, (1, 9999))
    assert info.value.field == "--refine-plans"


def test_workers_with_other_plans_do_not_share_a_runs_study() -> None:
    from planner.tune.shared import runs_key
    assert runs_key("s", 2, 4, 1) == "s-k2-s4-w1"                # the key of studies made before --refine-plans
    assert len({runs_key("s", 2, 4, 1), runs_key("s", 2, 4, 1, (1, 73)), runs_key("s", 2, 4, 1, (1, 72))}) == 3


@pytest.mark.parametrize("args, words", [
    (["--refine-plans", "1,2"], "--refine-plans: only applies to --refine K"),
    (["--refine", "2", "--refine-plans", "1,2,3"], "--refine-plans: '1,2,3' does not name 2 distinct plans"),
    (["--refine", "2", "--refine-plans", "3,3"], "--refine-plans: '3,3' does not name 2 distinct plans"),
    (["--refine", "2", "--refine-plans", "0,1"], "--refine-plans: '0,1' does not name 2 distinct plans"),
    (["--refine", "2", "--refine-plans", "1,best"], "--refine-plans: '1,best' is not a list of plan numbers"),
])
def test_bad_refine_plans_are_one_line(tmp_path: Path, capsys, args: list, words: str) -> None:
    assert main(["search", *INPUTS, "--out-dir", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1 and not (tmp_path / "chatglm3-6b-tiny_2xcpu").exists()


def test_refine_plans_run_the_named_plans_and_past_the_end_write_no_study(tmp_path: Path, capsys) -> None:
    from planner.tune.refine import top_plans
    hf = _hostfile(tmp_path, "localhost slots=2\n")
    url = f"sqlite:///{tmp_path}/s.db"
    base = [*INPUTS, "--out-dir", str(tmp_path), "--name", "p", "--storage", url, "--study", "picked"]
    assert main(["search", *base, "--refine", "2", "--refine-plans", "5,1", "--hostfile", hf, "--dry-run"]) == 0
    out = capsys.readouterr().out
    ranking = top_plans(tmp_path / "p" / "trials.csv", 5)
    assert f"# plan 1: {ranking[4][1].describe()}\n" in out and f"# plan 2: {ranking[0][1].describe()}\n" in out
    first = json.loads((tmp_path / "p" / "refine" / "plan-0" / "plan.json").read_text())
    assert first["plan"] == ranking[4][1].to_dict()
    assert main(["search", *base, "--refine", "2", "--refine-plans", "1,9999", "--hostfile", hf]) == 2
    err = capsys.readouterr().err
    assert "--refine-plans: names plan 9999, but the search ranked" in err
    assert runs_study_name("picked") not in optuna.get_all_study_names(storage=url)
