"""The trainer's parts without a training run: the learning-rate schedule DeepSpeed runs from
our scheduler block, the progress line, the Prometheus endpoint and its alert rules and
dashboard, the launcher's progress follower, `latest`, and the refusals of bad trainer input
before any rank starts."""
from __future__ import annotations

import json
import socket
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml

from planner import dsconfig
from planner.errors import ExecutionError, SpecError
from planner.runtime.train import launch
from planner.runtime.observe import watch as observability
from planner.runtime.preflight import checks as preflight
from planner.runtime.files import RANKS_DIR
from planner.runtime.observe.watch import SERIES, alert_rules, dashboard, format_progress
from planner.runtime.observe.prom import Exporter, port_problem
from planner.runtime.train.settings import configure_lr
from planner.runtime.train.checkpoints import latest_tag

from test_run_guard import no_launch, tiny  # noqa: F401  (fixture)


def _rates(block: dict, steps: int, base: float = 3e-4) -> list[float]:
    """The rate each optimizer step uses when DeepSpeed builds `block` (its own config parser
    and scheduler classes) and steps it after every update, as the engine does."""
    from deepspeed.runtime import lr_schedules
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=base)
    sched = getattr(lr_schedules, block["type"])(opt, **block["params"])
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_cosine_schedule_rates_by_hand() -> None:
    block = dsconfig.lr_scheduler("cosine", 3e-4, 2, 5)
    assert block == {"type": "WarmupCosineLR", "params": {"total_num_steps": 5, "warmup_min_ratio": 0.0,
                                                          "warmup_num_steps": 2, "cos_min_ratio": 0.1,
                                                          "warmup_type": "linear"}}
    # step k uses iteration k-1: -1 and 0 -> 0; 1 -> 1/2; then cosine over the 3 steps after
    # warmup: 0.1 + 0.9 (1 + cos(pi p)) / 2 at p = 1/3 (0.775), 2/3 (0.325)
    assert _rates(block, 5) == pytest.approx([0.0, 0.0, 1.5e-4, 2.325e-4, 9.75e-5], rel=1e-9)
    # past the end it stays at the floor, 10% of the peak
    assert _rates(block, 9)[-1] == pytest.approx(3e-5)


def test_constant_schedule_with_and_without_warmup() -> None:
    assert _rates(dsconfig.lr_scheduler("constant", 1e-3, 0, 4), 4, base=1e-3) == [1e-3] * 4
    # warmup 4: 0, 0, 1/4, 2/4, 3/4 of the peak, then the peak
    assert _rates(dsconfig.lr_scheduler("constant", 1e-3, 4, 7), 7, base=1e-3) == pytest.approx(
        [0.0, 0.0, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    with pytest.raises(ValueError):
        dsconfig.lr_scheduler("linear", 1e-3, 0, 4)


def test_configure_lr_keeps_a_users_scheduler_unless_told(monkeypatch) -> None:
    class A:
        lr, lr_schedule, lr_warmup_steps = None, None, 0
    monkeypatch.setattr(dsconfig, "OPTIMIZER", dict(dsconfig.OPTIMIZER))
    own = {"type": "WarmupDecayLR", "params": {"total_num_steps": 9}}
    cfg = {"scheduler": dict(own)}
    info = configure_lr(cfg, A, 10)
    assert cfg["scheduler"] == own and info["source"] == "ds_config.json" and info["lr"] == 3e-4
    A.lr, A.lr_schedule = 1e-3, "cosine"
    gpu = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}, "scheduler": own}
    info = configure_lr(gpu, A, 10)
    assert gpu["optimizer"]["params"]["lr"] == 1e-3 and gpu["scheduler"]["type"] == "WarmupCosineLR"
    assert info["source"] == "flags" and gpu["scheduler"]["params"]["total_num_steps"] == 10


