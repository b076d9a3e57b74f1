"""`planner run` / `planner verify` refuse what cannot run here before any rank starts
(planner/runtime/preflight/checks.py): one line naming the field and the fix, exit 2, and the run
directory untouched (no .ranks/, no logs/, no metrics.json). No DeepSpeed process is started:
subprocess.Popen in the launcher is replaced by a function that fails the test."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from planner import dsconfig
from planner.cli import main
from planner.cost import estimate
from planner.errors import ExecutionError, PlannerError, SpecError
from planner.runtime.train import launch
from planner.runtime.preflight import checks as preflight
from planner.runtime.files import RANKS_DIR
from planner.runtime.preflight.checks import HOST_MEMORY_FRACTION, RANKS_PER_CORE, Host
from planner.rundir import atomic_write_json, plan_document
from planner.specs import Plan, TrainSpec, parse_cluster, preset, scale
from planner.specs.estimate import GB
from planner.specs.validate import vocab_problem

CPU_HOST = Host(cores=2, mem_available_bytes=20e9, cuda_note="torch 2.13.0+cpu is built without CUDA")


def write_run(d: Path, plan: Plan, *, model: str = "chatglm3-6b", size: str | None = "tiny", gpus: str = "2xcpu",
              global_batch: int = 8, seq_len: int = 128, spec=None, precision: str = "bf16") -> Path:
    spec = spec or scale(preset(model), size)
    cluster = parse_cluster(gpus)
    train = TrainSpec(global_batch=global_batch, seq_len=seq_len, precision=precision)
    atomic_write_json(d / "plan.json", plan_document(plan, spec, cluster, train, scale=size, model_arg=model,
                                                     command="test"))
    atomic_write_json(d / "ds_config.json", dsconfig.ds_config(plan, spec, train, cluster))
    return d


def tiny(d: Path, **kw) -> Path:
    """chatglm3-6b tiny (4 heads, 2 KV groups, vocab 1024, 4 layers) on 2xcpu: legal as written."""
    return write_run(d, Plan(dp=2, micro_batch=1, grad_accum=4, **kw))


@pytest.fixture
def no_launch(monkeypatch, tmp_path_factory):
    """Fail the test if the launcher tries to start a rank; the host is a 2-core CPU host, and
    its torch-extensions cache an empty one (no build lock of this machine's decides a test)."""
    def popen(*a, **k):
        raise AssertionError("a rank was started")
    monkeypatch.setattr(launch.subprocess, "Popen", popen)
    monkeypatch.setattr(preflight, "probe_host", lambda gpu: CPU_HOST)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path_factory.mktemp("torch-extensions")))


def untouched(d: Path, before: dict[str, str]) -> None:
    assert not (d / RANKS_DIR).exists() and not (d / "logs").exists() and not (d / "metrics.json").exists()
    assert {p.name: p.read_text() for p in d.iterdir()} == before


def refuse(d: Path, exc: type[PlannerError] = SpecError, **kw) -> str:
    before = {p.name: p.read_text() for p in d.iterdir()}
    with pytest.raises(exc) as info:
        launch.run_plan(d, steps=3, warmup=1, **kw)
    untouched(d, before)
    line = info.value.line()
    assert "\n" not in line and "(fix: " in line
    return line


def edit(path: Path, fn) -> None:
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


# --- ds_config.json against plan.json -----------------------------------------------------------

