"""fp8 training (Transformer Engine) as a precision of the runtimes that have it, on FP8 GPUs
(issue 19 item 5), and the B200 profile: each term pinned by hand."""
from __future__ import annotations

import dataclasses
import json

import pytest

from planner.cli import main
from planner.cost import compute, estimate, layer_costs, memory
from planner.cost import runtime as rtm
from planner.cost.stage import stage_memory
from planner.errors import ProfileError
from planner.search.checkpoint import StageModel
from planner.search.evaluate import Evaluator
from planner.specs import ModelSpec, Plan, TrainSpec, find_device, parse_cluster
from planner.specs.hardware import PROFILES_DIR, profile_from_dict
from planner.specs.validate import plan_problems

MODEL = ModelSpec(name="t", hidden=4096, layers=32, heads=32, ffn_hidden=16384, vocab=51200, max_seq=4096,
                  activation="gelu", norm="layernorm", position="learned", tied_embeddings=True)
H100 = parse_cluster("2x8xH100")
TRAIN = TrainSpec(global_batch=64, seq_len=4096, precision="fp8")
PLAN = Plan(dp=8, tp=2, pp=1, zero=1, micro_batch=1, grad_accum=8, sequence_parallel=True, precision="fp8",
            runtime="megatron-core")


def test_the_gemms_fp8_does_not_cover_stay_bf16() -> None:
    assert compute.bf16_part("fp8") == "bf16"
    assert compute.bf16_part("bf16") == "bf16" and compute.bf16_part("fp32") == "fp32"


def test_weight_gemms_run_at_the_fp8_peak_the_attention_core_at_bf16() -> None:
    dev = H100.device
    b8 = compute.block_compute_times(MODEL, dev, 4096, 1, 2, "fp8", compute_scale=1.0, attention_scale=1.0)
    b16 = compute.block_compute_times(MODEL, dev, 4096, 1, 2, "bf16", compute_scale=1.0, attention_scale=1.0)
    # the same tile model, a 1979 TFLOP/s peak at fp8's own ceiling (0.66, H100's fp8 MAMF fraction 0.709 over
    # its bf16 0.803, x the measured bf16 0.747: benchmarks/kernel_curves.py MAMF); compute-bound at 4096 tokens
    assert dev.kernels.gemm_ceiling["fp8"] == 0.66 and dev.kernels.gemm_ceiling["bf16"] == 0.747
    assert b8.gemm_fwd == pytest.approx(b16.gemm_fwd * (989 * 0.747) / (1979 * 0.66))
    assert b8.gemm_bwd == pytest.approx(b16.gemm_bwd * (989 * 0.747) / (1979 * 0.66))
    assert (b8.core_fwd, b8.core_bwd) == (b16.core_fwd, b16.core_bwd)


def test_fp8_bytes_by_hand() -> None:
    # 3 blocks of 1e6 weights: 2 bytes each (FP8 copy + transpose) + 3 x 4 linears x 3 x 1024 x 4 B
    assert memory.fp8_bytes(3, 1e6, False) == 3 * 1e6 * 2 + 3 * 4 * 3 * 1024 * 4
    # ZeRO-3 / FULL_SHARD: only the gathered unit and the prefetched one hold copies
    assert memory.fp8_bytes(3, 1e6, True) == 2 * 1e6 * 2 + 3 * 4 * 3 * 1024 * 4
    # --fp8-param-gather: the FP8 weight and its transpose (2 B) replace the bf16 weight (2 B): the amax alone
    assert memory.fp8_bytes(3, 1e6, False, True) == 3 * 1e6 * 2 - 3 * 1e6 * 2 + 3 * 4 * 3 * 1024 * 4 == 147_456


