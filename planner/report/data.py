"""Read a run directory (planner/rundir.py) into what the report draws.

plan.json and estimate.json are required: without them there is nothing to explain, and the
error says which `planner` command writes them. Everything else (trials.csv, study.db,
metrics.json, verify.json, ds_config.json, launch.sh) is optional; a missing file leaves its
section out with a note, and an unreadable one becomes a note naming the file, never a crash.
"""
from __future__ import annotations

import dataclasses
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from planner.errors import SpecError
from planner.rundir import RunSpecs, load_run, read_json
from planner.specs import Plan

PLAN_FIELDS = [f.name for f in dataclasses.fields(Plan)]
TUPLE_FIELDS = ("stage_layers", "recompute_layers")
BOOL_FIELDS = ("sequence_parallel", "overlap_comm", "feasible")


@dataclass(frozen=True, slots=True, kw_only=True)
class StudyData:
    """What the report shows of the Optuna study."""

    name: str
    direction: str
    history: pd.DataFrame
    """number, state, value (complete trials have a value), feasible (user attribute)."""
    importances: dict[str, float]
    """Parameter -> importance (optuna.importance, default evaluator); empty when not computable."""
    importance_note: str = ""
    """Why importances are missing, when they are."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunData(RunSpecs):
    estimate: dict[str, Any]
    """estimate.json "estimate" (Estimate.to_json) of the chosen plan."""
    baseline: dict[str, Any] | None
    """estimate.json "baseline": {"plan", "estimate"} or {"plan", "fits": false, "needs_gb"}."""
    search: dict[str, Any] = field(default_factory=dict)
    """estimate.json "search" (method, trials, space_size, wall_s, study_name), when written."""
    top: tuple[dict[str, Any], ...] = ()
    """estimate.json "top": [{"plan", "description", "estimate"}], when written."""
    trials: pd.DataFrame | None = None
    study: StudyData | None = None
    metrics: dict[str, Any] | None = None
    verify: dict[str, Any] | None = None
    ds_config: dict[str, Any] | None = None
    launch: str | None = None
    notes: tuple[str, ...] = ()
    """Problems with optional files, shown on the page."""
    files: dict[str, bool] = field(default_factory=dict)
    """Which run-directory files exist."""
    variant: dict[str, Any] | None = None
    """estimate.json "variant_comparison" (planner.search.outputs.variant_section): the plan for
    the base model beside the model variant, when the run is of a variant."""
    bill: dict[str, Any] | None = None
    """estimate.json "bill" (planner/search/bill.py): days and cost to train --tokens, on-demand and spot."""


def _optional_json(path: Path, notes: list[str]) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        notes.append(f"{path.name} could not be read ({exc}); its section is left out.")
        return None
    if not isinstance(data, dict):
        notes.append(f"{path.name} is not a JSON object; its section is left out.")
        return None
    return data


def _to_bool(series: pd.Series) -> pd.Series:
    return series.map(lambda v: v is True or str(v).strip().lower() in ("true", "1", "yes"))


def read_trials(path: Path) -> pd.DataFrame:
    """trials.csv as a frame: numeric columns as floats, booleans as bool, tuples as text."""
    df = pd.read_csv(path, dtype={f: "string" for f in TUPLE_FIELDS + ("reason", "reason_code", "source")},
                     keep_default_na=True)
    missing = [c for c in ("trial", "feasible", "tokens_per_s", "peak_memory_gb") if c not in df.columns]
    if missing:
        raise ValueError(f"missing column(s) {', '.join(missing)}")
    for col in BOOL_FIELDS:
        if col in df.columns:
            df[col] = _to_bool(df[col])
    for col in TUPLE_FIELDS + ("reason", "reason_code", "source"):
        if col in df.columns:
            df[col] = df[col].fillna("").astype(str)
    return df


def read_study(path: Path, name: str | None = None) -> StudyData:
    """The Optuna study in study.db: `name` (estimate.json search.study_name) when it is
    there, else the one with most trials."""
    import optuna
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # Open read-only in spirit: skip table creation and the schema upgrade check, so that
    # rendering never writes to a study a search may still be using.
    storage = optuna.storages.RDBStorage(f"sqlite:///{path.resolve()}", skip_compatibility_check=True,
                                         skip_table_creation=True)
    try:
        names = optuna.get_all_study_names(storage)     # summaries would read every trial once more
        if not names:
            raise ValueError("holds no study")
        if name not in names:
            name = names[0] if len(names) == 1 else max(names, key=lambda n: storage.get_n_trials(storage.get_study_id_from_name(n)))
        study = optuna.load_study(study_name=name, storage=storage)
        trials = study.get_trials(deepcopy=False)
        direction = "maximize" if study.directions[0] == optuna.study.StudyDirection.MAXIMIZE else "minimize"
        history = pd.DataFrame({
            "number": [t.number for t in trials],
            "state": [t.state.name for t in trials],
            "value": [t.values[0] if t.values else math.nan for t in trials],
            "feasible": [bool(t.user_attrs.get("feasible", True)) for t in trials],
        })
        importances, note = _importances(study, trials)
        return StudyData(name=name, direction=direction, history=history,
                         importances=importances, importance_note=note)
    finally:
        storage.remove_session()
        storage.engine.dispose()


MIN_TRIALS_FOR_IMPORTANCE = 10
"""Fewer complete trials than this give importances that are noise; the page says so."""


def _importances(study: Any, trials: list[Any]) -> tuple[dict[str, float], str]:
    import optuna
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE and t.values]
    if len(complete) < MIN_TRIALS_FOR_IMPORTANCE:
        return {}, (f"only {len(complete)} complete trial(s); parameter importances need at least "
                    f"{MIN_TRIALS_FOR_IMPORTANCE}")
    if len({t.values[0] for t in complete}) < 2:
        return {}, "every trial has the same objective value, so no parameter explains a difference"
    try:
        with warnings.catch_warnings():   # "some regimes have < 2 trials": said in the caption instead
            warnings.simplefilter("ignore")
            imp = optuna.importance.get_param_importances(study)
    except (RuntimeError, ValueError) as exc:
        return {}, f"optuna could not compute importances: {exc}"
    if not imp:
        return {}, "no parameter was sampled in every trial (a conditional space), so none can be ranked"
    return {k: float(v) for k, v in imp.items()}, ""


def _of_this_plan(doc: dict[str, Any] | None, plan_doc: Any, plan: Plan, name: str,
                  notes: list[str]) -> dict[str, Any] | None:
    """`doc` (metrics.json, verify.json) when it measured `plan`, else None and a note: a run
    directory re-planned after a run still holding the old measurements must not show them as
    this plan's (planner search and estimate --write move them to previous/ since issue 10)."""
    if doc is None or plan_doc is None:
        return doc
    try:
        measured = Plan.from_dict(plan_doc)
    except Exception:  # unreadable plan section: it cannot be shown as this plan's either
        measured = None
    if measured == plan:
        return doc
    what = measured.describe() if measured is not None else "an unreadable plan"
    notes.append(f"{name} measured another plan ({what}), not this one: its figures are left out; "
                 f"re-run `planner run` / `planner verify` for this plan.")
    return None


