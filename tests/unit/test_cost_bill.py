"""planner/cost/bill.py: Young/Daly checkpoint interval, spot wall time, checkpoint write time,
days and cost to train, pinned to hand-computed values; prices.json and the profiles' host
fields carry their sources; NVMe capacity makes a plan infeasible."""
from __future__ import annotations

import math

import pytest

from planner.cost import bill, estimate
from planner.errors import SpecError
from planner.specs import TrainSpec, parse_cluster, preset
from planner.specs.hardware import PROFILES_DIR, load_profile
from planner.specs.plan import Plan


def test_young_daly_interval_is_sqrt_2cm():
    # sqrt(2 x 50 s x 10,000 s) = sqrt(1e6) = 1,000 s
    assert bill.young_daly_interval(50.0, 10_000.0) == pytest.approx(1000.0)
    assert bill.young_daly_interval(100.0, 36_000.0) == pytest.approx(2683.2816, rel=1e-6)


def test_spot_wall_time_first_order():
    # W 9,000 s, C 50, tau 1,000, R 450, M 10,000: lost per preemption 450 + 1,050/2 = 975;
    # T = 9,000 x 1.05 / (1 - 975/10,000) = 9,450 / 0.9025 = 10,470.914 s
    assert bill.spot_wall_seconds(9000.0, 50.0, 450.0, 10_000.0, 1000.0) == pytest.approx(10470.9141, rel=1e-7)
    # a preemption, on average, before a segment and a restart are done: never finishes
    assert bill.spot_wall_seconds(9000.0, 50.0, 9_600.0, 10_000.0, 1000.0) == math.inf


@pytest.mark.parametrize("kw,expected", [
    # 1e9 params bf16: weights 2e9 B from one replica (tp 8 x pp 2 = 2 of 4 nodes), optimizer 12e9 B
    # sharded over all 4 nodes (ZeRO-1): (2e9/2 + 12e9/4) / 10 GB/s = 0.4 s
    (dict(nodes=4, gpus_per_node=8, tp=8, pp=2, zero=1), 0.4),
    # ZeRO-0, no pipeline, fp16: one node of the replica writes everything: 14e9 / 1e10 = 1.4 s
    (dict(nodes=4, gpus_per_node=8, tp=8, pp=1, zero=0, precision="fp16"), 1.4),
    # ZeRO-0 with a bf16 pipeline: BF16_Optimizer shards the optimizer over DP: (2e9/1 + 12e9/4) / 1e10
    (dict(nodes=4, gpus_per_node=8, tp=4, pp=2, zero=0), 0.5),
    # ZeRO-3 partitions the weights too: 14e9 / 4 / 1e10 = 0.35 s
    (dict(nodes=4, gpus_per_node=8, tp=1, pp=1, zero=3), 0.35),
    # fp32: 12 bytes per parameter, all of them optimizer states (master = weights): 12e9 / 4 / 1e10
    (dict(nodes=4, gpus_per_node=8, tp=1, pp=1, zero=3, precision="fp32"), 0.3),
])
def test_checkpoint_write_seconds(kw, expected):
    kw = {"precision": "bf16", **kw}
    assert bill.checkpoint_seconds(1e9, kw.pop("precision"), write_gbps=10.0, **kw) == pytest.approx(expected)


def _spec(**kw):
    base = dict(tokens=400e9, tokens_note="test", price=bill.Price(usd_per_gpu_hour=2.0, kind="given"))
    return bill.BillSpec(**{**base, **kw})


def test_train_bill_on_demand_and_spot():
    spot = bill.Price(usd_per_gpu_hour=1.0, kind="given", source="--spot-price")
    b = bill.train_bill(_spec(spot=True, spot_price=spot, preemption_rate=0.25, restart_min=5.0), 1e5, 32,
                        nodes=4, checkpoint_s=50.0)
    # 400e9 / 1e5 = 4e6 s = 46.30 days; 4e6 / 3600 x 32 = 35,555.6 GPU-hours; x $2 = $71,111
    assert b.compute_s == pytest.approx(4e6) and b.days == pytest.approx(46.2963, rel=1e-5)
    assert b.gpu_hours == pytest.approx(35555.556, rel=1e-6) and b.cost == pytest.approx(71111.111, rel=1e-6)
    s = b.spot
    # 0.25 per node-hour x 4 nodes: M = 3,600 s; tau = sqrt(2 x 50 x 3,600) = 600 s; R = 300 + 50 (read back)
    assert s.mtbf_h == pytest.approx(1.0) and s.interval_s == pytest.approx(600.0) and s.restart_s == 350.0
    # lost 350 + 650/2 = 675; T = 4e6 x (1 + 50/600) / (1 - 675/3600) = 5,333,333 s
    assert s.lost_s_each == pytest.approx(675.0)
    assert s.wall_s == pytest.approx(5333333.33, rel=1e-8) and s.preemptions == pytest.approx(1481.481, rel=1e-6)
    assert s.cost == pytest.approx(5333333.33 / 3600 * 32, rel=1e-8)
    assert b.objective() == pytest.approx(s.cost) and not b.over_a_year
    assert b.to_dict()["spot"]["checkpoint_interval_s"] == pytest.approx(600.0)