def test_megatron_core_fp8_holds_no_bf16_weight_copy_with_the_distributed_optimizer() -> None:
    """Megatron-Bridge's fp8 recipes set fp8_param_gather=True (profiles/runtimes/megatron-core.json
    sources it): an fp8 ZeRO-1 plan's params are the bf16 plan's plus the amax histories only,
    32 blocks x 4 linears x 3 tensors x 1024 x 4 B = 1,572,864 B; the FP8 weight and its transpose
    (2 B per element) replace the bf16 weight (2 B). Without it the difference is 2 B x the blocks'
    weights more (tens of GB here), halved 1 B more: both fail."""
    assert rtm.get_runtime("megatron-core").fp8_param_gather
    assert not rtm.get_runtime("deepspeed").fp8_param_gather and not rtm.get_runtime("fsdp").fp8_param_gather
    assert memory.fp8_param_gather(PLAN)
    est8 = estimate(MODEL, H100, TRAIN, PLAN)
    est16 = estimate(MODEL, H100, dataclasses.replace(TRAIN, precision="bf16"),
                     dataclasses.replace(PLAN, precision="bf16"))
    assert est8.stage_memory[0].params - est16.stage_memory[0].params == pytest.approx(32 * 4 * 3 * 1024 * 4, rel=1e-9)
    # DDP (no distributed optimizer) and Megatron-FSDP keep the bf16 weight beside the FP8 copies
    assert not memory.fp8_param_gather(dataclasses.replace(PLAN, zero=0))
    assert not memory.fp8_param_gather(dataclasses.replace(PLAN, zero=3))


def test_fp8_plan_holds_the_weight_copies_and_the_search_solver_agrees() -> None:
    est8 = estimate(MODEL, H100, TRAIN, PLAN)
    est16 = estimate(MODEL, H100, dataclasses.replace(TRAIN, precision="bf16"),
                     dataclasses.replace(PLAN, precision="bf16"))
    lc = layer_costs(MODEL, H100, TRAIN, PLAN)
    extra = memory.fp8_bytes(MODEL.layers, lc.block_psi, False, True)
    assert est8.stage_memory[0].params - est16.stage_memory[0].params == pytest.approx(extra)
    sm = StageModel(H100, PLAN, lc)
    mem = stage_memory(PLAN, lc, (MODEL.layers,), (0,), 0.1, False)[0]
    assert sm.bytes(0, MODEL.layers, 0) == pytest.approx(mem.total, rel=1e-9)
    assert est8.step_time_s < est16.step_time_s


def test_deepspeed_and_non_fp8_gpus_do_not_offer_fp8() -> None:
    ds = rtm.get_runtime("deepspeed")
    assert "does not offer fp8" in rtm.problems(ds, dataclasses.replace(PLAN, runtime="deepspeed"))[0].line
    assert not estimate(MODEL, H100, TRAIN, dataclasses.replace(PLAN, runtime="deepspeed")).feasible
    a100 = parse_cluster("2x8xA100")
    assert any("no FP8 tensor cores" in p.line for p in plan_problems(MODEL, a100, TRAIN, PLAN))


def test_fp8_is_searched_beside_bf16_where_it_is_offered() -> None:
    bf16 = dataclasses.replace(TRAIN, precision="bf16")
    assert Evaluator(MODEL, H100, bf16, runtime="megatron-core").precisions == ("bf16", "fp8")
    assert Evaluator(MODEL, H100, bf16, runtime="deepspeed").precisions == ("bf16",)
    assert Evaluator(MODEL, parse_cluster("2x8xA100"), bf16, runtime="fsdp").precisions == ("bf16",)


@pytest.mark.parametrize("args, word", [
    (["--gpus", "2x8xA100", "--precision", "fp8", "--runtime", "megatron-core"], "no FP8 tensor cores"),
    (["--gpus", "2x8xH100", "--precision", "fp8"], "not offered on runtime deepspeed"),
])
def test_cli_fp8_bad_input_is_one_line_exit_2(capsys, args, word) -> None:
    rc = main(["estimate", "--model", "glm-10b", "--global-batch", "64", *args])
    err = capsys.readouterr().err
    assert rc == 2 and word in err and "--precision" in err and len(err.strip().splitlines()) == 1


def test_b200_profile_has_sourced_fp8_numbers() -> None:
    dev = find_device("B200")[0]
    assert dev.fp8 and dev.peak_tflops == {"bf16": 2250.0, "fp16": 2250.0, "fp32": 80.0, "fp8": 4500.0}
    assert dev.memory_gb == 180 and dev.hbm_bandwidth_gbps == 8000
    data = json.loads((PROFILES_DIR / "B200.json").read_text())
    assert all(data["sources"].get(k) for k in ("peak_tflops", "memory_gb", "hbm_bandwidth_gbps",
                                               "intra_node.busbw_gbps", "inter_node.busbw_gbps"))


def test_an_fp8_peak_needs_fp8_tensor_cores() -> None:
    data = json.loads((PROFILES_DIR / "A100-80GB.json").read_text())
    data["peak_tflops"]["fp8"] = 624
    with pytest.raises(ProfileError) as e:
        profile_from_dict(data)
    assert e.value.field == "peak_tflops.fp8"
