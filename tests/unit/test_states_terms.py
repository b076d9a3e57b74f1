"""The model states one rank holds when the executor counts them (planner/cost/states.py), on
the paths the executor tests do not reach (issue 19, mutation run): ZeRO-1's owned partition
under context parallelism, the experts' own ZeRO-1 partition, a tied MoE model, CPU offload's
device buffer of the largest tensor, and NVMe counted with host memory. No torch."""
import dataclasses

from planner.cost import engines, params
from planner.cost.model import layer_costs
from planner.cost.states import rank_states
from planner.specs import Plan, TrainSpec, parse_cluster, preset, scale

TINY = scale(preset("chatglm3-6b"), "tiny")          # 1,124,480 parameters, untied, V_pad x h = 1024 x 128
MOE = scale(preset("glm-4.5-air"), "tiny")           # 4 experts of 18,432 (SwiGLU 2 x 48 x 128 + 128 x 48), 3 MoE blocks
TRAIN = TrainSpec(global_batch=8, seq_len=128)


def test_zero1_owned_gradients_follow_the_dp_times_cp_rank_order():
    """ZeRO-1 over DP 2 x CP 2 is ZeRO-1 over 4 sequence-data-parallel ranks; the rank at
    (dp i, cp j) owns partition i x cp + j. fp32 gradients of the partitions measured on DP 4
    (planner.cost.params.zero1_owned): 291,328 / 381,568 / 375,808 / 297,088 elements."""
    plan = Plan(dp=2, cp=2, zero=1, micro_batch=1, grad_accum=2, precision="fp32")
    measured = (291_328, 381_568, 375_808, 297_088)
    for rank in range(4):
        c = plan.coords(rank)
        got = rank_states(TINY, parse_cluster("4xcpu"), TRAIN, plan, rank)["device"]
        assert got["grads"] == 4 * measured[c.dp * 2 + c.cp]