def test_progress_line() -> None:
    rec = {"step": 3, "total": 10, "kind": "step", "loss": 6.54321, "lr": 1.5e-4, "time_s": 0.05,
           "tokens_per_s": 5123.4, "grad_norm": 4.81, "peak_memory_bytes": 4.36e8, "eval_loss": 6.6}
    assert format_progress(rec) == ("step 3/10 | loss 6.5432 | lr 0.00015 | tokens/s 5123 | step 0.050 s | "
                                    "peak mem 0.436 GB | grad norm 4.81 | eval loss 6.6000")
    assert format_progress({"step": 4, "kind": "checkpoint", "tag": "step4"}) == "checkpoint step 4 saved (step4)"


def test_alert_rules_are_prometheus_rules_with_the_article_thresholds() -> None:
    doc = yaml.safe_load(alert_rules())
    rules = {r["alert"]: r for r in doc["groups"][0]["rules"]}
    util, lat = rules["PlannerGPUUtilizationLow"], rules["PlannerAllReduceLatencyHigh"]
    assert util["expr"] == 'planner_gpu_utilization_percent{job="planner"} < 40' and util["for"] == "5m"
    assert lat["expr"] == 'planner_allreduce_latency_seconds{job="planner"} > 0.05'
    for r in rules.values():
        assert r["labels"]["severity"] == "warning" and "{{ $labels.rank }}" in r["annotations"]["summary"]


def test_dashboard_has_a_panel_for_every_series() -> None:
    d = json.loads(json.dumps(dashboard("t")))
    exprs = {t["expr"] for p in d["panels"] for t in p["targets"]}
    assert exprs == set(SERIES) - {"planner_step", "planner_allreduce_calls"}
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)) == 9 and d["schemaVersion"] == 39
    lat = next(p for p in d["panels"] if p["targets"][0]["expr"] == "planner_allreduce_latency_seconds")
    assert lat["fieldConfig"]["defaults"]["thresholds"]["steps"][1]["value"] == 0.05


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_exporter_serves_the_series_with_rank_labels() -> None:
    from prometheus_client.parser import text_string_to_metric_families
    port = _free_port()
    ex = Exporter(port)
    try:
        assert "cannot listen" in port_problem(port)  # the bind test sees it busy
        ex.step({"step": 2, "loss": 6.5, "lr": 1e-4, "time_s": 0.5, "tokens_per_s": 1000.0, "grad_norm": 3.0,
                 "eval_loss": None},
                [{"peak_memory_bytes": 1e8, "allreduce_seconds": 0.02, "allreduce_calls": 4.0,
                  "gpu_utilization_percent": None},
                 {"peak_memory_bytes": 2e8, "allreduce_seconds": 0.0, "allreduce_calls": 0.0,
                  "gpu_utilization_percent": None}])
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        ex.close()
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert got[("planner_loss", ())] == 6.5 and got[("planner_tokens_per_second", ())] == 1000.0
    assert got[("planner_peak_memory_bytes", (("rank", "1"),))] == 2e8
    assert got[("planner_allreduce_latency_seconds", (("rank", "0"),))] == pytest.approx(0.005)
    assert got[("planner_allreduce_latency_seconds", (("rank", "1"),))] == 0.0
    assert not any(n == "planner_gpu_utilization_percent" for n, _ in got)  # CPU: no series
    assert not any(n == "planner_eval_loss" for n, _ in got)  # not evaluated yet: absent, not 0
    assert port_problem(port) == "" and port_problem(70000).startswith("70000 is not")


def test_follower_echoes_complete_lines_only(tmp_path: Path) -> None:
    p = tmp_path / "progress.jsonl"
    seen: list[str] = []
    f = launch._Follower(p, seen.append)
    f()  # no file yet
    p.write_text('{"step": 1, "kind": "checkpoint", "tag": "step1"}\n{"step": 2, "ki')
    f()
    assert seen == ["checkpoint step 1 saved (step1)"]
    with open(p, "a") as fh:
        fh.write('nd": "checkpoint", "tag": "step2"}\n')
    f()
    assert seen[-1] == "checkpoint step 2 saved (step2)" and len(seen) == 2


