"""`planner search` writes a complete run directory that DeepSpeed's own parser accepts."""
from __future__ import annotations

import csv
import json
import os

import pytest

from planner.cli import main
from planner.rundir import load_run
from planner.search.trials import COLUMNS

os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("reports")
    rc = main(["search", "--model", "chatglm3-6b", "--scale", "tiny", "--gpus", "2xcpu", "--out-dir", str(out),
               "--name", "tiny", "--exhaustive"])
    assert rc == 0
    return out / "tiny"


def test_run_directory_files(cpu_run):
    names = {p.name for p in cpu_run.iterdir()}
    assert {"plan.json", "estimate.json", "ds_config.json", "launch.sh", "trials.csv"} <= names
    assert not [n for n in names if n.endswith(".tmp") or ".tmp-" in n]
    plan, model, cluster, train, doc = load_run(cpu_run)
    assert plan.global_batch == train.global_batch and plan.world_size == cluster.world_size
    assert doc["inputs"]["scale"] == "tiny" and "planner search" in doc["inputs"]["command"]
    est = json.loads((cpu_run / "estimate.json").read_text())
    assert est["estimate"]["feasible"] and est["plan"] == plan.to_dict()
    assert "estimate" in est["baseline"] or est["baseline"]["fits"] is False
    # exhaustive: one row per point of the space; "trials" counts distinct plans (two points can
    # complete into one plan: full recompute that checkpoints no block is the no-recompute plan)
    assert est["search"]["method"] == "exhaustive" and est["search"]["rows"] == est["search"]["space_size"]
    assert est["search"]["trials"] == len({json.dumps(t) for t in _plans(cpu_run)}) < est["search"]["rows"]
    assert os.access(cpu_run / "launch.sh", os.X_OK)


def _plans(run_dir):
    from planner.search.trials import PLAN_FIELDS
    with open(run_dir / "trials.csv") as fh:
        return [[r[f] for f in PLAN_FIELDS] for r in csv.DictReader(fh) if r["source"] != "baseline"]


def test_trials_csv_follows_the_contract(cpu_run):
    with open(cpu_run / "trials.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0].keys()) == COLUMNS
    est = json.loads((cpu_run / "estimate.json").read_text())
    assert len(rows) == est["search"]["rows"] + 1 and rows[-1]["source"] == "baseline"
    assert {r["source"] for r in rows[:-1]} == {"exhaustive"}
    best = max((r for r in rows if r["feasible"] == "True"), key=lambda r: float(r["tokens_per_s"]))
    assert float(best["tokens_per_s"]) == pytest.approx(est["estimate"]["tokens_per_s"])
    for r in rows:
        assert r["feasible"] == "True" or r["reason"]


def test_deepspeed_parses_ds_config(cpu_run):
    deepspeed = pytest.importorskip("deepspeed")
    import torch.distributed as dist
    from deepspeed.runtime.config import DeepSpeedConfig
    plan, *_ = load_run(cpu_run)
    cfg = json.loads((cpu_run / "ds_config.json").read_text())
    created = False
    if not dist.is_initialized():   # the parser asks torch.distributed for the rank first
        store = dist.FileStore(str(cpu_run / ".pg-store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        created = True
    try:
        deepspeed.init_distributed(dist_backend="gloo")

        class Mpu:   # the plan's DP degree, as DeepSpeed asks an mpu for it
            def get_data_parallel_world_size(self):
                return plan.dp

        parsed = DeepSpeedConfig(cfg, mpu=Mpu())
    finally:
        if created:
            dist.destroy_process_group()
    assert parsed.train_batch_size == plan.global_batch
    assert parsed.train_micro_batch_size_per_gpu == plan.micro_batch
    assert parsed.gradient_accumulation_steps == plan.grad_accum
    assert parsed.zero_optimization_stage == plan.zero


def test_multi_node_run_has_a_hostfile_and_a_study(tmp_path):
    rc = main(["search", "--model", "glm-10b", "--gpus", "2x8xA100", "--global-batch", "256", "--seq-len", "1024",
               "--out-dir", str(tmp_path), "--trials", "12"])
    assert rc == 0
    run = tmp_path / "glm-10b_2x8xA100"
    assert (run / "hostfile").exists() and (run / "study.db").exists()
    import optuna
    names = optuna.get_all_study_names(f"sqlite:///{run / 'study.db'}")
    assert len(names) == 1
    est = json.loads((run / "estimate.json").read_text())
    assert est["search"]["method"] == "optuna"
    assert est["top"][0]["plan"] == est["plan"]
    fronts = est["pareto_front"]
    assert fronts and all(a["tokens_per_s"] > b["tokens_per_s"] and a["peak_memory_gb"] > b["peak_memory_gb"]
                          for a, b in zip(fronts, fronts[1:]))


def test_attention_kernel_is_recorded_and_decides_selective_recompute(cpu_run, tmp_path):
    """Flash (the default) keeps no scores: selective recompute is not offered. --attention
    eager stores the softmax, so the search tries it; plan.json records the kernel."""
    _, _, _, train, _ = load_run(cpu_run)
    with open(cpu_run / "trials.csv") as fh:
        assert train.attention == "flash" and "selective" not in {r["recompute"] for r in csv.DictReader(fh)}
    rc = main(["search", "--model", "chatglm3-6b", "--scale", "tiny", "--gpus", "2xcpu", "--out-dir", str(tmp_path),
               "--name", "eager", "--exhaustive", "--attention", "eager"])
    assert rc == 0
    _, _, _, train, doc = load_run(tmp_path / "eager")
    assert train.attention == "eager" and doc["inputs"]["train"]["attention"] == "eager"
    with open(tmp_path / "eager" / "trials.csv") as fh:
        assert "selective" in {r["recompute"] for r in csv.DictReader(fh)}
