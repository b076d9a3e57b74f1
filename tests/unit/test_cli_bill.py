"""The bill through the CLI: every plan prints days and cost to train --tokens, a plan beyond
365 days says so, --spot adds the Young/Daly interval, NVMe capacity makes a plan infeasible,
--objective cost re-ranks, the report renders the cost section, and bad input is one line."""
from __future__ import annotations

import json

import pytest

from planner.cli import main

GLM130_A100 = ["--model", "glm-130b", "--gpus", "4x8xA100", "--global-batch", "1024", "--tp", "8", "--pp", "4",
               "--zero", "1", "--recompute", "full"]


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_estimate_prints_the_bill_and_flags_a_year(capsys):
    rc, out, err = run(capsys, "estimate", *GLM130_A100)
    assert rc == 0, err
    line = next(x for x in out.splitlines() if x.startswith("to train 400B tokens"))
    assert "Zeng et al. 2022" in line and "on 32 GPUs" in line and "on-demand at $4.1/GPU-hour" in line
    assert "more than 365 days" in out and "price source: https://www.xither.com" in out


def test_estimate_json_bill_with_spot(capsys):
    rc, out, err = run(capsys, "estimate", *GLM130_A100, "--tokens", "1e9", "--gpu-hour-price", "2",
                       "--spot", "--preemption-rate", "0.05", "--spot-price", "1", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    b, est = doc["bill"], doc
    assert b["tokens"] == 1e9 and b["tokens_note"] == "--tokens"
    days = 1e9 / est["tokens_per_s"] / 86400
    assert b["days"] == pytest.approx(days) and b["cost_usd"] == pytest.approx(days * 24 * 32 * 2.0)
    s = b["spot"]
    # 0.05 per node-hour x 4 nodes: the job is preempted every 5 h; tau = sqrt(2 C M)
    assert s["mtbf_hours"] == pytest.approx(5.0)
    assert s["checkpoint_interval_s"] == pytest.approx((2 * s["checkpoint_write_s"] * 5 * 3600) ** 0.5)
    assert s["finishes"] and s["days"] > b["days"] and s["price"]["usd_per_gpu_hour"] == 1.0
    assert s["cost_usd"] == pytest.approx(s["days"] * 24 * 32 * 1.0)


def test_nvme_smaller_than_the_offload_is_infeasible(capsys):
    argv = ["estimate", "--model", "glm-130b", "--gpus", "1xRTX-4090", "--global-batch", "8", "--zero", "3",
            "--recompute", "full", "--offload-optimizer", "nvme", "--offload-params", "nvme", "--json"]
    rc, out, _ = run(capsys, *argv)
    doc = json.loads(out)
    assert rc == 0 and not doc["feasible"] and any("GB of NVMe per node" in r for r in doc["reasons"])
    rc, out, _ = run(capsys, *argv, "--nvme-gb", "100000")
    assert not any("NVMe" in r for r in json.loads(out)["reasons"])


def test_search_objective_cost_and_report_section(capsys, tmp_path):
    rc, out, err = run(capsys, "search", "--model", "glm-10b", "--scale", "small", "--gpus", "2x8xH100",
                       "--exhaustive", "--out-dir", str(tmp_path), "--name", "r", "--tokens", "1e10",
                       "--spot", "--preemption-rate", "0.1", "--objective", "cost")
    assert rc == 0, err
    assert "--objective cost: plans ranked by spot cost to train 10B tokens" in out
    doc = json.loads((tmp_path / "r" / "estimate.json").read_text())["bill"]
    costs = [p["spot_cost_usd"] for p in doc["plans"]]
    assert doc["objective"] == "cost" and doc["plans"][0]["chosen"] and costs == sorted(costs)
    html = (tmp_path / "r" / "report.html").read_text()
    assert 'id="cost"' in html and 'id="img-bill"' in html and "Young/Daly" in html and 'id="spot-table"' in html
    assert "tokens (--tokens)" in html and 'id="over-a-year"' not in html     # the summary card uses the bill's tokens
    from planner.report import write_report
    est = json.loads((tmp_path / "r" / "estimate.json").read_text())
    del est["bill"]                                   # a run directory from before the bill: no section
    (tmp_path / "r" / "estimate.json").write_text(json.dumps(est))
    assert 'id="cost"' not in write_report(tmp_path / "r").read_text()


def test_report_flags_a_plan_beyond_a_year(capsys, tmp_path):
    from planner.report import write_report
    # the plan benchmarks/cost_questions.py's search picks for GLM-130B on 32 A100s: 630 days
    rc, _, err = run(capsys, "estimate", "--model", "glm-130b", "--gpus", "4x8xA100", "--global-batch", "1024",
                     "--tp", "2", "--pp", "8", "--zero", "1", "--sequence-parallel", "--offload-optimizer", "cpu",
                     "--write", str(tmp_path / "e"))
    doc = json.loads((tmp_path / "e" / "estimate.json").read_text())["bill"]
    assert rc == 0 and doc["over_a_year"], err
    html = write_report(tmp_path / "e").read_text()
    assert 'id="over-a-year"' in html and "more than 365 days" in html


@pytest.mark.parametrize("extra,needle", [
    (["--tokens", "-5"], "--tokens"),
    (["--tokens", "nan"], "--tokens"),
    (["--gpu-hour-price", "-1"], "--gpu-hour-price"),
    (["--gpu-hour-price", "1e6"], "--gpu-hour-price"),
    (["--spot"], "--preemption-rate"),
    (["--spot", "--preemption-rate", "-0.1"], "--preemption-rate"),
    (["--spot", "--preemption-rate", "1000"], "--preemption-rate"),
    (["--spot", "--preemption-rate", "0.1", "--spot-price", "0"], "--spot-price"),
    (["--preemption-rate", "0.1"], "--preemption-rate"),
    (["--nvme-gb", "-1"], "--nvme-gb"),
    (["--nvme-gb", "inf"], "--nvme-gb"),
    (["--checkpoint-gbps", "0"], "--checkpoint-gbps"),
])
def test_bad_bill_input_is_one_line(capsys, tmp_path, extra, needle):
    for cmd in (["estimate", *GLM130_A100], ["search", "--model", "glm-10b", "--gpus", "8xA100", "--out-dir",
                                             str(tmp_path)]):
        rc, out, err = run(capsys, *cmd, *extra)
        assert rc == 2, err
        assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not any(tmp_path.iterdir())          # nothing written


def test_search_says_what_stops_an_offload_plan(capsys, tmp_path):
    """GLM-130B on 4 A6000s: ZeRO-Infinity fits the GPUs, but neither the host memory nor the
    NVMe (host.nvme_gb, halved for 4 of the 8-card server's GPUs) holds the offloaded states."""
    rc, out, err = run(capsys, "search", "--model", "glm-130b", "--gpus", "4xA6000", "--global-batch", "1024",
                       "--exhaustive", "--out-dir", str(tmp_path))
    assert rc == 2 and len(err.strip().splitlines()) == 1 and not any(tmp_path.iterdir())
    assert "fits the device but offloaded states need 2611 GB of host memory per node" in err
    assert "on NVMe instead, offloaded states need 2,611 GB of NVMe per node > 2,000 GB (--nvme-gb)" in err