def test_latest_names_only_an_existing_tag(tmp_path: Path) -> None:
    assert latest_tag(tmp_path) is None
    (tmp_path / "latest").write_text("step4")
    assert latest_tag(tmp_path) is None
    (tmp_path / "step4").mkdir()
    assert latest_tag(tmp_path) == "step4"


def test_allreduce_timer_counts_calls_and_restores_nothing_else(monkeypatch) -> None:
    import torch.distributed as dist
    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, **kw: calls.append(t))
    timer = observability.AllReduceTimer().install()
    dist.all_reduce(1)
    dist.all_reduce(2, group=None)
    timer.original(3)
    secs, n = timer.take()
    assert n == 2 and secs >= 0 and calls == [1, 2, 3] and timer.take() == (0.0, 0)


@pytest.mark.parametrize("kw, field", [
    ({"lr": -1.0}, "--lr"), ({"lr": float("nan")}, "--lr"), ({"eval_every": -2}, "--eval-every"),
    ({"eval_batches": 0}, "--eval-batches"), ({"lr_schedule": "linear"}, "--lr-schedule"),
    ({"tokenizer": "tok"}, "--tokenizer"), ({"data": "/nonexistent/corpus.txt"}, "--data"),
    ({"init_hf": "/nonexistent/hf"}, "--init-hf"), ({"data_workers": -1}, "--data-workers")])
def test_bad_trainer_input_is_refused_before_any_rank(tmp_path: Path, no_launch, kw, field) -> None:  # noqa: F811
    d = tiny(tmp_path)
    before = {p.name: p.read_text() for p in d.iterdir()}
    with pytest.raises(SpecError) as info:
        launch.run_plan(d, steps=3, warmup=1, **kw)
    assert info.value.field == field and "\n" not in info.value.line()
    assert not (d / RANKS_DIR).exists() and {p.name: p.read_text() for p in d.iterdir()} == before


