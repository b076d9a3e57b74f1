"""DeepSpeed's ZeRO variants through the CLI (issue 9): the host flags, the variant flags of
`planner estimate`, one-line errors for what cannot run, and the near-the-memory-limit flag."""
from __future__ import annotations

import json

import pytest

from planner.cli import main
from planner.cli.search import _mem_cell, _memory_lines, _plan_cells
from planner.cost import estimate as cost_estimate
from planner.report.plan_text import host_memory_text, memory_flag, short_variants
from planner.specs import Estimate, MemoryBreakdown, Plan, TimeBreakdown, TrainSpec, parse_cluster, preset

GLM10 = ["--model", "glm-10b", "--gpus", "8xA100"]


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def one_line(rc: int, err: str) -> bool:
    return rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def fake_estimate(peak_bytes: float, capacity_bytes: float = 80e9, host_bytes: float | None = None) -> Estimate:
    """An Estimate whose peak memory is `peak_bytes` (all of it parameters), nothing else."""
    kw = {} if host_bytes is None else {"host_memory_bytes": host_bytes}
    return Estimate(feasible=True, step_time_s=1.0, time=TimeBreakdown(forward=1.0), tokens_per_s=1.0,
                    tflops_per_gpu=1.0, mfu=0.5, hfu=0.5, stage_memory=(MemoryBreakdown(params=peak_bytes),),
                    capacity_bytes=capacity_bytes, bubble_fraction=0.0, **kw)


# --- the flags reach the plan and the cluster ---------------------------------------------

def test_variant_flags_set_the_plan(capsys):
    rc, out, err = run(capsys, "estimate", *GLM10, "--zero", "3", "--offload-optimizer", "cpu", "--offload-params",
                       "cpu", "--hpz", "8", "--qwz", "--qgz", "--bucket-elements", "20000000",
                       "--prefetch-elements", "10000000", "--live-elements", "30000000",
                       "--persistence-elements", "40960", "--json")
    assert rc == 0 and err == ""
    doc = json.loads(out)
    p = doc["plan"]
    assert (p["offload_optimizer"], p["offload_params"], p["hpz"]) == ("cpu", "cpu", 8)
    assert p["quantized_weights"] and p["quantized_gradients"] and p["mics_shard"] == 0
    assert (p["bucket_elements"], p["prefetch_elements"], p["live_elements"], p["persistence_elements"]) == \
        (20_000_000, 10_000_000, 30_000_000, 40960)
    assert doc["variants"] == ["optimizer offload to cpu", "parameter offload to cpu", "ZeRO++ hpZ 8",
                               "ZeRO++ qwZ", "ZeRO++ qgZ"]
    assert "ZeRO++ hpZ 8" in doc["description"] and doc["memory_headroom_gb"] > 0   # the profile's allowance
    assert doc["usable_memory_gb"] == pytest.approx(parse_cluster("8xA100").usable_bytes / 1e9)
    assert doc["host_memory_capacity_gb"] == 2048          # profiles/A100-80GB.json host block


