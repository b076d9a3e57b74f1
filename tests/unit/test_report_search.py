"""The report renders what the real `planner search` writes (not only the sample fixture), and
the sample fixture writes exactly what `planner search` writes, so it cannot drift again (it
once kept its own plan space, DeepSpeed config and Optuna parameter names)."""
from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest

from planner.cli import main
from planner.report.data import load
from planner.report.sample import write_sample_run

TRIALS = 40


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("real")
    assert main(["search", "--model", "glm-10b", "--gpus", "8xA100", "--trials", str(TRIALS),
                 "--out-dir", str(out), "--name", "g"]) == 0
    return out / "g"


def test_real_search_output_renders_completely(real: Path, capsys) -> None:
    capsys.readouterr()
    assert (real / "report.html").exists(), "planner search did not write the report"
    run = load(real)
    assert run.trials is not None and len(run.trials) >= TRIALS and run.study is not None and not run.notes
    html = (real / "report.html").read_text()
    ids = set(re.findall(r'<img src="data:image/png;base64,[^"]+" alt="[^"]*" id="img-([a-z]+)"', html))
    assert {"frontier", "memory", "time", "gantt", "history", "importances", "cluster"} <= ids
    assert "could not be drawn" not in html and 'class="note"' not in html
    assert run.plan.describe() in html and "planner search --model glm-10b" in html


def _study(path: Path) -> tuple[list[dict], list[dict], list[dict], list[float]]:
    import optuna
    storage = optuna.storages.RDBStorage(f"sqlite:///{path}")
    try:
        (summary,) = optuna.get_all_study_summaries(storage)
        trials = optuna.load_study(study_name=summary.study_name, storage=storage).get_trials()
    finally:
        storage.engine.dispose()
    dists = [{k: repr(v) for k, v in t.distributions.items()} for t in trials]
    return [t.params for t in trials], dists, [t.user_attrs for t in trials], [t.system_attrs for t in trials]


def _keys(x, prefix: str = "") -> set[str]:
    """Every key path of a JSON document (list items share their parent's path)."""
    if isinstance(x, dict):
        return {f"{prefix}.{k}" for k in x} | {p for k, v in x.items() for p in _keys(v, f"{prefix}.{k}")}
    if isinstance(x, list):
        return {p for v in x for p in _keys(v, prefix + "[]")}
    return set()


def test_sample_writes_what_planner_search_writes(real: Path, tmp_path: Path) -> None:
    """Same inputs as the real search above (glm-10b, 8xA100, planner's defaults: global batch
    512, seq 1024, bf16, Optuna seed 0): the sample must write the same run directory."""
    sample = write_sample_run(tmp_path / "s", model="glm-10b", gpus="8xA100", global_batch=512, seq_len=1024,
                              study_trials=TRIALS, seed=0)
    # the Optuna study: parameter names, their choices, what each trial records
    params, dists, attrs, system = _study(real / "study.db")
    s_params, s_dists, s_attrs, s_system = _study(sample / "study.db")
    assert {k for p in params for k in p} == {"layout", "recompute"}      # planner/search/optuna_search.py
    assert s_params == params and s_dists == dists and s_attrs == attrs and s_system == system
    # trials.csv, the plan, the DeepSpeed config and the launch script, byte for byte
    rows = list(csv.reader((real / "trials.csv").open()))
    assert list(csv.reader((sample / "trials.csv").open())) == rows and len(rows) > TRIALS
    for name in ("ds_config.json", "launch.sh"):
        assert (sample / name).read_text().replace(str(sample), "RUN") == \
            (real / name).read_text().replace(str(real), "RUN"), name
    doc, s_doc = (json.loads((d / "plan.json").read_text()) for d in (real, sample))
    assert s_doc["plan"] == doc["plan"] and s_doc["inputs"]["model"] == doc["inputs"]["model"]
    assert s_doc["inputs"]["train"] == doc["inputs"]["train"] and s_doc["inputs"]["cluster"] == doc["inputs"]["cluster"]
    est, s_est = (json.loads((d / "estimate.json").read_text()) for d in (real, sample))
    assert _keys(s_est) == _keys(est) and s_est["estimate"] == est["estimate"] and s_est["top"] == est["top"]
