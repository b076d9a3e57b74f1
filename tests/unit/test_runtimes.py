"""The runtime is part of the plan (issue 19 item 1): profiles/runtimes/*.json and the few
structural terms that differ (planner/cost/runtime.py), pinned by hand."""
from __future__ import annotations

import dataclasses

import pytest

from planner.cli import main
from planner.cost import estimate
from planner.cost import block, compute, tp
from planner.cost.model import layer_costs
from planner.cost import runtime as rtm
from planner.cost.factors import DEFAULTS, cluster_factors
from planner.errors import SpecError
from planner.search.space import PLAIN, Space
from planner.specs import ModelSpec, Plan, TrainSpec, parse_cluster
from planner.specs.validate import runtime_problems

MODEL = ModelSpec(name="t", hidden=4096, layers=32, heads=32, ffn_hidden=16384, vocab=51200, max_seq=2048,
                  activation="gelu", norm="layernorm", position="learned", tied_embeddings=True)
TRAIN = TrainSpec(global_batch=64, seq_len=2048, attention="eager")
CLUSTER = parse_cluster("2x8xA100-80GB")


def test_every_runtime_has_a_file_and_deepspeed_is_the_default() -> None:
    assert rtm.NAMES[0] == "deepspeed" == Plan().runtime
    for name in rtm.NAMES:
        rt = rtm.get_runtime(name)
        assert rt.name == name and rt.executable == (name == "deepspeed")


def test_unknown_runtime_is_one_line_naming_the_flag() -> None:
    with pytest.raises(SpecError) as e:
        rtm.get_runtime("jax")
    assert e.value.field == "--runtime" and "megatron-core" in e.value.fix
    with pytest.raises(SpecError) as e:
        Plan(runtime="jax")
    assert e.value.field == "plan.runtime"


def test_deepspeed_takes_the_device_factors_the_others_their_own() -> None:
    dev = CLUSTER.device
    ds = cluster_factors(CLUSTER, "deepspeed")
    assert ds.compute_scale == dev.factors["compute_scale"] and ds.dp_overlap == dev.factors["dp_overlap"]
    mc = cluster_factors(CLUSTER, "megatron-core")
    file = rtm.get_runtime("megatron-core").factors
    assert mc.compute_scale == file["compute_scale"] and mc.dp_overlap == 1.0 and mc.latency_scale == 1.0
    fs = cluster_factors(CLUSTER, "fsdp")
    assert fs.compute_scale == mc.compute_scale  # one source of its own: borrowed from megatron-core
    assert fs.zero3_fetch_overhead_s == 0.0
    # megatron-core's per-GPU trim where two or more sources ran it on that GPU (H100: S1, S5-S7)
    from planner.specs import parse_cluster
    h100 = cluster_factors(parse_cluster("8xH100-SXM"), "megatron-core")
    assert h100.compute_scale == rtm.get_runtime("megatron-core").by_device["H100-SXM"]["compute_scale"] != 1.0


def test_trial_factors_apply_inside_the_block_only() -> None:
    with rtm.trial_factors("fsdp", {"compute_scale": 2.0}):
        assert cluster_factors(CLUSTER, "fsdp").compute_scale == 2.0
    assert cluster_factors(CLUSTER, "fsdp").compute_scale == rtm.get_runtime("fsdp").factors["compute_scale"]


def test_overlapped_tp_by_hand() -> None:
    # forward: 3 s of TP comm against 1 s of GEMMs -> 2 exposed; backward 5 against 2 -> 3
    assert tp.overlapped_tp(3.0, 5.0, 1.0) == (2.0, 3.0)
    # comm fully covered: nothing exposed
    assert tp.overlapped_tp(0.5, 1.5, 1.0) == (0.0, 0.0)


def test_megatron_core_exposes_only_uncovered_tp_comm() -> None:
    plan = Plan(dp=2, tp=8, pp=1, zero=1, micro_batch=1, grad_accum=32, sequence_parallel=True)
    mc = dataclasses.replace(plan, runtime="megatron-core")
    train = block.runtime_train(TRAIN, mc)
    f = cluster_factors(CLUSTER, "megatron-core")
    bc = compute.block_compute_times(MODEL, CLUSTER.device, 2048, 1, 8, "bf16",
                                        compute_scale=f.compute_scale, attention_scale=f.attention_scale)
    raw = tp.tp_block_comm(MODEL, 2048, 1, 8, 2.0, True, tp.tp_link(CLUSTER, mc), f.comm_efficiency)
    bt = block.block_times(MODEL, CLUSTER, train, mc, f)
    assert bt.tp_fwd == pytest.approx(max(raw[0] - bc.gemm_fwd, 0.0))
    assert bt.tp_bwd == pytest.approx(max(raw[1] - bc.gemm_bwd, 0.0))  # the backward GEMMs from their shapes
    assert raw[0] > 0 and bt.tp_fwd < raw[0]  # the overlap matters on this shape