@pytest.mark.parametrize("change, field, says", [
    (lambda c: c.update(train_micro_batch_size_per_gpu=2), "train_micro_batch_size_per_gpu", "is 2, plan.json has micro_batch 1"),
    (lambda c: c.update(gradient_accumulation_steps=2), "gradient_accumulation_steps", "is 2, plan.json has grad_accum 4"),
    # 16 = 1 x 4 x DP 4, the plan runs DP 2
    (lambda c: c.update(train_batch_size=16), "train_batch_size", "micro-batch 1 x accumulation 4 x DP 4, but plan.json has DP 2"),
    (lambda c: c.update(train_batch_size=10), "train_batch_size", "x no whole DP degree"),
    # DeepSpeed derives the micro-batch from the other two: 16 // 2 // 4 = 2
    (lambda c: (c.pop("train_micro_batch_size_per_gpu"), c.update(train_batch_size=16)),
     "train_micro_batch_size_per_gpu", "is 2"),
    (lambda c: c.update(train_micro_batch_size_per_gpu="auto"), "train_micro_batch_size_per_gpu", "positive integer"),
    (lambda c: c["zero_optimization"].update(stage=2), "zero_optimization.stage", "is 2, plan.json has zero 0"),
    (lambda c: c.pop("zero_optimization"), None, None),        # absent: DeepSpeed's ZeRO-0, the plan's
    (lambda c: c["bf16"].update(enabled=False), "bf16.enabled/fp16.enabled", "neither is enabled (fp32), plan.json has precision bf16"),
    (lambda c: c["fp16"].update(enabled=True), "bf16.enabled/fp16.enabled", "both are enabled"),
    (lambda c: c.update(pipeline={"stages": 2}), "pipeline.stages", "is 2, plan.json has pp 1"),
    (lambda c: c.update(tensor_parallel={"autotp_size": 2}), "tensor_parallel", "AutoTP is not what the plan runs"),
])
def test_config_that_disagrees_with_the_plan_is_named(tmp_path, no_launch, change, field, says) -> None:
    d = tiny(tmp_path)
    edit(d / "ds_config.json", change)
    if field is None:
        launch.preflight.check(d, *_load(d), host=CPU_HOST)     # nothing to refuse
        return
    line = refuse(d)
    assert line.startswith(f"ds_config.json {field}: ") and says in line, line
    assert "delete" in line                                     # the fix says how to re-write it


def _load(d: Path):
    from planner.rundir import load_run
    return load_run(d)


def test_pipeline_split_and_stages_are_compared(tmp_path, no_launch) -> None:
    d = write_run(tmp_path, Plan(dp=1, pp=2, micro_batch=1, grad_accum=8, stage_layers=(3, 1)))
    assert json.loads((d / "ds_config.json").read_text())["pipeline"]["stage_layers"] == [3, 1]
    preflight.check(d, *_load(d), host=CPU_HOST)                # as written: consistent
    edit(d / "ds_config.json", lambda c: c["pipeline"].update(stage_layers=[2, 2]))
    assert "pipeline.stage_layers: is [2, 2], plan.json splits the 4 blocks [3, 1]" in refuse(d)
    edit(d / "ds_config.json", lambda c: c["pipeline"].update(stages=4, stage_layers=[3, 1]))
    assert "pipeline.stages: is 4, plan.json has pp 2" in refuse(d)
    edit(d / "ds_config.json", lambda c: c.pop("pipeline"))
    assert "pipeline.stages: is None, plan.json has pp 2" in refuse(d)


def test_a_missing_config_is_written_only_after_the_checks(tmp_path, no_launch, monkeypatch) -> None:
    d = tiny(tmp_path)
    (d / "ds_config.json").unlink()
    monkeypatch.setattr(preflight, "probe_host", lambda gpu: dataclasses.replace(CPU_HOST, cores=0))
    assert "ranks per core" in refuse(d, ExecutionError)
    assert not (d / "ds_config.json").exists()


# --- plan.json itself ---------------------------------------------------------------------------

def test_tp_that_divides_no_kv_groups_is_refused(tmp_path, no_launch) -> None:
    d = write_run(tmp_path, Plan(dp=1, tp=4, micro_batch=1, grad_accum=8), gpus="4xcpu")
    assert refuse(d).startswith("plan.json plan.tp: tp 4 does not divide the 2 KV groups")


def test_world_size_that_does_not_match_the_cluster(tmp_path, no_launch) -> None:
    d = tiny(tmp_path)
    edit(d / "plan.json", lambda doc: doc["plan"].update(dp=4, grad_accum=2))
    line = refuse(d)
    assert line.startswith("plan.json plan.dp/tp/pp: dp 4 x tp 1 x pp 1 = 4 processes, but the cluster has 2")


