"""DeepSpeed's ZeRO variants through the executor on CPU (gloo), tiny ChatGLM3, bf16, 4 steps.

What runs under DeepSpeed 0.19.8 on this machine (docs/runtime.md "ZeRO variants on CPU"):
ZeRO-1/2/3 with the optimizer offloaded to the CPU, ZeRO-3 with the parameters offloaded to
the CPU, ZeRO++ hpZ (secondary weight partition over 2 of 4 DP ranks). Each trains through
`planner.runtime.train.launch.run_plan` (the worker the launch script runs) and, being lossless,
reproduces plain ZeRO-3's loss; its model states are counted per rank, device- and host-held
(planner.runtime.observe.measure.model_states), and where DeepSpeed keeps them is asserted buffer by
buffer. What does not run here (MiCS: removed from DeepSpeed 0.19.8; ZeRO++ qwZ/qgZ: no CPU
quantizer kernels) is refused by the executor's preflight, and the DeepSpeed facts behind
each refusal are checked in-process.

Run alone (2 cores): `flock /tmp/planner-cpu.lock .venv/bin/pytest -q -s tests/integration/test_zero_variants.py`
(-s prints the counted bytes per variant and rank, and the cost model's prediction).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from planner import dsconfig
from planner.errors import ExecutionError
from planner.runtime.train.launch import run_plan
from planner.rundir import atomic_write_json, plan_document
from planner.specs import Plan, TrainSpec, parse_cluster, preset, scale

pytestmark = pytest.mark.integration
os.environ.setdefault("DS_ACCELERATOR", "cpu")

MODEL = scale(preset("chatglm3-6b"), "tiny")
SEQ, STEPS, GLOBAL_BATCH, MICRO = 64, 4, 8, 2
E = 2  # bf16 bytes per element
LOSS_TOL = 1e-3

# lossless variants: each must reproduce the plain ZeRO-3 run ("zero3")
VARIANTS = {
    "zero3": dict(dp=2, zero=3),
    "zero1_offload_optimizer": dict(dp=2, zero=1, offload_optimizer="cpu"),
    "zero2_offload_optimizer": dict(dp=2, zero=2, offload_optimizer="cpu"),
    "zero3_offload_optimizer": dict(dp=2, zero=3, offload_optimizer="cpu"),
    "zero3_offload_params": dict(dp=2, zero=3, offload_params="cpu"),
    "zero3_hpz2_dp4": dict(dp=4, zero=3, hpz=2),
}
UNSUPPORTED = {
    "zero3_qwz": (dict(dp=2, zero=3, quantized_weights=True), r"plan\.quantized_weights.*quantizer kernels"),
    "zero3_qgz": (dict(dp=2, zero=3, quantized_gradients=True), r"plan\.quantized_gradients.*quantizer kernels"),
    "zero3_mics2_dp4": (dict(dp=4, zero=3, mics_shard=2), r"plan\.mics_shard.*removed MiCS"),
}


def make_plan(**kw) -> Plan:
    return Plan(micro_batch=MICRO, grad_accum=GLOBAL_BATCH // (MICRO * kw["dp"]), precision="bf16",
                bucket_elements=2_000_000, **kw)


def write_run(root: Path, name: str, plan: Plan) -> tuple[Path, tuple]:
    cluster = parse_cluster(f"{plan.world_size}xcpu")
    train = TrainSpec(global_batch=plan.global_batch, seq_len=SEQ, precision=plan.precision)
    d = root / name
    doc = plan_document(plan, MODEL, cluster, train, scale="tiny", model_arg="chatglm3-6b")
    atomic_write_json(d / "plan.json", doc)
    atomic_write_json(d / "ds_config.json", dsconfig.ds_config(plan, MODEL, train, cluster))
    return d, (MODEL, cluster, train, plan)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    """Each variant run once (4 steps), on first use: (metrics, result.json ranks, estimate inputs)."""
    root = tmp_path_factory.mktemp("zero-variants")
    cache: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in cache:
            d, inputs = write_run(root, name, make_plan(**VARIANTS[name]))
            metrics = run_plan(d, steps=STEPS, warmup=1, timeout=300)
            ranks = json.loads((d / ".ranks" / "result.json").read_text())["ranks"]
            cache[name] = (metrics, sorted(ranks, key=lambda r: r["rank"]), inputs)
        return cache[name]
    return get


def buffers(rank: dict, pattern: str) -> int:
    """Bytes of the counted buffers whose label ("<location>.<role>:<where>") contains `pattern`."""
    return sum(v for k, v in rank["model_state_buffers"].items() if pattern in k)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_trains_like_plain_zero3(name: str, runs) -> None:
    metrics, ranks, _ = runs(name)
    ref = runs("zero3")[0]["loss"]
    loss = metrics["loss"]
    assert metrics["status"] == "ok" and len(loss) == STEPS and all(math.isfinite(x) for x in loss)
    assert loss[-1] < loss[0]
    diff = max(abs(a - b) for a, b in zip(loss, ref))
    print(f"\nLOSS | {name} | {' '.join(f'{x:.6f}' for x in loss)} | max |diff| to ZeRO-3 {diff:.1e}")
    assert diff < LOSS_TOL, (loss, ref)
    assert len(metrics["host_model_state_gb_per_rank"]) == len(ranks)
    for r in ranks:
        print(f"\nSTATES | {name} | rank {r['rank']} | device {r['model_state']} | host {r['host_model_state']}")
        for label, nbytes in sorted(r["model_state_buffers"].items()):
            if r["rank"] == 0:
                print(f"    {nbytes:>10} {label}")


@pytest.mark.parametrize("name", list(VARIANTS))
def test_states_are_where_deepspeed_keeps_them(name: str, runs) -> None:
    """Per rank, in bytes: psi = the model's parameters, part = psi / dp (ZeRO's partition)."""
    _, ranks, (_, _, _, plan) = runs(name)
    ref = runs("zero3")[1][0]
    for r in ranks:
        psi = r["local_params"]  # the whole model's elements (no TP here; ZeRO-3's ds_numel)
        part = psi / plan.dp
        dev, host = r["model_state"], r["host_model_state"]
        approx = lambda x: pytest.approx(x, rel=2e-3)  # noqa: E731 (ZeRO pads partitions to the DP size)
        if plan.offload_optimizer == "none":
            assert buffers(r, "host.grads:") == buffers(r, "host.optimizer:") == host["grads"] == host["optimizer"] == 0
            assert buffers(r, "device.optimizer:optimizer.optimizer.state[p][exp_avg") == approx(8 * part)
        else:
            # ZeRO-Offload: the fp32 master partition and its Adam moments live on the host, nothing of them on
            # the device; so does the fp32 gradient partition (the master's .grad)
            assert buffers(r, "device.optimizer:optimizer.optimizer.state") <= 8
            assert buffers(r, "host.optimizer:optimizer.optimizer.state[p][exp_avg") == approx(8 * part)
            master = "single_partition_of_fp32_groups[i]" if plan.zero < 3 else "fp32_partitioned_groups_flat[i]"
            assert buffers(r, f"host.optimizer:optimizer.{master}") == approx(4 * part)
            assert buffers(r, f"host.grads:optimizer.{master}.grad") == approx(4 * part)
            if plan.zero < 3:
                # the 16-bit staging copy of the partition; the device keeps full weights and a one-tensor buffer
                staging = "host.optimizer:optimizer.param_buffer_of_bit16_for_cpu_offload_groups"
                assert buffers(r, staging) == approx(E * part)
                assert dev["params"] == E * psi and dev["grads"] == 0
                assert buffers(r, "device.optimizer:optimizer.temp_grad_buffer_for_gpu_offload") > 0
                if plan.zero == 2 and plan.grad_accum > 1:  # per-parameter accumulators across micro-batches
                    assert buffers(r, "host.grads:optimizer.accumulated_grads_in_cpu") == approx(E * part)
            else:
                # ZeRO-3 allocates its gradient partition on its offload device: the host
                assert buffers(r, "host.grads:optimizer.grad_partitions_flat_buffer") == approx(E * part)
                # the device lost the master and moments (4 + 8 bytes per element) and the gradient partition (E)
                assert dev["optimizer"] == pytest.approx(ref["model_state"]["optimizer"] - 12 * part, abs=1024)
                assert dev["grads"] == pytest.approx(ref["model_state"]["grads"] - E * part, abs=1024)
        if plan.zero == 3:
            if plan.offload_params == "cpu":
                # only the persistent small weights, kept gathered, stay on the device
                assert dev["params"] == buffers(r, "device.params:persistent weights") and host["params"] == approx(E * part)
                assert dev["optimizer"] == ref["model_state"]["optimizer"]
            else:
                assert buffers(r, "device.params:module.ds_tensor") == approx(E * part)
            # the reduce bucket is a bucket, as the cost model names it (not optimizer state)
            assert buffers(r, "device.buckets:optimizer.ipg_buckets") == E * plan.bucket_elements
            assert dev["buckets"] >= E * plan.bucket_elements
        secondary = buffers(r, "device.params:module.ds_secondary_tensor")
        if plan.hpz > 1:  # hpZ: the weights partitioned again over the hpZ group (persistent small ones not)
            assert secondary == pytest.approx(E * psi / plan.hpz, rel=1e-2)
            assert dev["params"] == (buffers(r, "device.params:module.ds_tensor") + secondary
                                     + buffers(r, "device.params:persistent weights"))
        else:
            assert secondary == 0
        if plan.offload_params == "none":
            assert host["params"] == buffers(r, "host.params:") == 0


@pytest.mark.parametrize("name", list(VARIANTS))
def test_counted_states_match_the_cost_model(name: str, runs) -> None:
    """Model states per rank where they live, as counted tensor by tensor after backward,
    against the cost model's engine buffers of the step (planner.cost.engines.state_bytes):
    on the device and in host memory separately, each within 0.1% (AdamW's step counters
    and ZeRO's alignment padding are the only bytes the model leaves out)."""
    from planner.cost import engines, layer_costs
    model, cluster, train, plan = runs(name)[2]
    lc = layer_costs(model, cluster, train, plan)
    psi, small = lc.stage_psi(0, 1, model.layers)
    _, ranks, _ = runs(name)
    for where, key in (("device", "model_state"), ("host", "host_model_state")):
        predicted = engines.state_bytes(plan, psi, small, where, lc.largest)
        counted = max(sum(r[key].values()) for r in ranks)
        print(f"\nCOST | {name} | {where} | counted {counted} | predicted {predicted:.0f} | "
              f"{100 * (predicted - counted) / max(counted, 1):+.3f}%")
        assert predicted == pytest.approx(counted, rel=1e-3, abs=1024)


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unsupported_variant_is_refused_before_any_rank_starts(name: str, tmp_path: Path) -> None:
    kw, message = UNSUPPORTED[name]
    d, _ = write_run(tmp_path, name, make_plan(**kw))
    with pytest.raises(ExecutionError, match=message):
        run_plan(d, steps=2, warmup=0)
    assert not (d / ".ranks").exists()


def test_the_refusals_are_deepspeeds() -> None:
    """What the refusals stand on, checked against the installed DeepSpeed: the CPU accelerator
    has no quantizer op (qwZ: partition_parameters.py CUDAQuantizer at zero.Init; qgZ:
    coalesced_collectives.py all_to_all_quant_reduce at the first backward), and the config
    refuses MiCS's key."""
    deepspeed = pytest.importorskip("deepspeed")
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
    assert get_accelerator().device_name() == "cpu"
    with pytest.raises(ValueError, match="not been implemented on CPU backend"):
        deepspeed.ops.op_builder.QuantizerBuilder().load()
    assert not hasattr(deepspeed.zero, "MiCS_Init")
    cfg = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 3, "mics_shard_size": 2}}
    with pytest.raises(DeepSpeedConfigError, match="MiCS ZeRO-3 sharding has been removed"):
        DeepSpeedConfig(cfg)