def load(run_dir: str | Path) -> RunData:
    """Read everything the report needs from a run directory."""
    run = Path(run_dir)
    if not run.is_dir():
        raise SpecError("RUN_DIR", f"{run} is not a directory", "give a run directory written by `planner search`")
    plan, model, cluster, train, doc = load_run(run)
    est_doc = read_json(run / "estimate.json", "estimate.json")
    if not isinstance(est_doc, dict) or not isinstance(est_doc.get("estimate"), dict):
        raise SpecError(str(run / "estimate.json"), "has no \"estimate\" section", "re-run `planner search`")
    for key in ("step_time_s", "tokens_per_s", "peak_memory_gb", "capacity_gb"):
        if not isinstance(est_doc["estimate"].get(key), (int, float)):
            raise SpecError(str(run / "estimate.json"), f"estimate.{key} is missing or not a number",
                            "re-run `planner search`")
    notes: list[str] = []
    trials = None
    if (run / "trials.csv").exists():
        try:
            trials = read_trials(run / "trials.csv")
        except (OSError, ValueError, pd.errors.ParserError) as exc:
            notes.append(f"trials.csv could not be read ({exc}); plots of all trials are left out.")
    search = est_doc.get("search") if isinstance(est_doc.get("search"), dict) else {}
    top = tuple(t for t in est_doc.get("top", []) if isinstance(t, dict)) if isinstance(est_doc.get("top"), list) else ()
    study = None
    if (run / "study.db").exists():
        try:
            study = read_study(run / "study.db", search.get("study_name"))
        except Exception as exc:  # sqlalchemy/optuna raise many types for a damaged or foreign file
            notes.append(f"study.db could not be read as an Optuna study ({type(exc).__name__}: {exc}); "
                         "its plots are left out.")
    launch = None
    if (run / "launch.sh").exists():
        try:
            launch = (run / "launch.sh").read_text()
        except (OSError, UnicodeDecodeError) as exc:
            notes.append(f"launch.sh could not be read ({exc}).")
    files = {n: (run / n).exists() for n in ("plan.json", "estimate.json", "ds_config.json", "launch.sh",
                                             "hostfile", "trials.csv", "study.db", "metrics.json", "verify.json")}
    baseline = est_doc.get("baseline") if isinstance(est_doc.get("baseline"), dict) else None
    variant = est_doc.get("variant_comparison")
    variant = variant if isinstance(variant, dict) and isinstance(variant.get("rows"), list) else None
    metrics = _optional_json(run / "metrics.json", notes)
    metrics = _of_this_plan(metrics, (metrics or {}).get("plan"), plan, "metrics.json", notes)
    if metrics is not None and metrics.get("status") == "ok" and (metrics.get("version") or 1) < 2:
        notes.append("metrics.json is version 1 (an older planner): no allocated peak and its \"optimizer\" model "
                     "states include the buckets; regenerate it with `planner run RUN_DIR`.")
    verify = _optional_json(run / "verify.json", notes)
    planned = (verify or {}).get("planned")
    verify = _of_this_plan(verify, planned.get("plan") if isinstance(planned, dict) else None, plan, "verify.json",
                           notes)
    return RunData(run_dir=run, plan=plan, model=model, cluster=cluster, train=train, doc=doc,
                   estimate=est_doc["estimate"], baseline=baseline, search=search, top=top, trials=trials, study=study,
                   metrics=metrics, verify=verify,
                   ds_config=_optional_json(run / "ds_config.json", notes), launch=launch, notes=tuple(notes),
                   files=files, variant=variant,
                   bill=est_doc["bill"] if isinstance(est_doc.get("bill"), dict) else None)


__all__ = ["RunData", "StudyData", "load", "read_study", "read_trials"]
