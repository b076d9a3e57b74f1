"""planner.dsconfig: the config DeepSpeed's own parser accepts, with nothing left to "auto"."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from planner import dsconfig
from planner.specs import Plan, TrainSpec, parse_cluster, preset, scale

os.environ.setdefault("DS_ACCELERATOR", "cpu")
deepspeed = pytest.importorskip("deepspeed")
from deepspeed.runtime.config import DeepSpeedConfig  # noqa: E402

MODEL = scale(preset("chatglm3-6b"), "tiny")


@pytest.fixture(scope="module", autouse=True)
def _one_process_group(tmp_path_factory):
    """DeepSpeed's parser asks torch.distributed for the rank before it asks the mpu."""
    import torch.distributed as dist
    if not dist.is_initialized():
        store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend="gloo")  # wraps the existing group
    yield
    dist.destroy_process_group()


class _Mpu:
    """Data-parallel size as DeepSpeed's config parser asks an mpu for it."""

    def __init__(self, dp: int) -> None:
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp


def _walk(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _walk(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _walk(v)
    else:
        yield obj


PLANS = [
    Plan(dp=2, zero=0, micro_batch=2, grad_accum=2, precision="fp32"),
    Plan(dp=2, zero=1, micro_batch=1, grad_accum=4, precision="bf16"),
    Plan(dp=2, zero=2, micro_batch=4, grad_accum=1, precision="bf16", bucket_elements=1_000_000),
    Plan(dp=2, zero=3, micro_batch=2, grad_accum=2, precision="bf16", recompute="full"),
    Plan(dp=1, pp=2, zero=1, micro_batch=1, grad_accum=8, stage_layers=(3, 1), precision="fp32"),
    Plan(dp=1, tp=2, zero=1, micro_batch=2, grad_accum=4, precision="bf16"),
    Plan(dp=2, tp=2, pp=2, zero=1, micro_batch=1, grad_accum=4, precision="bf16"),
    Plan(dp=2, tp=2, zero=3, micro_batch=1, grad_accum=2, precision="bf16"),
]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.describe())
@pytest.mark.parametrize("gpus", ["2xcpu", "2xA100"])
def test_deepspeed_parses_config(plan: Plan, gpus: str) -> None:
    cluster = parse_cluster(gpus)
    if cluster.device.kind == "cpu" and plan.precision == "fp16":
        pytest.skip("fp16 is not a CPU plan")
    train = TrainSpec(global_batch=plan.global_batch, seq_len=64, precision=plan.precision)
    cfg = dsconfig.ds_config(plan, MODEL, train, cluster)
    json.dumps(cfg)  # plain JSON
    assert "auto" not in [v for v in _walk(cfg) if isinstance(v, str)]
    parsed = DeepSpeedConfig(json.loads(json.dumps(cfg)), mpu=_Mpu(plan.dp))
    assert parsed.train_batch_size == plan.global_batch
    assert parsed.train_micro_batch_size_per_gpu == plan.micro_batch
    assert parsed.gradient_accumulation_steps == plan.grad_accum
    assert parsed.zero_optimization_stage == plan.zero
    assert parsed.zero_config.reduce_bucket_size == plan.bucket_elements
    assert parsed.zero_config.overlap_comm == plan.overlap_comm
    assert parsed.bfloat16_config.enabled == (plan.precision == "bf16")
    assert parsed.gradient_clipping == dsconfig.GRADIENT_CLIPPING
    if cluster.device.kind == "cpu":
        assert parsed.optimizer_name is None and parsed.zero_allow_untested_optimizer
    else:
        assert parsed.optimizer_name.lower() == "adamw"
    if plan.pp > 1:
        assert parsed.pipeline["stages"] == plan.pp
        assert cfg["pipeline"]["stage_layers"] == list(plan.layers_per_stage(MODEL.layers))
    # TP is the executor's own Megatron-style layers: DeepSpeed must not run AutoTP over them
    assert "tensor_parallel" not in cfg and parsed.tensor_parallel_config.autotp_size in (0, 1)


def test_zero3_settings_explicit() -> None:
    plan = Plan(dp=2, zero=3, micro_batch=1, grad_accum=1, bucket_elements=123_456)
    cfg = dsconfig.ds_config(plan, MODEL, TrainSpec(global_batch=2, seq_len=64), parse_cluster("2xcpu"))
    z = cfg["zero_optimization"]
    assert z["stage3_prefetch_bucket_size"] == 123_456
    assert z["stage3_param_persistence_threshold"] == 10 * MODEL.hidden
    assert z["allgather_bucket_size"] == 123_456


def test_hostfile_single_and_multi_node() -> None:
    assert dsconfig.hostfile(parse_cluster("8xA100")) is None
    text = dsconfig.hostfile(parse_cluster("3x8xA100"))
    assert [ln for ln in text.splitlines() if not ln.startswith("#")] == [
        "node-0 slots=8", "node-1 slots=8", "node-2 slots=8"]


def test_launch_script_is_valid_bash(tmp_path) -> None:
    plan = Plan(dp=2, zero=1, micro_batch=1, grad_accum=4)
    train = TrainSpec(global_batch=8, seq_len=64)
    cpu = dsconfig.launch_script(plan, MODEL, train, parse_cluster("2xcpu"), str(tmp_path))
    assert "DS_ACCELERATOR=cpu" in cpu and "--num_gpus 2" in cpu and "--hostfile" not in cpu
    assert f"--module {dsconfig.ENTRY_MODULE}" in cpu
    multi = dsconfig.launch_script(Plan(dp=16, zero=1, micro_batch=1, grad_accum=1), MODEL,
                                   TrainSpec(global_batch=16, seq_len=64), parse_cluster("2x8xA100"), "r")
    assert "--hostfile hostfile --num_nodes 2 --num_gpus 8" in multi and "DS_ACCELERATOR" not in multi
    for text in (cpu, multi):
        script = tmp_path / "launch.sh"
        script.write_text(text)
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_every_zero_variant_the_search_offers_is_accepted_as_written() -> None:
    """Each (stage, variant) of a multi-node GPU space with host and NVMe numbers: DeepSpeed's
    parser reads back the offload devices, ZeRO++ and MiCS settings and the buckets."""
    from planner.search.space import Space
    model = preset("glm-10b")
    cluster = parse_cluster("2x8xA100", nvme_gbps=20)
    space = Space(model=model, cluster=cluster, train=TrainSpec(global_batch=64, seq_len=1024))
    options = space.zero_options(1, 16)
    kinds = {(v.offload_optimizer, v.offload_params, v.hpz > 1, v.quantized_weights, v.mics_shard > 0)
             for _, v in options}
    assert len(kinds) == 8  # (overlap on or off counts once) plain, optimizer on cpu, both on cpu, optimizer on nvme, both on nvme, hpZ, ZeRO++, MiCS
    for zero, v in options:
        plan = Plan(dp=16, zero=zero, micro_batch=1, grad_accum=4, **v.plan_fields())
        if v.mics_shard:   # DeepSpeed 0.19.8 removed MiCS: the parser refuses it, so the search never picks it
            from deepspeed.runtime.config import DeepSpeedConfigError
            from planner.specs.validate import runtime_problems
            with pytest.raises(DeepSpeedConfigError, match="MiCS"):
                DeepSpeedConfig(dsconfig.ds_config(plan, model, TrainSpec(global_batch=64, seq_len=1024), cluster),
                                mpu=_Mpu(plan.dp))
            assert any("removed MiCS" in p.line for p in runtime_problems(plan))
            continue
        cfg = dsconfig.ds_config(plan, model, TrainSpec(global_batch=64, seq_len=1024), cluster)
        parsed = DeepSpeedConfig(json.loads(json.dumps(cfg)), mpu=_Mpu(plan.dp))
        z = parsed.zero_config
        assert parsed.zero_optimization_stage == zero and z.reduce_bucket_size == v.bucket_elements
        assert z.overlap_comm == v.overlap_comm
        opt = z.offload_optimizer.device if z.offload_optimizer else "none"
        assert str(getattr(opt, "value", opt)) == v.offload_optimizer
        par = z.offload_param.device if z.offload_param else "none"
        assert str(getattr(par, "value", par)) == v.offload_params
        if zero == 3:
            assert (z.zero_hpz_partition_size, z.zero_quantized_weights, z.zero_quantized_gradients) == (
                v.hpz, v.quantized_weights, v.quantized_gradients)
            assert z.prefetch_bucket_size == plan.prefetch and z.max_live_parameters == plan.live