@pytest.mark.parametrize("vocab, ok", [(3, False), (4, True), (9, False), (10, True), (1024, True)])
def test_vocabulary_every_tp_rank_holds_real_rows_of(vocab, ok) -> None:
    # TP 4: V_pad/4 rows per rank; the last rank starts at 3 x ceil(V/4), which must be < V.
    # V 9: rows 3, last rank 9-11 all padding; V 10: last rank holds token 9; V 3: rank 3 only padding
    m = dataclasses.replace(scale(preset("glm-10b"), "tiny"), vocab=vocab)
    problem = vocab_problem(m, 4)
    assert (problem is None) is ok
    if vocab == 9:
        assert problem.field == "plan.tp" and problem.code == "tp-vocab"
        assert problem.message == ("tp 4 cannot split the vocabulary of 9 tokens: padded to 12, 3 row(s) per TP rank, "
                                   "only 3 of the 4 ranks would hold real tokens")


def test_vocabulary_tp_cannot_split_stops_the_run(tmp_path, no_launch) -> None:
    spec = dataclasses.replace(scale(preset("glm-10b"), "tiny"), vocab=9)
    d = write_run(tmp_path, Plan(dp=1, tp=4, micro_batch=1, grad_accum=8), spec=spec, gpus="4xcpu")
    assert refuse(d).startswith("plan.json plan.tp: tp 4 cannot split the vocabulary of 9 tokens")


def test_multi_node_stays_refused(tmp_path, no_launch) -> None:
    d = write_run(tmp_path, Plan(dp=4, micro_batch=1, grad_accum=2), gpus="2x2xcpu")
    assert "2 nodes: `planner run` launches on this machine only" in refuse(d, ExecutionError)


# --- this host ----------------------------------------------------------------------------------

def gpu_run(d: Path) -> Path:
    """glm-10b on 8xA100 (80 GB): TP 2 x DP 4, ZeRO-1, predicted to need between 40 and 80 GB per GPU."""
    return write_run(d, Plan(dp=4, tp=2, zero=1, micro_batch=1, grad_accum=128),
                     model="glm-10b", size=None, gpus="8xA100", global_batch=512, seq_len=1024)


def _gpu_peak(d: Path) -> float:
    plan, model, cluster, train, _ = _load(d)
    return estimate(model, cluster, train, plan).peak_memory_bytes


def test_gpu_plan_on_a_host_without_cuda(tmp_path, no_launch) -> None:
    d = gpu_run(tmp_path)
    line = refuse(d, ExecutionError)
    assert line.startswith(f"plan.json cluster: plan needs 8 CUDA device(s) with {_gpu_peak(d) / GB:.1f} GB each "
                           "(predicted peak on A100-80GB), this host has none (torch 2.13.0+cpu is built without CUDA)")
    assert "`planner search --model glm-10b --gpus 2xcpu --scale tiny`" in line


@pytest.mark.parametrize("devices, says", [
    ([("NVIDIA H200", 141e9)], "this host has 1 (NVIDIA H200)"),
    ([("NVIDIA A100-SXM4-40GB", 40e9)] * 8, "CUDA device 0 (NVIDIA A100-SXM4-40GB) has 40.0 GB"),
    ([("NVIDIA A100-SXM4-80GB", 80e9)] * 7 + [("small", 16e9)], "CUDA device 7 (small) has 16.0 GB"),
    ([("NVIDIA A100-SXM4-80GB", 80e9)] * 8, None),
])
def test_gpu_count_and_memory(tmp_path, no_launch, devices, says) -> None:
    d = gpu_run(tmp_path)
    host = Host(cores=64, mem_available_bytes=1e12, cuda_devices=tuple(devices))
    if says is None:
        assert 40e9 < _gpu_peak(d) < 80e9                    # the checks below are not vacuous
        preflight.check(d, *_load(d), host=host)
        return
    with pytest.raises(ExecutionError, match=says.replace("(", r"\(").replace(")", r"\)")):
        preflight.check(d, *_load(d), host=host)