def test_busy_metrics_port_is_refused_before_any_rank(tmp_path: Path, no_launch) -> None:  # noqa: F811
    d = tiny(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(ExecutionError, match=f"--metrics-port: cannot listen on 127.0.0.1:{port}"):
            launch.run_plan(d, steps=3, warmup=1, metrics_port=port)
    assert not (d / RANKS_DIR).exists() and not (d / observability.ALERTS_FILE).exists()


def test_cli_busy_port_is_one_line_exit_2(tmp_path: Path, no_launch, capsys) -> None:  # noqa: F811
    from planner.cli import main
    d = tiny(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        code = main(["run", str(d), "--steps", "3", "--warmup", "1", "--metrics-port", str(s.getsockname()[1])])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "--metrics-port" in err


def test_preflight_calls_the_data_check(tmp_path: Path, no_launch, monkeypatch) -> None:  # noqa: F811
    from planner.data import batching as datamod
    seen = []

    def check(spec, layout):
        seen.append((spec.token_file, layout))
        raise SpecError("--data", "corpus too small", "more data")
    monkeypatch.setattr(datamod, "check_data", check, raising=False)
    d = tiny(tmp_path)
    corpus = tmp_path / "c.txt"
    corpus.write_text("1 2 3\n")
    with pytest.raises(SpecError, match="corpus too small"):
        launch.run_plan(d, steps=3, warmup=1, data=str(corpus))
    assert seen == [(str(corpus), datamod.Layout(1, 4, 2))]
    assert preflight  # imported for monkeypatching by the fixture


def test_loader_settings_from_plan_json_unless_flagged() -> None:
    from planner.data.loader import loader_settings
    doc = {"loader": {"workers": 3, "pin_memory": False, "prefetch_factor": 2, "produce_s": 0.01,
                      "compute_s": 0.002, "reason": "r", "starves": False}}
    s = loader_settings(doc, None, "cpu")
    assert (s.workers, s.pin_memory, s.prefetch_factor, s.produce_s, s.reason) == (3, False, 2, 0.01, "r")
    s = loader_settings(doc, 0, "cpu")
    assert (s.workers, s.prefetch_factor, s.reason) == (0, 0, "--data-workers")
    s = loader_settings({}, None, "cuda")
    assert (s.workers, s.pin_memory, s.prefetch_factor) == (1, True, 2)


def test_verify_passes_the_tokenizer_and_refuses_a_missing_one_before_the_baseline(tmp_path: Path, no_launch,  # noqa: F811
                                                                                   capsys) -> None:
    from planner.cli import main
    d = tiny(tmp_path)
    corpus = tmp_path / "c.txt"
    corpus.write_text("some text\n\nmore text\n")
    code = main(["verify", str(d), "--data", str(corpus), "--tokenizer", str(tmp_path / "no-such-tokenizer")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: --tokenizer:")
    assert not (d / "verify" / "baseline" / RANKS_DIR).exists()


def test_worker_paths_are_absolute_before_the_rank_moves_into_the_run_directory(tmp_path: Path, monkeypatch) -> None:
    """launch.sh passes the user's flags as typed; the rank later chdirs into the run directory,
    where a relative --data / --tokenizer / --init-hf / --save-hf would point elsewhere."""
    from planner.runtime.train.options import TrainerOptions
    monkeypatch.delenv("PLANNER_DUMP_GRADS", raising=False)
    monkeypatch.chdir(tmp_path)
    run, opts = TrainerOptions.from_argv(["--run-dir", "run", "--data", "data/pydoc", "--tokenizer", "data/tok",
                                          "--init-hf", "/abs/hf", "--save-hf", "out/hf"])
    assert run == Path("run")
    assert (opts.data, opts.tokenizer) == (str(tmp_path / "data/pydoc"), str(tmp_path / "data/tok"))
    assert (opts.init_hf, opts.save_hf, opts.dump_grads) == ("/abs/hf", str(tmp_path / "out/hf"), "")


def test_trainer_options_travel_to_the_worker_unchanged(monkeypatch) -> None:
    """`planner run`'s flags reach the rank as the launcher wrote them: to_argv then from_argv is
    the identity for every field (each moved off its default), and the defaults travel as no flag."""
    import dataclasses

    from planner.runtime.train.options import TrainerOptions
    monkeypatch.delenv("PLANNER_DUMP_GRADS", raising=False)
    monkeypatch.delenv("PLANNER_MEASURE_ACTIVATIONS", raising=False)
    moved = dict(steps=7, warmup=3, resume=True, batching="static", checkpoint_every=2, inject_nan=4, data="/c",
                 tokenizer="/t", eval_every=5, eval_batches=3, lr=1.5e-4, lr_warmup_steps=6, lr_schedule="cosine",
                 metrics_port=9400, metrics_host="0.0.0.0", init_hf="/i", save_hf="/s", seed=7, data_workers=0,
                 measure_activations=True, dump_grads="/g", step_sleep=0.25, save_sleep=0.5)
    assert set(moved) == {f.name for f in dataclasses.fields(TrainerOptions)}
    opts = TrainerOptions(**moved)
    run, back = TrainerOptions.from_argv(["--run-dir", "/r", *opts.to_argv()])
    assert back == opts and run == Path("/r")
    assert TrainerOptions().to_argv() == [] and TrainerOptions.from_argv(["--run-dir", "/r"])[1] == TrainerOptions()
    monkeypatch.setenv("PLANNER_MEASURE_ACTIVATIONS", "1")   # the measuring benchmarks set it for every rank
    assert TrainerOptions.from_argv(["--run-dir", "/r"])[1].measure_activations is True