def test_expert_zero1_partition_is_over_the_expert_data_parallel_ranks():
    """EP 2 x DP 4 x CP 2, ZeRO-1 fp32: the dense group partitions over the 8 dp x cp ranks
    (index dp x 2 + cp), the experts over the 4 ranks holding the same experts (index
    (dp // ep) x 2 + cp); each rank keeps fp32 gradients of both owned partitions."""
    plan = Plan(dp=4, ep=2, cp=2, zero=1, micro_batch=1, grad_accum=2, precision="fp32")
    train = TrainSpec(global_batch=16, seq_len=32, precision="fp32")
    dense = (params.first_stage_tensors(MOE, 1).numels + params.block_tensors(MOE, 1).numels
             + params.moe_block_tensors(MOE, 1).numels * 3 + params.last_stage_tensors(MOE, 1, 1).numels)
    experts = (2 * 48 * 128, 128 * 48) * (2 * 3)        # 2 local experts x 3 MoE blocks
    d_owned, e_owned = params.zero1_owned(dense, 8), params.zero1_owned(experts, 4)
    assert len(set(e_owned)) > 1                         # the partitions differ: the index matters
    for rank in range(8):
        c = plan.coords(rank)
        got = rank_states(MOE, parse_cluster("8xcpu"), train, plan, rank)["device"]
        assert got["grads"] == 4 * (d_owned[c.dp * 2 + c.cp] + e_owned[(c.dp // 2) * 2 + c.cp])


def test_a_tied_moe_model_holds_its_output_layer_once():
    train = TrainSpec(global_batch=4, seq_len=32, precision="fp32")
    plan = Plan(dp=2, ep=2, micro_batch=1, grad_accum=2, precision="fp32")
    untied = rank_states(MOE, parse_cluster("2xcpu"), train, plan, 0)["device"]["params"]
    tied = rank_states(dataclasses.replace(MOE, tied_embeddings=True), parse_cluster("2xcpu"), train, plan,
                       0)["device"]["params"]
    assert untied - tied == 4 * 1024 * 128


def test_cpu_offload_keeps_one_largest_tensor_buffer_on_the_device():
    """ZeRO-2 with the optimizer on the CPU: gradients and optimizer states live on the host;
    the device keeps DeepSpeed's temp_grad_buffer_for_gpu_offload, one bf16 buffer the size of
    the largest parameter (the 1024 x 128 embedding)."""
    plan = Plan(dp=2, zero=2, offload_optimizer="cpu", micro_batch=1, grad_accum=2)
    got = rank_states(TINY, parse_cluster("2xcpu"), TRAIN, plan, 1)
    assert got["device"]["optimizer"] == 2 * 1024 * 128
    assert got["device"]["grads"] == 0.0 and got["host"]["grads"] > 0 and got["host"]["optimizer"] > 0


def test_a_moe_plan_keeps_one_offload_buffer_for_both_parameter_groups():
    """EP 2 x DP 2, ZeRO-2, optimizer on the CPU: DeepSpeed keeps one staging buffer per
    optimizer, the size of the largest tensor over all its parameter groups (stage_1_and_2.py
    __init__: largest_param_numel over bit16_groups), not one for the dense group and another
    for the experts: one bf16 buffer of the 1024 x 128 embedding (the largest; an expert's
    gate/up is 2 x 48 x 128)."""
    plan = Plan(dp=2, ep=2, zero=2, offload_optimizer="cpu", micro_batch=1, grad_accum=2)
    train = TrainSpec(global_batch=4, seq_len=32)
    for rank in range(2):
        got = rank_states(MOE, parse_cluster("2xcpu"), train, plan, rank)
        assert got["device"]["optimizer"] == 2 * 1024 * 128


def test_nvme_states_count_with_host_memory():
    plan = Plan(dp=2, zero=3, offload_optimizer="nvme", offload_params="nvme", micro_batch=1, grad_accum=2)
    lc = layer_costs(TINY, parse_cluster("2xcpu"), TRAIN, plan)
    psi, small = lc.stage_psi(0, 1, TINY.layers)
    on_host = engines.state_bytes(plan, psi, small, location="host", largest=lc.largest)
    on_nvme = engines.state_bytes(plan, psi, small, location="nvme", largest=lc.largest)
    assert on_host > 0 and on_nvme > 0
    got = rank_states(TINY, parse_cluster("2xcpu"), TRAIN, plan, 1)
    assert sum(got["host"].values()) == on_host + on_nvme
    assert sum(got["device"].values()) == engines.state_bytes(plan, psi, small, location="device", largest=lc.largest)


def test_expert_partition_index_counts_context_ranks_within_an_expert_group():
    """EP 4 x DP 16 x CP 2: the experts' ZeRO group has 8 ranks whose ZeRO-1 partitions differ
    (12,288 / 18,432 elements); the rank at (dp i, cp j) owns expert partition (i // 4) x 2 + j."""
    plan = Plan(dp=16, ep=4, cp=2, zero=1, micro_batch=1, grad_accum=1, precision="fp32")
    train = TrainSpec(global_batch=32, seq_len=32, precision="fp32")
    dense = (params.first_stage_tensors(MOE, 1).numels + params.block_tensors(MOE, 1).numels
             + params.moe_block_tensors(MOE, 1).numels * 3 + params.last_stage_tensors(MOE, 1, 1).numels)
    experts = (2 * 48 * 128, 128 * 48) * 3              # 1 local expert x 3 MoE blocks
    d_owned, e_owned = params.zero1_owned(dense, 32), params.zero1_owned(experts, 8)
    assert e_owned == (12288, 18432, 18432, 12288, 18432, 18432, 12288, 18432)
    for rank in range(32):
        c = plan.coords(rank)
        if c.cp != 1 or c.dp % 4:
            continue
        got = rank_states(MOE, parse_cluster("4x8xH100"), train, plan, rank)["device"]
        assert got["grads"] == 4 * (d_owned[c.dp * 2 + c.cp] + e_owned[(c.dp // 4) * 2 + c.cp])


def test_zero1_partitions_by_hand_with_padding_ranks():
    """One tensor of 10 elements over 8 ranks: the flat group pads to 16 (a multiple of 2 x 8),
    slices of 2; ranks 0-4 overlap the tensor and keep its whole gradient (10), ranks 5-7 hold
    only padding (2 each). Tensors of 6 and 4 over 4 ranks (slices of 4): 6, 6 + 4, 4 + 2 of
    padding, 4 of padding. No tensors: nothing."""
    assert params.zero1_owned((10,), 8) == (10, 10, 10, 10, 10, 2, 2, 2)
    assert params.zero1_owned((6, 4), 4) == (6, 10, 6, 4)
    assert params.zero1_owned((), 2) == (0, 0)


def test_the_offload_buffer_is_the_largest_tensor_over_every_group_experts_included():
    """An expert FFN of 4096 without shared experts makes a routed expert's gate/up (2 x 4096 x 128
    = 1,048,576 elements) the largest tensor, above the 1024 x 128 embedding: the estimate (LayerCosts.largest) and the
    counted states both size the one staging buffer by it (bf16: 2 bytes an element)."""
    big = dataclasses.replace(MOE, moe=dataclasses.replace(MOE.moe, expert_ffn=4096, shared_experts=0))
    plan = Plan(dp=2, ep=2, zero=2, offload_optimizer="cpu", micro_batch=1, grad_accum=2)
    train = TrainSpec(global_batch=4, seq_len=32)
    assert layer_costs(big, parse_cluster("2xcpu"), train, plan).largest == 2 * 4096 * 128
    got = rank_states(big, parse_cluster("2xcpu"), train, plan, 0)
    assert got["device"]["optimizer"] == 2 * (2 * 4096 * 128)