def test_ranks_per_core(tmp_path, no_launch) -> None:
    n = RANKS_PER_CORE * 2
    ok = write_run(tmp_path / "ok", Plan(dp=n, micro_batch=1, grad_accum=1), gpus=f"{n}xcpu", global_batch=n)
    preflight.check(ok, *_load(ok), host=CPU_HOST)
    over = write_run(tmp_path / "over", Plan(dp=n + 2, micro_batch=1, grad_accum=1), gpus=f"{n + 2}xcpu",
                     global_batch=n + 2)
    line = refuse(over, ExecutionError)
    assert line.startswith(f"plan.json dp/tp/pp: {n + 2} ranks on 2 core(s): more than {RANKS_PER_CORE} ranks per core")


def test_host_memory_margin(tmp_path, no_launch, monkeypatch) -> None:
    d = tiny(tmp_path)
    plan, model, cluster, train, doc = _load(d)
    est = estimate(model, cluster, train, plan)
    need = 2 * est.stage_memory[0].total                        # 2 ranks, one stage
    fits = need / HOST_MEMORY_FRACTION * 1.01
    preflight.check(d, plan, model, cluster, train, doc, host=dataclasses.replace(CPU_HOST, mem_available_bytes=fits))
    short = need / HOST_MEMORY_FRACTION * 0.99
    monkeypatch.setattr(preflight, "probe_host", lambda gpu: dataclasses.replace(CPU_HOST, mem_available_bytes=short))
    line = refuse(d, ExecutionError)
    assert f"2 ranks need {need / GB:.1f} GB predicted" in line and "MemAvailable" in line


def test_ignore_host_checks_skips_only_the_host(tmp_path, monkeypatch) -> None:
    d = tiny(tmp_path)
    monkeypatch.setattr(preflight, "probe_host", lambda gpu: dataclasses.replace(CPU_HOST, cores=0))
    assert preflight.check(d, *_load(d), ignore_host=True) is None
    edit(d / "ds_config.json", lambda c: c.update(gradient_accumulation_steps=2))
    with pytest.raises(SpecError, match="gradient_accumulation_steps"):
        preflight.check(d, *_load(d), ignore_host=True)


def test_real_probe_on_a_host_without_cuda() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    host = preflight.probe_host(gpu=True)
    assert host.cuda_devices == () and "CUDA" in host.cuda_note and host.cores >= 1
    assert host.mem_available_bytes is not None and host.mem_available_bytes > 0


# --- the command line ---------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["run", "verify"])
def test_cli_refuses_in_one_line(tmp_path, no_launch, capsys, command) -> None:
    d = gpu_run(tmp_path / "gpu")
    c = tiny(tmp_path / "cfg")
    edit(c / "ds_config.json", lambda cfg: cfg["zero_optimization"].update(stage=3))
    for run_dir, starts in ((d, "error: plan.json cluster: plan needs 8 CUDA device(s)"),
                            (c, "error: ds_config.json zero_optimization.stage: is 3, plan.json has zero 0")):
        before = {p.name: p.read_text() for p in run_dir.iterdir()}
        assert main([command, str(run_dir)]) == 2
        out = capsys.readouterr()
        assert out.err.startswith(starts) and out.err.count("\n") == 1 and "Traceback" not in out.err, out.err
        untouched(run_dir, before)
        assert not (run_dir / "verify").exists()


def test_cli_ignore_host_checks_reaches_the_launcher(tmp_path, no_launch, capsys, monkeypatch) -> None:
    d = tiny(tmp_path)
    monkeypatch.setattr(preflight, "probe_host", lambda gpu: dataclasses.replace(CPU_HOST, cores=0))
    assert main(["run", str(d)]) == 2
    assert "ranks per core" in capsys.readouterr().err
    assert main(["run", str(d), "--ignore-host-checks"]) == 3     # past every check: the launch itself
    assert "a rank was started" in capsys.readouterr().err
