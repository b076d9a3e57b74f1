"""The closed loop on a cluster: several `planner search --refine K --storage URL --study NAME`
workers (one per host or node group) share the real runs through one Optuna study.

    result = refine_shared("reports/glm", k=4, steps=5, storage=rdb, study="i23", key=..., label=...,
                           group=NodeGroup.parse("hosts", include="node-3"), timeout_s=900)

The runs live in the study NAME.runs (the search's own trials in NAME). The worker that
creates it (`create_study` succeeds for exactly one) enqueues its top K plans as WAITING
trials, one parameter `plan` = the index into the study's `plans` attribute; the others wait
for that list and run the same plans, whatever their own search ranked. Each worker takes a
waiting trial (Optuna's storage moves WAITING -> RUNNING for one caller only, so no plan runs
twice), beats its heartbeat while the run lasts, and records the measurement. A worker that
dies (kill -9, a lost host) stops beating: the next worker that looks marks its trial failed
(`optuna.storages.fail_stale_trials`) and RetryHeartbeatStaleTrialCallback (formerly RetryFailedTrialCallback) queues a copy, which any
worker takes. A run that fails by itself (out of memory, refused) is FAIL with its error and is
not retried. When no trial waits or runs, each worker refits the factors to every completed
run of the study and writes refine.json, as `refine` does for one machine.

Each trial's user attributes: plan (Plan.to_dict), description, predicted {step_time_s,
tokens_per_s, peak_memory_gb}, measured {the same, from metrics.json}, host, worker, group,
run_dir, command; value: measured tokens/s.
"""
from __future__ import annotations

import os
import socket
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

from planner.tune.refine import finish, prepare_plan_dir, top_plans, with_device
from planner.calibrate.runs import MeasuredRun
from planner.errors import PlannerError, SpecError
from planner.rundir import load_run
from planner.search.storage import INPUTS_ATTR, check_study, safe_url
from planner.specs.plan import Plan

RUNS_SUFFIX = ".runs"
Runner = Callable[[Path, int, int], dict[str, Any]]


def runs_study_name(study: str) -> str:
    return study + RUNS_SUFFIX


def runs_key(search_key: str, k: int, steps: int, warmup: int, picks: tuple[int, ...] = ()) -> str:
    """What the runs study is for: workers with other plans (K or --refine-plans) or steps are refused."""
    chosen = f"-p{','.join(map(str, picks))}" if picks else ""
    return f"{search_key}-k{k}{chosen}-s{steps}-w{warmup}"