def test_over_a_year_and_never():
    slow = bill.train_bill(_spec(), 1e4, 8, nodes=1, checkpoint_s=1.0)      # 4e7 s = 463 days
    assert slow.days == pytest.approx(462.963, rel=1e-5) and slow.over_a_year
    assert any("more than 365 days" in line for line in bill.bill_lines(slow))
    never = bill.train_bill(_spec(spot=True, preemption_rate=10.0, restart_min=30.0), 1e6, 8, nodes=1,
                            checkpoint_s=60.0)
    assert never.spot.wall_s == math.inf and never.over_a_year and never.spot.cost is None
    assert "never" in bill.bill_lines(never)[1]


def test_default_tokens():
    assert bill.default_tokens("glm-130b")[0] == 400e9
    assert bill.default_tokens("glm-130b+linear-attention")[0] == 400e9
    assert bill.default_tokens("glm-10b-tiny") == (100e9, bill.default_tokens("nosuch")[1])


@pytest.mark.parametrize("fn,value", [
    (bill.check_price, -1.0), (bill.check_price, 0.0), (bill.check_price, 5000.0), (bill.check_price, math.nan),
    (bill.check_price, True), (bill.check_rate, 0.0), (bill.check_rate, 100.0), (bill.check_rate, -0.1),
    (bill.check_tokens, 0.0), (bill.check_tokens, math.inf), (bill.check_restart, -1.0),
])
def test_bad_numbers_are_refused(fn, value):
    with pytest.raises(SpecError):
        fn(value)


def test_prices_file_cites_every_price():
    doc = bill.load_prices()
    for oid, o in doc["offers"].items():
        assert o["usd_per_gpu_hour"] > 0 and o["source"].count("http") >= 1 and o["as_of"], oid
        if "instance_usd_per_hour" in o:        # the 8-GPU instance's price over 8, as quoted
            assert o["usd_per_gpu_hour"] == pytest.approx(o["instance_usd_per_hour"] / 8, rel=2e-3), oid
    for gpu, cols in doc["defaults"].items():
        load_profile(PROFILES_DIR / f"{gpu}.json")
        for col, oid in cols.items():
            kind = doc["offers"][oid]["kind"]
            assert kind == "spot" if col == "spot" else kind in ("on_demand", "capacity_block"), (gpu, col)
    h100 = bill.price_for("H100-SXM", "spot")
    assert h100.usd_per_gpu_hour == 1.49 and "gridstackhub" in h100.source and "Vast.ai" in h100.text()
    a6000, l40s = bill.price_for("A6000", "on_demand"), bill.price_for("L40S", "spot")
    assert a6000.usd_per_gpu_hour == 0.491 and "RunPod" in a6000.text() and "2026-04-22" in a6000.text()
    assert l40s.usd_per_gpu_hour == 1.1027 and "modal.com" in l40s.source and l40s.kind == "spot"
    assert bill.price_for("RTX-4090", "on_demand") is None and bill.price_for("V100", "spot") is None


def test_profiles_carry_nvme_capacity_and_checkpoint_bandwidth_with_sources():
    for path in PROFILES_DIR.glob("*.json"):
        if path.name in ("cpu.json", "prices.json"):
            continue
        prof = load_profile(path)
        assert prof.host.nvme_gb > 0 and prof.host.checkpoint_gbps > 0, path.name
        assert prof.sources["host.nvme_gb"] and prof.sources["host.checkpoint_gbps"], path.name


def _nvme_plan(cluster, train):
    return Plan(dp=cluster.world_size, zero=3, micro_batch=1, grad_accum=train.global_batch // cluster.world_size,
                precision=train.precision, recompute="full", offload_optimizer="nvme", offload_params="nvme")


def test_nvme_capacity_makes_a_plan_infeasible():
    model, train = preset("glm-130b"), TrainSpec(global_batch=8, seq_len=2048, precision="bf16")
    small = parse_cluster("1xRTX-4090")          # the profile's 8-card server scaled to one card: 500 GB
    est = estimate(model, small, train, _nvme_plan(small, train))
    need = est.nvme_bytes / 1e9
    assert small.host.nvme_gb == pytest.approx(500.0) and need > 500
    assert any("NVMe per node" in r and "--nvme-gb" in r for r in est.reasons) and not est.feasible
    big = parse_cluster("1xRTX-4090", nvme_gb=need * 1.01)
    assert not any("NVMe" in r for r in estimate(model, big, train, _nvme_plan(big, train)).reasons)


def test_a_year_is_365_days():
    tps = 400e9 / (365.0 * 86400)                       # exactly 365 days: not flagged; a little slower: flagged
    assert not bill.train_bill(_spec(), tps * 1.001, 8, nodes=1, checkpoint_s=1.0).over_a_year
    assert bill.train_bill(_spec(), tps * 0.999, 8, nodes=1, checkpoint_s=1.0).over_a_year


def test_the_yuan_rate_is_dated_and_sourced() -> None:
    from planner.cost.bill import exchange_rate
    rate, source = exchange_rate("CNY")
    assert rate == 7.2734 and "February 2025" in source and "EXCHUS" in source
    assert exchange_rate("XYZ") is None and exchange_rate("CNY", {"offers": {}}) is None