def test_mics_and_host_flags(capsys):
    rc, out, _ = run(capsys, "estimate", *GLM10, "--zero", "3", "--mics-shard", "4", "--cpu-mem-gb", "512",
                     "--nvme-gbps", "6.5", "--memory-headroom", "2.5", "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["plan"]["mics_shard"] == 4 and doc["variants"] == ["MiCS shard 4"]
    assert doc["memory_headroom_gb"] == 2.5
    assert doc["host_memory_capacity_gb"] == 512


def test_text_output_shows_the_variants_and_the_usable_memory(capsys):
    rc, out, _ = run(capsys, "estimate", *GLM10, "--zero", "2", "--offload-optimizer", "cpu")
    assert rc == 0
    assert "optimizer offload to cpu" in out and "ZeRO variants" in out
    assert "usable memory per GPU" in out and "counted in the peak" in out


def test_text_output_shows_the_host_memory_the_estimate_gives(capsys):
    model, cluster = preset("glm-10b"), parse_cluster("8xA100")
    train = TrainSpec(global_batch=512, seq_len=1024, precision="bf16")
    plan = Plan(dp=8, zero=2, grad_accum=64, offload_optimizer="cpu")
    est = cost_estimate(model, cluster, train, plan)
    rc, out, _ = run(capsys, "estimate", *GLM10, "--zero", "2", "--offload-optimizer", "cpu")
    assert rc == 0
    per_rank = getattr(est, "host_memory_bytes", 0.0)
    if per_rank:      # the cost model gives the host memory (issue 9): per node = per rank x 8
        assert "host memory" in out and f"{per_rank * 8 / 1e9:.1f} GB per node" in out and "of 2048 GB" in out
    else:
        assert "host memory" not in out


# --- what cannot run: one line, status 2 --------------------------------------------------

@pytest.mark.parametrize("argv,needle", [
    # NVMe offload on a node without NVMe (the profile's 25 GB/s overridden to 0)
    (["--zero", "3", "--offload-optimizer", "nvme", "--nvme-gbps", "0"], "--nvme-gbps"),
    (["--zero", "3", "--offload-params", "nvme", "--nvme-gbps", "0"], "--nvme-gbps"),
    # hpZ over 3 ranks does not divide DP 8
    (["--zero", "3", "--hpz", "3"], "--hpz"),
    # hpZ over 16 ranks divides DP 16 but not the 8 ranks of a node
    (["--gpus", "2x8xA100", "--zero", "3", "--hpz", "16"], "hpz"),
    # MiCS shard of 3 does not divide DP 8
    (["--zero", "3", "--mics-shard", "3"], "--mics-shard"),
    # offload on ZeRO-0, NVMe optimizer offload on ZeRO-2, ZeRO-3-only variants on ZeRO-1
    (["--zero", "0", "--offload-optimizer", "cpu"], "--offload-optimizer"),
    (["--zero", "2", "--offload-optimizer", "nvme"], "--offload-optimizer"),
    (["--zero", "1", "--offload-params", "cpu"], "--offload-params"),
    (["--zero", "1", "--qwz"], "--qwz"),
    (["--zero", "3", "--hpz", "2", "--mics-shard", "4"], "--hpz"),
    (["--offload-optimizer", "disk"], "--offload-optimizer"),
    (["--zero", "3", "--prefetch-elements", "-1"], "--prefetch-elements"),
    (["--hpz", "0"], "--hpz"),
    # the host flags
    (["--memory-headroom", "100"], "--memory-headroom"),      # more than an A100-80GB has
    (["--memory-headroom", "-0.1"], "--memory-headroom"),
    (["--memory-headroom", "nan"], "--memory-headroom"),
    (["--cpu-mem-gb", "-1"], "--cpu-mem-gb"),
    (["--cpu-mem-gb", "inf"], "--cpu-mem-gb"),
    (["--nvme-gbps", "-5"], "--nvme-gbps"),
    (["--nvme-gbps", "nan"], "--nvme-gbps"),
])
def test_bad_variants_are_one_line(capsys, argv, needle):
    gpus = ["--gpus", argv[argv.index("--gpus") + 1]] if "--gpus" in argv else ["--gpus", "8xA100"]
    rest = [a for i, a in enumerate(argv) if a != "--gpus" and (i == 0 or argv[i - 1] != "--gpus")]
    rc, out, err = run(capsys, "estimate", "--model", "glm-10b", *gpus, *rest)
    assert one_line(rc, err), err
    assert needle in err, err


def test_offload_without_host_memory_is_one_line(capsys):
    rc, _, err = run(capsys, "estimate", *GLM10, "--zero", "2", "--offload-optimizer", "cpu", "--cpu-mem-gb", "0")
    assert one_line(rc, err) and "--cpu-mem-gb" in err, err


def test_search_takes_the_host_flags(capsys, tmp_path):
    rc, out, err = run(capsys, "search", "--model", "chatglm3-6b", "--scale", "tiny", "--gpus", "8xA100",
                       "--global-batch", "16", "--exhaustive", "--out-dir", str(tmp_path), "--cpu-mem-gb", "768",
                       "--nvme-gbps", "12", "--memory-headroom", "2")
    assert rc == 0, err
    doc = json.loads((tmp_path / "chatglm3-6b-tiny_8xA100" / "plan.json").read_text())
    c = doc["inputs"]["cluster"]
    assert c["memory_headroom"] == 2 and c["host"]["cpu_memory_gb"] == 768 and c["host"]["nvme_gbps"] == 12
    # an A100 80GB's capacity is the driver's 81,039 MiB = 85.0 GB (profiles/A100-80GB.json memory_total_mib)
    assert "usable 85.0" in out and "--memory-headroom 2.0" in doc["inputs"]["command"]
    rc, _, err = run(capsys, "search", "--model", "glm-10b", "--gpus", "8xA100", "--memory-headroom", "-1",
                     "--out-dir", str(tmp_path / "bad"))
    assert one_line(rc, err) and "--memory-headroom" in err
    assert not (tmp_path / "bad").exists()


# --- near the memory limit ----------------------------------------------------------------

def test_memory_flag_by_hand():
    near = memory_flag(79.0e9, 80e9, 1.0)                  # 79.0 > 0.98 x 80 = 78.4
    assert near is not None and not near.over
    assert near.text() == "near the memory limit: 79.0 of 80.0 GB usable (headroom 1 GB)"
    assert memory_flag(78.4e9, 80e9, 1.0) is None          # exactly 2% below: not flagged
    assert memory_flag(40e9, 80e9, 1.0) is None
    over = memory_flag(81.0e9, 80e9, 2.5)
    assert over is not None and over.over
    assert over.text() == "over the usable memory: 81.0 of 80.0 GB usable (headroom 2.5 GB)"
    assert memory_flag(79.0e9, 80e9, None).text().endswith("(headroom the profile's)")
    assert memory_flag(None, 80e9, 1.0) is None and memory_flag(1e9, 0.0, 1.0) is None


def test_search_table_marks_a_plan_near_the_limit():
    cluster = parse_cluster("8xA100", memory_headroom=1.5)
    usable = cluster.usable_bytes
    near, far = fake_estimate(0.99 * usable, usable), fake_estimate(0.75 * usable, usable)
    assert _mem_cell(near, cluster) == f"{0.99 * usable / 1e9:.1f}/{usable / 1e9:.1f} !"
    assert _mem_cell(far, cluster) == f"{0.75 * usable / 1e9:.1f}/{usable / 1e9:.1f}"
    assert _memory_lines(near, cluster) == [f"warning: near the memory limit: {0.99 * usable / 1e9:.1f} of "
                                            f"{usable / 1e9:.1f} GB usable (headroom 1.5 GB)"]
    assert _memory_lines(far, cluster) == []
    lines = _memory_lines(fake_estimate(0.75 * usable, usable, host_bytes=20e9), cluster)
    assert lines == ["host memory: 160.0 GB per node (20.0 GB per rank x 8) of 2048 GB"]
    assert host_memory_text(fake_estimate(1e9, host_bytes=300e9), 8, 2048).endswith("MORE THAN THE NODE HAS")
    assert host_memory_text({"host_memory_gb": 2.5}, 4, 0).startswith("10.0 GB per node (2.5 GB per rank x 4)")


def test_search_table_shows_the_variants():
    plan = Plan(dp=8, zero=3, offload_optimizer="nvme", hpz=8, quantized_gradients=True)
    assert _plan_cells(plan)[2] == "off-opt:nvme hpZ8 qgZ" == " ".join(short_variants(plan))
    assert _plan_cells(Plan(dp=8, zero=1))[2] == "-"


def test_estimate_warns_near_the_limit_and_not_far_from_it(capsys):
    """A real plan (glm-10b, ZeRO-1, micro-batch 2 on 8x A100-80GB): its peak from the cost
    model, then a --memory-headroom (GB counted in the peak) that leaves it 1% below the
    usable memory."""
    model = preset("glm-10b")
    train = TrainSpec(global_batch=512, seq_len=1024, precision="bf16")
    plan = Plan(dp=8, zero=1, micro_batch=2, grad_accum=32)
    argv = [*GLM10, "--zero", "1", "--micro-batch", "2"]

    def peak(headroom_gb: float) -> float:
        return cost_estimate(model, parse_cluster("8xA100", memory_headroom=headroom_gb), train,
                             plan).peak_memory_bytes

    usable = parse_cluster("8xA100").usable_bytes
    assert 0.6 * usable < peak(1.0) < 0.95 * usable            # far from the limit
    rc, out, _ = run(capsys, "estimate", *argv, "--memory-headroom", "1")
    assert rc == 0 and "near the memory limit" not in out and "over the usable memory" not in out
    doc = json.loads(run(capsys, "estimate", *argv, "--memory-headroom", "1", "--json")[1])
    assert doc["memory_warning"] is None

    # the headroom is a fixed allowance in the peak: one more GB of it, one more GB of peak
    assert peak(2.0) - peak(1.0) == pytest.approx(1e9, rel=1e-6)
    headroom = round(1.0 + (0.99 * usable - peak(1.0)) / 1e9, 3)
    near = peak(headroom)
    assert 0.98 * usable < near <= usable
    expected = f"near the memory limit: {near / 1e9:.1f} of {usable / 1e9:.1f} GB usable (headroom {headroom:.3g} GB)"
    rc, out, _ = run(capsys, "estimate", *argv, "--memory-headroom", str(headroom))
    assert rc == 0 and f"warning: {expected}" in out
    doc = json.loads(run(capsys, "estimate", *argv, "--memory-headroom", str(headroom), "--json")[1])
    assert doc["memory_warning"] == expected and doc["feasible"]