def test_fsdp_runs_flash_attention_megatron_core_the_backend_chosen() -> None:
    assert block.runtime_train(TRAIN, Plan(runtime="fsdp", zero=3)).attention == "flash"
    # deepspeed and megatron-core (--attention-backend unfused / local) run what the user chose
    assert block.runtime_train(TRAIN, Plan()).attention == "eager"
    assert block.runtime_train(TRAIN, Plan(runtime="megatron-core", zero=0)).attention == "eager"
    flash = dataclasses.replace(TRAIN, attention="flash")
    assert block.runtime_train(flash, Plan(runtime="megatron-core", zero=0)).attention == "flash"


def test_megatron_core_hides_steady_state_pipeline_sends() -> None:
    plan = Plan(dp=2, tp=2, pp=4, zero=1, micro_batch=1, grad_accum=32, recompute="full")
    ds = estimate(MODEL, CLUSTER, TRAIN, plan)
    mc = estimate(MODEL, CLUSTER, TRAIN, dataclasses.replace(plan, runtime="megatron-core"))
    assert ds.time.pp_comm > 0 and mc.time.pp_comm == 0.0
    assert mc.time.bubble > 0  # fill and drain sends stay exposed


def test_runtime_problems_name_the_missing_feature() -> None:
    fsdp = rtm.get_runtime("fsdp")
    assert rtm.problems(fsdp, Plan(zero=3, runtime="fsdp")) == []
    assert "no ZeRO-1" in rtm.problems(fsdp, Plan(zero=1, runtime="fsdp"))[0].line
    assert "no pipeline" in " ".join(p.line for p in rtm.problems(fsdp, Plan(pp=2, zero=0, runtime="fsdp")))
    assert "no tensor parallelism" in " ".join(p.line for p in rtm.problems(fsdp, Plan(tp=2, zero=3, runtime="fsdp")))
    assert "interleaved" in " ".join(p.line for p in rtm.problems(fsdp, Plan(pp=2, schedule="interleaved", interleave=2,
                                                            runtime="fsdp")))
    mc = rtm.get_runtime("megatron-core")
    assert rtm.problems(mc, Plan(pp=2, zero=1, schedule="interleaved", interleave=2, runtime="megatron-core")) == []
    est = estimate(MODEL, CLUSTER, TRAIN, Plan(dp=16, zero=1, micro_batch=1, grad_accum=4, runtime="fsdp"))
    assert not est.feasible and any("no ZeRO-1" in r for r in est.reasons)


def test_non_deepspeed_plans_are_not_executed() -> None:
    assert "planner run" in runtime_problems(Plan(runtime="megatron-core"))[0].line
    assert runtime_problems(Plan()) == []


def test_search_space_follows_the_runtime() -> None:
    space = Space(model=MODEL, cluster=CLUSTER, train=TRAIN, runtime="fsdp")
    assert all(tp == 1 and pp == 1 for tp, pp, _ in space.layouts())
    assert space.zero_stages(1) == (2, 3)
    assert all(v == PLAIN for _, v in space.zero_options(1, 16))  # DeepSpeed's variants are DeepSpeed's
    mc = Space(model=MODEL, cluster=CLUSTER, train=TRAIN, runtime="megatron-core")
    assert mc.zero_stages(1) == (0, 1, 3) and mc.zero_stages(2) == (0, 1) and any(pp > 1 for _, pp, _ in mc.layouts())


@pytest.mark.parametrize("args, word", [
    (["--runtime", "jax"], "unknown runtime"),
    (["--runtime", "fsdp", "--zero", "1"], "no ZeRO-1"),
    (["--runtime", "fsdp", "--zero", "3", "--tp", "2"], "no tensor parallelism"),
    (["--runtime", "megatron-core", "--write", "/tmp/never-written-i19"], "estimated, not run here"),
])
def test_cli_bad_runtime_input_is_one_line_exit_2(capsys, args, word) -> None:
    rc = main(["estimate", "--model", "glm-10b", "--gpus", "2x8xA100", "--global-batch", "64", *args])
    err = capsys.readouterr().err
    assert rc == 2 and word in err and len(err.strip().splitlines()) == 1


def test_flat_parameters_gather_each_unit_once() -> None:
    from planner.cost import zero
    u = zero.Unit(tensors=(10, 20), elements=35, forward=1.0, backward=2.0, count=3)
    assert zero.flat_units((u,)) == (dataclasses.replace(u, tensors=(35,)),)
    plan = Plan(dp=16, zero=3, micro_batch=1, grad_accum=4)
    lc = layer_costs(MODEL, CLUSTER, TRAIN, plan)
    bt = block.block_times(MODEL, CLUSTER, TRAIN, plan, cluster_factors(CLUSTER))
    from planner.cost.estimate import zero3_comm
    ds = zero3_comm(MODEL, CLUSTER, plan, cluster_factors(CLUSTER), lc, bt, 0)
    fs_plan = dataclasses.replace(plan, runtime="fsdp")
    fs = zero3_comm(MODEL, CLUSTER, fs_plan, cluster_factors(CLUSTER, "fsdp"), lc, bt, 0)
    # embedding, 32 blocks, output layer: one gather each in forward and in backward
    assert fs.fetches == 2 * (1 + MODEL.layers + 1) < ds.fetches