def refine_shared(run_dir: str | Path, k: int, steps: int, *, warmup: int, storage: Any, study: str, key: str,
                  label: str, runner: Runner, describe_run: Callable[[Path], str] = lambda _: "",
                  group: str = "local", url: str = "", wait_s: float = 60.0, picks: tuple[int, ...] = (),
                  echo: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Take and run trials of study `study`.runs until none waits or runs; refit; write refine.json."""
    import optuna
    storage = optuna.storages.get_storage(storage)   # one trial cache for the study and the pops below
    run = Path(run_dir)
    _, model, cluster, train, doc = load_run(run)
    c = with_device(cluster, cluster.device)
    name = runs_study_name(study)
    st = _open(storage, name, key, label, run, k, wait_s, url, picks)
    plans = st.user_attrs["plans"]
    sid = storage.get_study_id_from_name(name)
    host, worker = socket.gethostname(), f"{socket.gethostname()}:{os.getpid()}"
    poll = max(0.5, min(2.0, storage.get_heartbeat_interval() or 2.0))
    while True:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(st)
        tid = _pop(storage, sid)
        if tid is None:
            busy = storage.get_all_trials(sid, deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
            if not busy:
                break
            time.sleep(poll)
            continue
        trial = optuna.trial.Trial(st, tid)
        i = trial.suggest_categorical("plan", list(range(len(plans))))
        entry = plans[i]
        plan = Plan.from_dict(entry["plan"])
        sub = run / "refine" / f"plan-{i}"
        prepare_plan_dir(sub, plan, model, c, train, doc, run)
        for attr, value in (("plan", entry["plan"]), ("description", entry["description"]),
                            ("predicted", entry["predicted"]), ("host", host), ("worker", worker),
                            ("group", group), ("run_dir", str(sub.resolve())), ("command", describe_run(sub))):
            trial.set_user_attr(attr, value)
        echo(f"refine trial {trial.number} (plan {i + 1}/{len(plans)}) on {group}: {entry['description']}")
        with _Heartbeat(storage, tid):
            try:
                m = runner(sub, steps, warmup)
            except PlannerError as exc:
                trial.set_user_attr("error", exc.line())
                st.tell(trial, state=optuna.trial.TrialState.FAIL)
                echo(f"refine trial {trial.number} failed: {exc.line()}")
                continue
        measured = {"step_time_s": float(m["step_time_s"]), "tokens_per_s": float(m["tokens_per_s"]),
                    "peak_memory_gb": float(m["peak_memory_gb"])}
        trial.set_user_attr("measured", measured)
        st.tell(trial, measured["tokens_per_s"])
    return _finish(run, st, plans, model, c, train, k=k, steps=steps, warmup=warmup, url=url)


def _open(storage: Any, name: str, key: str, label: str, run: Path, k: int, wait_s: float, url: str,
          picks: tuple[int, ...] = ()) -> Any:
    """Create the runs study and enqueue this worker's top K (or `picks`), or wait for its creator to have done it."""
    import optuna
    where = f" in {safe_url(url)}" if url else ""
    plans = _plans(run, k, picks)
    try:
        st = optuna.create_study(storage=storage, study_name=name, direction="maximize")
    except optuna.exceptions.DuplicatedStudyError:
        deadline = time.monotonic() + wait_s
        while True:
            sid = storage.get_study_id_from_name(name)
            if storage.get_study_user_attrs(sid).get("ready"):
                break
            if time.monotonic() > deadline:
                raise SpecError("--study", f"study {name!r}{where} has no plans after {wait_s:g} s (its creator "
                                "stopped while enqueuing them?)",
                                f"delete it (optuna delete-study --study-name {name} --storage URL) and start again")
            time.sleep(0.5)
        check_study(storage, name, key, label, where)
        return optuna.load_study(study_name=name, storage=storage)
    st.set_user_attr(INPUTS_ATTR, {"key": key, "label": label})
    st.set_user_attr("plans", plans)
    for i, p in enumerate(plans):
        st.enqueue_trial({"plan": i}, user_attrs={"description": p["description"]})
    st.set_user_attr("ready", True)
    return st


def _plans(run: Path, k: int, picks: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    """The top k plans of run/trials.csv (or the ranking's positions `picks`) with their
    predictions, as the study records them."""
    from planner.cost import estimate
    top = top_plans(run / "trials.csv", k, picks)
    if not top:
        raise SpecError("--refine", "trials.csv has no feasible plan to run", "fix the search inputs first")
    _, model, cluster, train, _ = load_run(run)
    plans = []
    for _, plan, _ in top:
        e = estimate(model, cluster, train, plan)
        plans.append({"plan": plan.to_dict(), "description": plan.describe(),
                      "predicted": {"step_time_s": e.step_time_s, "tokens_per_s": e.tokens_per_s,
                                    "peak_memory_gb": e.peak_memory_gb}})
    return plans


def _pop(storage: Any, sid: int) -> int | None:
    """Move one WAITING trial to RUNNING; the storage lets exactly one caller do so."""
    import optuna
    for t in storage.get_all_trials(sid, deepcopy=False, states=(optuna.trial.TrialState.WAITING,)):
        tid = storage.get_trial_id_from_study_id_trial_number(sid, t.number)
        try:
            if storage.set_trial_state_values(tid, state=optuna.trial.TrialState.RUNNING):
                storage.record_heartbeat(tid)
                return tid
        except optuna.exceptions.UpdateFinishedTrialError:
            continue
    return None


class _Heartbeat:
    """Record the trial's heartbeat every heartbeat interval while the run lasts."""

    def __init__(self, storage: Any, trial_id: int) -> None:
        self.storage, self.trial_id, self.stop = storage, trial_id, threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)

    def _beat(self) -> None:
        interval = self.storage.get_heartbeat_interval() or 30
        while not self.stop.wait(interval):
            try:
                self.storage.record_heartbeat(self.trial_id)
            except Exception:   # a database blip: beat again next time; a long one makes the trial stale
                continue

    def __enter__(self) -> "_Heartbeat":
        self.thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.stop.set()
        self.thread.join()


def retried_trial(trial: Any) -> int | None:
    """The number of the trial this one retries (None: an original)."""
    import optuna
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.storages.RetryHeartbeatStaleTrialCallback.retried_trial_number(trial)


def _finish(run: Path, st: Any, plans: list[dict[str, Any]], model: Any, c: Any, train: Any, *, k: int, steps: int,
            warmup: int, url: str) -> dict[str, Any]:
    import optuna
    S = optuna.trial.TrialState
    runs, failures, rows = [], [], []
    for t in st.get_trials(deepcopy=False):
        a = t.user_attrs
        retry_of = retried_trial(t)
        rows.append({"trial": t.number, "state": t.state.name, "plan": t.params.get("plan"),
                     "host": a.get("host"), "worker": a.get("worker"), "retry_of": retry_of,
                     "tokens_per_s": t.value if t.state == S.COMPLETE else None, "error": a.get("error")})
        if t.state == S.COMPLETE:
            m = a["measured"]
            runs.append(MeasuredRun(path=a.get("run_dir", ""), model=model, cluster=c, train=train,
                                    plan=Plan.from_dict(a["plan"]), step_time_s=m["step_time_s"],
                                    peak_memory_gb=m["peak_memory_gb"]))
        elif t.state == S.FAIL and a.get("error"):
            failures.append({"trial": t.number, "plan": a.get("description"), "error": a["error"]})
    done = [t for t in st.get_trials(deepcopy=False, states=(S.COMPLETE,))]
    best = max(done, key=lambda t: t.value) if done else None
    extra = {"study": st.study_name, "storage": safe_url(url) if url else "", "trials": rows,
             "best_measured": None if best is None else {
                 "trial": best.number, "plan": best.params["plan"], "description": best.user_attrs["description"],
                 "tokens_per_s": best.value, "host": best.user_attrs.get("host")}}
    return finish(run, runs, failures, k=k, steps=steps, warmup=warmup, device=c.device, extra=extra)


__all__ = ["RUNS_SUFFIX", "refine_shared", "retried_trial", "runs_key", "runs_study_name"]
