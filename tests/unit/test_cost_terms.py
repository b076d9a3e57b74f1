"""Every term of the time and memory breakdowns, pinned to a value computed by hand.

One toy device with round numbers (GEMMs at a flat 1e13 FLOP/s, memory traffic at 1e12 B/s,
NVLink-like 1e11 B/s inside a node, 1e10 B/s per node between nodes, no latency), a
4-block model (h 64, 4 heads, FFN 256, vocabulary 999), sequence 128, micro-batch 1, on
2 nodes x 2 devices. Each expected value is the formula written out with these numbers, so
a term that is removed, halved, doubled or put on the wrong link (or group) fails.
"""
from __future__ import annotations

import dataclasses

import pytest

from planner.cost import estimate, layer_costs, params
from planner.cost.memory import block_activation_bytes
from planner.specs import ModelSpec, Plan, TrainSpec
from planner.specs.hardware import ClusterSpec, DeviceProfile, Link

INTRA, INTER = 1e11, 1e10          # bytes/s: intra-node link, one node's inter-node network
FLOPS, HBM = 1e13, 1e12            # bf16 peak 20 TFLOP/s at a flat 50% GEMM efficiency; HBM 1000 GB/s
STEP_OVERHEAD, MB_OVERHEAD = 0.01, 0.001
FRAG, FIXED = 0.1, 1e9

DEVICE = DeviceProfile(
    name="toy", kind="gpu", memory_gb=80, peak_tflops={"bf16": 20, "fp16": 20, "fp32": 10},
    hbm_bandwidth_gbps=1000, gemm_efficiency=((1.0, 0.5), (1e30, 0.5)), gpus_per_node=2,
    intra_node=Link(name="intra", busbw_gbps=100, latency_us=0), inter_node=Link(name="inter", busbw_gbps=10, latency_us=0),
    factors={"dp_overlap": 0.5, "step_overhead_s": STEP_OVERHEAD, "microbatch_overhead_s": MB_OVERHEAD,
             "memory_overhead_gb": 1.0, "memory_fragmentation": FRAG})
MODEL = ModelSpec(name="toy", hidden=64, layers=4, heads=4, ffn_hidden=256, activation="gelu", vocab=999,
                  max_seq=128, norm="layernorm", norm_position="pre", position="rotary")


def cluster(nodes: int = 2, per_node: int = 2, device: DeviceProfile = DEVICE) -> ClusterSpec:
    return ClusterSpec(nodes=nodes, gpus_per_node=per_node, device=device, intra_node=device.intra_node,
                       inter_node=device.inter_node)


def train(plan: Plan, **kw) -> TrainSpec:
    return TrainSpec(global_batch=plan.global_batch, seq_len=kw.pop("seq_len", 128), **kw)


def run(plan: Plan, model: ModelSpec = MODEL, c: ClusterSpec | None = None, **train_kw):
    c = c or cluster()
    est = estimate(model, c, train(plan, **train_kw), plan)
    assert not [r for r in est.reasons if "needs" not in r], est.reasons
    return est


# --- hand-computed pieces (bf16, s = 128, b = 1) -------------------------------------------
# parameters per device (planner/cost/params.py; the contract's TP split)
BLOCK_T1 = 256 + 64 * 192 + 192 + 64 * 64 + 64 + 64 * 256 + 256 + 256 * 64 + 64           # 49,984
BLOCK_T2 = 256 + 64 * 192 // 2 + 96 + 64 * 64 // 2 + 64 + 64 * 256 // 2 + 128 + 256 * 64 // 2 + 64  # 25,184
EMB_T1, EMB_T2 = 999 * 64, 1000 * 64 // 2          # vocabulary padded to 1000 for TP 2
HEAD_T1, HEAD_T2 = 128 + EMB_T1, 128 + EMB_T2      # final LayerNorm + output layer
PSI_TP2 = 4 * BLOCK_T2 + EMB_T2 + HEAD_T2          # 164,864
PSI_T1 = 4 * BLOCK_T1 + EMB_T1 + HEAD_T1           # 327,936

# one block, TP 2: GEMMs (QKV, out, FFN in, FFN out), attention core, element-wise
GEMM_T2 = 2 * 128 * 64 * (192 + 64 + 256 + 256) / 2 / FLOPS
CORE_T2 = 2 * 2 * 128 * 128 * 64 / 2 / FLOPS
ELEM_T2 = (128 * 64 * (8 * 2) + 128 * 2 * (192 * 2 + 512 * 2) / 2) / HBM  # norms+adds; rotary+GELU
F_T2 = GEMM_T2 + CORE_T2 + ELEM_T2
FLASH_RECOMPUTE_T2 = 2 * 128 * 128 * 64 / 2 / FLOPS                       # QK^T again in backward
B_T2 = 2 * (GEMM_T2 + CORE_T2) + FLASH_RECOMPUTE_T2 + 2 * ELEM_T2
AR_T2 = 128 * 64 * 2 * 2 * (1 / 2) / INTRA                                # one all-reduce of b s h over TP 2
# one block, TP 1
GEMM_T1, CORE_T1 = 2 * GEMM_T2, 2 * CORE_T2
ELEM_T1 = (128 * 64 * 16 + 128 * 2 * (384 + 1024)) / HBM
F_T1 = GEMM_T1 + CORE_T1 + ELEM_T1
B_T1 = 2 * (GEMM_T1 + CORE_T1) + 2 * FLASH_RECOMPUTE_T2 + 2 * ELEM_T1
# embedding (first stage) and output layer + loss (last stage), compute only
FIRST_C = 3 * 2 * 128 * 64 * 2 / HBM


def last_c(vocab_local: int) -> float:
    return 3 * 2 * 128 * 64 * vocab_local / FLOPS + (3 * 128 * vocab_local * (2 + 8) + 6 * 128 * 64 * 2) / HBM


CE_AR_T2 = 3 * (128 * 4 * 2 * (1 / 2) / INTRA)                           # three fp32 all-reduces of b s


def tp2dp2(**kw) -> Plan:
    """TP 2 inside each node, DP 2 across the two nodes."""
    return Plan(**{**dict(dp=2, tp=2, zero=0, micro_batch=1, grad_accum=2), **kw})


# --- time terms ----------------------------------------------------------------------------
def test_forward_backward_and_tp_comm_of_a_tp_plan():
    t = run(tp2dp2()).time
    lc2 = last_c(500)
    assert t.forward == pytest.approx(2 * (4 * F_T2 + (FIRST_C + lc2) / 3), rel=1e-12, abs=0)
    assert t.backward == pytest.approx(2 * (4 * B_T2 + 2 * (FIRST_C + lc2) / 3), rel=1e-12, abs=0)
    # 2 + 2 all-reduces per block; embedding forward 1; output layer backward 1 + 3 small CE ones
    assert t.tp_comm == pytest.approx(2 * (4 * 4 * AR_T2 + AR_T2 + AR_T2 + CE_AR_T2), rel=1e-12, abs=0)
    assert t.recompute == 0 and t.pp_comm == 0 and t.bubble == 0 and t.zero_gather == 0


def test_eager_attention_has_no_recomputed_scores_but_pays_the_softmax_traffic():
    t = run(tp2dp2(), attention="eager").time
    softmax = 4 * 128 * 128 * (2 * 2) / 2 / HBM                           # read + write the scores, heads/t
    b = 2 * (GEMM_T2 + CORE_T2) + 2 * (ELEM_T2 + softmax)
    assert t.backward == pytest.approx(2 * (4 * b + 2 * (FIRST_C + last_c(500)) / 3), rel=1e-12, abs=0)
    assert t.forward == pytest.approx(2 * (4 * (F_T2 + softmax) + (FIRST_C + last_c(500)) / 3), rel=1e-12, abs=0)


def test_dropout_costs_time_only_where_it_runs():
    drop = dataclasses.replace(MODEL, hidden_dropout=0.1, attention_dropout=0.1)
    flash = run(tp2dp2(), drop).time
    hidden = 128 * 64 * 2 * (2 * 2 + 1) / HBM                             # two dropouts: read, write, mask
    assert flash.forward == pytest.approx(2 * (4 * (F_T2 + hidden) + (FIRST_C + last_c(500)) / 3), rel=1e-12, abs=0)
    eager = run(tp2dp2(), drop, attention="eager").time
    scores = 4 * 128 * 128 * (2 * 2 + 2 * 2 + 1) / 2 / HBM               # softmax + attention dropout
    assert eager.forward == pytest.approx(2 * (4 * (F_T2 + hidden + scores) + (FIRST_C + last_c(500)) / 3),
                                          rel=1e-12, abs=0)


def test_full_and_selective_recompute():
    full = run(tp2dp2(recompute="full")).time
    assert full.recompute == pytest.approx(2 * 4 * (F_T2 + 2 * AR_T2), rel=1e-12, abs=0)   # forward + its 2 all-reduces
    sel = run(tp2dp2(recompute="selective"), attention="eager").time
    softmax = 4 * 128 * 128 * 4 / 2 / HBM
    assert sel.recompute == pytest.approx(2 * 4 * (CORE_T2 + softmax), rel=1e-12, abs=0)


def test_dp_sync_rides_the_inter_node_network_shared_by_both_dp_groups():
    # DP groups {0, 2} and {1, 3} both cross the two nodes: each gets 1/2 of 1e10 B/s.
    # FP16_Optimizer (bf16, ZeRO-0): one all-reduce of the bf16 gradients after backward.
    t = run(tp2dp2()).time
    assert t.dp_sync == pytest.approx(PSI_TP2 * 2 * 2 * (1 / 2) / (INTER / 2), rel=1e-12, abs=0)
    # on one node of 4 the same groups ride the intra-node link
    one = run(tp2dp2(), c=cluster(1, 4)).time
    assert one.dp_sync == pytest.approx(PSI_TP2 * 2 * 2 * (1 / 2) / INTRA, rel=1e-12, abs=0)


def test_zero1_reduce_scatter_hides_behind_the_last_backward_and_all_gather_does_not():
    plan = Plan(dp=4, zero=1, micro_batch=1, grad_accum=2, bucket_elements=1000)
    t = run(plan).time
    # DP 4 over 2 nodes x 2: each node's network carries one group with 2 members -> 1e10 B/s
    rs = ag = PSI_T1 * 2 * (3 / 4) / INTER
    window = 4 * B_T1
    assert t.dp_sync == pytest.approx(rs - 0.5 * min(rs, window) + ag, rel=1e-12, abs=0)
    no_overlap = run(dataclasses.replace(plan, overlap_comm=False)).time
    assert no_overlap.dp_sync == pytest.approx(rs + ag, rel=1e-12, abs=0)


def test_zero2_reduces_every_micro_batch():
    plan = Plan(dp=4, zero=2, micro_batch=1, grad_accum=2, bucket_elements=1000)
    rs = ag = PSI_T1 * 2 * (3 / 4) / INTER
    assert run(plan).time.dp_sync == pytest.approx(2 * 0.5 * rs + ag, rel=1e-12, abs=0)   # window: a whole micro-batch
    assert run(dataclasses.replace(plan, overlap_comm=False)).time.dp_sync == pytest.approx(2 * rs + ag, rel=1e-12, abs=0)


def test_zero3_gathers_per_tensor_and_hides_behind_each_units_compute():
    # DP 4 over 2 nodes: the group's link is one node's network (INTER). Persistent below
    # 10 x 64 = 640 elements: norms and biases stay whole; fetched: QKV 12,288, out 4,096,
    # FFN in 16,384, FFN out 16,384 per block, the embedding and the output layer 63,936 each.
    plan = Plan(dp=4, zero=3, micro_batch=1, grad_accum=2, bucket_elements=1000, overlap_comm=False)
    ag = 2 * (3 / 4) / INTER                                  # seconds per fetched element (bf16, ring)
    block_g, emb_g = 49_152 * ag, 63_936 * ag
    per_elem_rs = ag                                          # 328 buckets of the whole model, same volume
    units = [(emb_g, FIRST_C / 3, 2 * FIRST_C / 3, 63_936), (block_g, F_T1, B_T1, BLOCK_T1),
             (block_g, F_T1, B_T1, BLOCK_T1), (block_g, F_T1, B_T1, BLOCK_T1), (block_g, F_T1, B_T1, BLOCK_T1),
             (emb_g, last_c(999) / 3, 2 * last_c(999) / 3, HEAD_T1)]
    gather = sync = 0.0
    for g, fw, bw, elements in units:
        r = elements * per_elem_rs
        exposed_b = g + r - min(g, 0.5 * bw)                  # overlap_comm off: only the prefetched gather hides
        gather += g - min(g, 0.5 * fw) + exposed_b * g / (g + r)
        sync += exposed_b * r / (g + r)
    t = run(plan).time
    assert t.zero_gather == pytest.approx(2 * gather, rel=1e-12, abs=0)      # two micro-batches
    assert t.dp_sync == pytest.approx(2 * sync, rel=1e-12, abs=0)
    on = run(dataclasses.replace(plan, overlap_comm=True)).time              # the reduce-scatters hide too
    gather_on = sync_on = 0.0
    for g, fw, bw, elements in units:
        r = elements * per_elem_rs
        exposed_b = g + r - min(g + r, 0.5 * bw)
        gather_on += g - min(g, 0.5 * fw) + exposed_b * g / (g + r)
        sync_on += exposed_b * r / (g + r)
    assert on.zero_gather == pytest.approx(2 * gather_on, rel=1e-12, abs=0)
    assert on.dp_sync == pytest.approx(2 * sync_on, rel=1e-12, abs=0)


def test_bf16_pipeline_all_reduces_and_all_gathers_over_dp():
    # PP 2 x DP 2: stage 0 on node 0, stage 1 on node 1; DP groups inside a node.
    # BF16_Optimizer: all-reduce of the bf16 gradients + all-gather of the updated bf16 weights.
    plan = Plan(dp=2, pp=2, zero=0, micro_batch=1, grad_accum=4)
    t = run(plan).time
    psi_last = 2 * BLOCK_T1 + HEAD_T1
    assert t.dp_sync == pytest.approx(psi_last * 2 * (2 * (1 / 2) + (1 / 2)) / INTRA, rel=1e-12, abs=0)
    # ... and it updates only its half of the parameters (30 bytes per parameter, memory-bound)
    assert t.optimizer == pytest.approx(psi_last / 2 * 30 / HBM, rel=1e-12, abs=0)


def test_optimizer_time_per_engine():
    assert run(tp2dp2()).time.optimizer == pytest.approx(PSI_TP2 * 30 / HBM, rel=1e-12, abs=0)          # whole
    assert run(tp2dp2(precision="fp32")).time.optimizer == pytest.approx(PSI_TP2 * 28 / HBM, rel=1e-12, abs=0)
    z1 = Plan(dp=4, zero=1, micro_batch=1, grad_accum=2, bucket_elements=1000)
    assert run(z1).time.optimizer == pytest.approx(PSI_T1 / 4 * 30 / HBM, rel=1e-12, abs=0)             # sharded


def test_pipeline_p2p_crosses_nodes_with_one_device_share_of_the_network():
    plan = Plan(dp=2, pp=2, zero=1, micro_batch=1, grad_accum=4, bucket_elements=1000)
    t = run(plan).time
    p2p = 2 * 128 * 64 * 2 / (INTER / 2)                                  # activation + gradient, 1/2 of a node's network
    assert t.pp_comm == pytest.approx(4 * p2p, rel=1e-12, abs=0)
    stage0 = 2 * (F_T1 + B_T1) + FIRST_C + MB_OVERHEAD                    # the faster stage fills/drains the pipe
    assert t.bubble == pytest.approx(stage0 + p2p, rel=1e-12, abs=0)
    # the same plan on one node of 4: the boundary stays inside the node
    inside = run(plan, c=cluster(1, 4)).time
    assert inside.pp_comm == pytest.approx(4 * 2 * 128 * 64 * 2 / INTRA, rel=1e-12, abs=0)


def test_overhead_is_per_step_plus_per_micro_batch():
    assert run(tp2dp2()).time.overhead == pytest.approx(STEP_OVERHEAD + 2 * MB_OVERHEAD, rel=1e-12, abs=0)


def test_step_time_adds_every_term_and_hfu_counts_flash_recompute():
    plan = tp2dp2()
    est = run(plan)
    t = est.time
    assert est.step_time_s == pytest.approx(t.forward + t.backward + t.tp_comm + t.dp_sync + t.optimizer + t.overhead)
    # model FLOPs per sequence (72 B s l h^2-style count from the real shapes) vs hardware FLOPs
    model = 3 * (4 * 2 * 128 * 64 * (192 + 64 + 256 + 256) + 4 * 2 * 2 * 128 * 128 * 64 + 2 * 128 * 64 * 999)
    hardware = model + 4 * 2 * 128 * 128 * 64 + 3 * 2 * 128 * 64 * 1 * 1    # flash's QK^T; one padded vocab column
    assert est.model_flops_per_step == pytest.approx(4 * model, rel=1e-12, abs=0)
    assert est.hardware_flops_per_step == pytest.approx(4 * hardware, rel=1e-12, abs=0)
    eager = run(plan, attention="eager")
    assert eager.hardware_flops_per_step == pytest.approx(4 * (model + 3 * 2 * 128 * 64), rel=1e-12, abs=0)


# --- memory terms --------------------------------------------------------------------------
# outside the blocks (docs/runtime.md; b 1, s 128, h 64, bf16): the embedding keeps its int64
# ids (+ 1-byte out-of-shard flags at TP 2); the blocks share the SDPA mask (b 1 s s, bf16) and
# rotary cos/sin (fp32 b s 4 each: d 16, 8 rotary dims); the last stage keeps the final
# LayerNorm's input and mean/rstd, the output layer's input, the fp32 softmax over V_pad/t, the
# loss's flags (bool), targets (int64), weights (fp32) and count, and briefly the bf16 logits
EMB_T1, EMB_T2_ACTS = 128 * 8, 128 * (8 + 1)
SHARED = 2 * 128 * 128 + 2 * 4 * 128 * 4                                  # mask + cos/sin


def head(v_local: int, e: int = 2) -> int:
    return e * 128 * 64 * 2 + 2 * e * 128 + 4 * 128 * v_local + (1 + 8 + 4) * 128 + 4 + e * 128 * v_local


def _acts_per_block(plan: Plan, kernel: str = "flash") -> float:
    """Per-block activation bytes (their formula is pinned by hand in test_cost_activations.py)."""
    return block_activation_bytes(MODEL, 128, 1, plan.tp, sequence_parallel=plan.sequence_parallel,
                                  recompute="none", act_bytes=2.0, kernel=kernel)


def test_fp16_optimizer_memory_terms():
    plan = tp2dp2()
    mem = run(plan).stage_memory[0]
    assert (mem.params, mem.grads, mem.optimizer) == (2 * PSI_TP2, 2 * PSI_TP2, 12 * PSI_TP2)
    acts = 1 * (4 * _acts_per_block(plan) + EMB_T2_ACTS)                   # one micro-batch in flight + embedding
    assert mem.activations == pytest.approx(acts, rel=1e-12, abs=0)
    logits = head(500) + SHARED                                            # V_pad / t columns; the stage's shared set
    assert mem.logits == pytest.approx(logits, rel=1e-12, abs=0)
    assert mem.buckets == 2 * PSI_TP2                                      # ZeRO-0's flat all-reduce copy
    assert mem.overhead == pytest.approx(FIXED + FRAG * (acts + logits + 2 * PSI_TP2), rel=1e-12, abs=0)


def test_the_optimizer_step_phase_sets_the_peak_when_it_is_larger():
    # sequence 8: tiny activations; FP16_Optimizer's fp32 gradient copy (4 bytes/param) dominates
    plan = tp2dp2()
    mem = run(plan, seq_len=8).stage_memory[0]
    step = 4 * PSI_TP2
    assert mem.activations + mem.logits + mem.buckets == pytest.approx(step, rel=1e-12, abs=0)
    assert mem.buckets > 2 * PSI_TP2


RANK0_OWNED = 999 * 64 + 64 + 64 + 64 * 192 + 192 + 64 * 64 + 64 + 64 + 64 + 64 * 256  # 97,216
"""ZeRO-1 over DP 4: PSI_T1 = 327,936 (a multiple of 2 x 4) splits into partitions of 81,984;
rank 0's [0, 81,984) holds the embedding (63,936) and block 0 up to its FFN input weight, which
starts at 80,832 and ends at 97,216: the whole gradient of each of those tensors stays alive."""


def test_zero1_keeps_the_whole_gradients_of_the_tensors_overlapping_its_partition():
    numels = params.stage_tensors(MODEL, 1, 1, 0, 4).numels
    owned = params.zero1_owned(numels, 4)
    assert owned[0] == RANK0_OWNED == 97_216
    # rank 3's [245,952, 327,936): from block 3's FFN input weight (starting at 229,824) to the end
    assert owned[3] == PSI_T1 - (999 * 64 + 3 * BLOCK_T1 + 64 + 64 + 64 * 192 + 192 + 64 * 64 + 64 + 64 + 64)
    # 3 elements padded to 4 over DP 2: rank 1's slice [2, 4) overlaps the tensor and the zero pad
    assert params.zero1_owned((3,), 2) == (3, 4)
    assert params.zero1_owned((2, 2), 2) == (2, 2) and params.zero1_owned((1, 2, 1), 2) == (3, 3)


def test_zero1_memory_terms():
    plan = Plan(dp=4, zero=1, micro_batch=1, grad_accum=2, bucket_elements=1000)
    mem = run(plan).stage_memory[0]
    assert mem.params == 2 * PSI_T1
    assert mem.grads == 2 * PSI_T1 + 2 * RANK0_OWNED          # full p.grad in backward + the owned gradients
    assert mem.optimizer == 12 * PSI_T1 / 4
    assert mem.buckets == 2 * 2 * 1000                       # two reduce buckets (overlap_comm)


def test_zero2_and_zero3_memory_terms():
    z2 = run(Plan(dp=4, zero=2, micro_batch=1, grad_accum=2, bucket_elements=1000)).stage_memory[0]
    # ZeRO-2's grads_in_partition holds the whole gradients of the tensors overlapping the
    # partition (copy_grads_in_partition sums numel() over params_in_partition): ZeRO-1's owned
    # count on the worst rank (rank 0: 97,216 elements > psi / 4 = 81,984), not psi / dp
    assert (z2.params, z2.grads, z2.optimizer) == (2 * PSI_T1, 2 * RANK0_OWNED, 12 * PSI_T1 / 4)
    z3 = run(Plan(dp=4, zero=3, micro_batch=1, grad_accum=2, bucket_elements=1000)).stage_memory[0]
    small = 4 * (64 * 4 + 192 + 64 + 256 + 64) + 128          # tensors of <= 10 h elements stay gathered
    assert z3.params == 2 * PSI_T1 / 4 + 2 * small
    assert (z3.grads, z3.optimizer) == (2 * PSI_T1 / 4, 12 * PSI_T1 / 4)
    assert z3.buckets == 2 * 1000 + 2 * 1000                 # reduce bucket + gathered weights (max live)


def test_bf16_optimizer_memory_shards_masters_over_dp():
    plan = Plan(dp=2, pp=2, zero=0, micro_batch=1, grad_accum=4)
    last = run(plan).stage_memory[1]
    psi = 2 * BLOCK_T1 + HEAD_T1
    assert (last.params, last.grads, last.optimizer) == (2 * psi, 2 * psi + 2 * psi, 12 * psi / 2)
    # DeepSpeed's pipeline buffers: the message (bf16 b s h, int64 positions and segments) received
    # per micro-batch in flight and in the receive buffer; labels in 2 pipe buffers; the previous
    # micro-batch's logits, kept in pipe_buffers["outputs"]
    message = 128 * 64 * 2 + 2 * 8 * 128
    assert last.logits == pytest.approx(head(999) + SHARED + 2 * message + 2 * 8 * 128 + 2 * 128 * 999,
                                        rel=1e-12, abs=0)
    first = run(plan).stage_memory[0]
    assert first.logits == 0
    # 1F1B: stage 0 holds p = 2 micro-batches in flight, stage 1 one; stage 0 also keeps each one's
    # output message, its gradient buffer and the loaded ids/positions/segments of 2 pipe buffers
    act1 = block_activation_bytes(MODEL, 128, 1, 1, sequence_parallel=False, recompute="none", act_bytes=2.0,
                                  kernel="flash")
    want = 2 * (2 * act1 + EMB_T1 + SHARED + message) + 128 * 64 * 2 + 2 * 3 * 8 * 128
    assert first.activations == pytest.approx(want, rel=1e-12, abs=0)
    assert last.activations == pytest.approx(1 * 2 * act1, rel=1e-12, abs=0)


def test_full_recompute_keeps_block_inputs_and_one_working_block():
    plan = tp2dp2(recompute="full")
    mem = run(plan).stage_memory[0]
    kept = 128 * 64 * 2                                       # each checkpointed block keeps its input
    # one block recomputed at a time: its tensors besides its input, the mask and cos/sin it
    # rebuilds, and the position/segment ids the checkpoints hold
    work = _acts_per_block(plan) - kept + SHARED + 2 * 8 * 128
    assert mem.activations == pytest.approx(4 * kept + EMB_T2_ACTS + work, rel=1e-12, abs=0)


def test_layer_costs_carry_the_exact_parameter_split():
    lc = layer_costs(MODEL, cluster(), train(tp2dp2()), tp2dp2())
    assert (lc.block_psi, lc.first_stage_psi, lc.last_stage_psi) == (BLOCK_T2, EMB_T2, HEAD_T2)


# --- the same terms with non-unit runtime factors, fp32, bigger micro-batches ---------------
SCALED = dataclasses.replace(DEVICE, factors={**DEVICE.factors, "compute_scale": 2.0, "attention_scale": 3.0,
                                              "elementwise_scale": 4.0, "comm_efficiency": 0.5,
                                              "optimizer_scale": 5.0, "activation_scale": 1.5})


def test_every_runtime_factor_scales_its_own_term():
    est = run(tp2dp2(), c=cluster(device=SCALED))
    t = est.time
    f = GEMM_T2 * 2 + CORE_T2 * 3 + ELEM_T2 * 4
    b = 2 * (GEMM_T2 * 2 + CORE_T2 * 3) + FLASH_RECOMPUTE_T2 * 3 + 2 * ELEM_T2 * 4
    first = FIRST_C * 4
    last = 3 * 2 * 128 * 64 * 500 / FLOPS * 2 + (3 * 128 * 500 * 10 + 6 * 128 * 64 * 2) / HBM * 4
    assert t.forward == pytest.approx(2 * (4 * f + (first + last) / 3), rel=1e-12, abs=0)
    assert t.backward == pytest.approx(2 * (4 * b + 2 * (first + last) / 3), rel=1e-12, abs=0)
    assert t.tp_comm == pytest.approx(2 * (18 * AR_T2 + CE_AR_T2) / 0.5, rel=1e-12, abs=0)
    assert t.dp_sync == pytest.approx(PSI_TP2 * 2 * 2 * (1 / 2) / (INTER / 2) / 0.5, rel=1e-12, abs=0)
    assert t.optimizer == pytest.approx(PSI_TP2 * 30 / HBM * 5, rel=1e-12, abs=0)
    acts = 4 * _acts_per_block(tp2dp2()) * 1.5 + EMB_T2_ACTS
    assert est.stage_memory[0].activations == pytest.approx(acts, rel=1e-12, abs=0)


def test_fp32_doubles_every_activation_and_message_byte():
    est = run(tp2dp2(precision="fp32"))
    t = est.time
    last = 2 * 3 * 2 * 128 * 64 * 500 / FLOPS + (3 * 128 * 500 * (4 + 8) + 6 * 128 * 64 * 4) / HBM
    assert t.forward == pytest.approx(2 * (4 * 2 * F_T2 + (2 * FIRST_C + last) / 3), rel=1e-12, abs=0)
    assert t.tp_comm == pytest.approx(2 * (18 * 2 * AR_T2 + CE_AR_T2), rel=1e-12, abs=0)
    assert t.dp_sync == pytest.approx(PSI_TP2 * 4 * 2 * (1 / 2) / (INTER / 2), rel=1e-12, abs=0)   # bare AdamW: after backward
    mem = est.stage_memory[0]
    assert (mem.params, mem.grads, mem.optimizer, mem.buckets) == (4 * PSI_TP2, 4 * PSI_TP2, 8 * PSI_TP2, 4 * PSI_TP2)
    assert mem.logits == pytest.approx(head(500, e=4) + 4 * 128 * 128 + 2 * 4 * 128 * 4, rel=1e-12, abs=0)


def test_a_bigger_micro_batch_scales_tokens_and_messages():
    t = run(tp2dp2(micro_batch=2, grad_accum=1)).time
    assert t.forward == pytest.approx(1 * (4 * 2 * F_T2 + 2 * (FIRST_C + last_c(500)) / 3), rel=1e-12, abs=0)
    assert t.tp_comm == pytest.approx(1 * 2 * (18 * AR_T2 + CE_AR_T2), rel=1e-12, abs=0)


def test_sequence_parallel_shards_norms_and_the_pipeline_message():
    plan = Plan(tp=2, pp=2, micro_batch=1, grad_accum=4, sequence_parallel=True)
    t = run(plan).time                                                  # stage 1 (node 1) is the slowest
    f = GEMM_T2 + CORE_T2 + (128 * 64 * 16 / 2 + 128 * 2 * 1408 / 2) / HBM
    assert t.forward == pytest.approx(4 * (2 * f + last_c(500) / 3), rel=1e-12, abs=0)
    p2p = 2 * (128 * 64 * 2 / 2) / (INTER / 2)                          # b s h / t under SP
    assert t.pp_comm == pytest.approx(4 * p2p, rel=1e-12, abs=0)
    assert t.dp_sync == 0 and t.zero_gather == 0                        # no data parallelism


def test_interleaving_sends_v_times_per_micro_batch():
    plan = Plan(dp=2, pp=2, zero=1, micro_batch=1, grad_accum=4, schedule="interleaved", interleave=2,
                bucket_elements=1000)
    est = run(plan)
    p2p = 2 * 128 * 64 * 2 / (INTER / 2)
    assert est.time.pp_comm == pytest.approx(4 * 2 * p2p, rel=1e-12, abs=0)
    stage0 = 2 * (F_T1 + B_T1) + FIRST_C + MB_OVERHEAD
    assert est.time.bubble == pytest.approx(stage0 / 2 + p2p, rel=1e-12, abs=0)
    assert est.bubble_fraction == 1 / (2 * 4)


def test_the_slowest_stage_owns_the_breakdown_and_each_stage_splits_forward_and_backward():
    plan = Plan(dp=2, pp=2, zero=1, micro_batch=1, grad_accum=4, bucket_elements=1000)
    est = run(plan)
    last = last_c(999)
    assert est.time.forward == pytest.approx(4 * (2 * F_T1 + last / 3), rel=1e-12, abs=0)          # the last stage
    assert est.time.backward == pytest.approx(4 * (2 * B_T1 + 2 * last / 3), rel=1e-12, abs=0)
    assert est.time.tp_comm == 0 and est.time.recompute == 0
    (f0, b0), (f1, b1) = est.stage_times
    assert f0 == pytest.approx(2 * F_T1 + FIRST_C / 3, rel=1e-12, abs=0)
    assert b0 == pytest.approx(2 * B_T1 + 2 * FIRST_C / 3 + MB_OVERHEAD, rel=1e-12, abs=0)
    assert f1 == pytest.approx(2 * F_T1 + last / 3, rel=1e-12, abs=0)
    assert b1 == pytest.approx(2 * B_T1 + 2 * last / 3 + MB_OVERHEAD, rel=1e-12, abs=0)


def test_selective_recompute_lengthens_the_stage():
    est = run(tp2dp2(recompute="selective"), attention="eager")
    softmax = 4 * 128 * 128 * 4 / 2 / HBM
    f = F_T2 + softmax
    b = 2 * (GEMM_T2 + CORE_T2) + 2 * (ELEM_T2 + softmax)
    first, last = FIRST_C + AR_T2, last_c(500) + AR_T2 + CE_AR_T2
    fw = 4 * (f + 2 * AR_T2) + (first + last) / 3
    total = 4 * (f + b + 4 * AR_T2 + CORE_T2 + softmax) + first + last + MB_OVERHEAD
    (f0, b0), = est.stage_times
    assert f0 == pytest.approx(fw, rel=1e-12, abs=0) and b0 == pytest.approx(total - fw, rel=1e-12, abs=0)


def test_throughput_and_utilisation_figures():
    est = run(tp2dp2())
    step = est.step_time_s
    model = 3 * (4 * 2 * 128 * 64 * (192 + 64 + 256 + 256) + 4 * 2 * 2 * 128 * 128 * 64 + 2 * 128 * 64 * 999)
    hardware = model + 4 * 2 * 128 * 128 * 64 + 3 * 2 * 128 * 64
    assert est.tokens_per_s == pytest.approx(4 * 128 / step, rel=1e-12, abs=0)
    assert est.tflops_per_gpu == pytest.approx(4 * model / (step * 4) / 1e12, rel=1e-12, abs=0)
    assert est.mfu == pytest.approx(4 * model / (step * 4 * 20e12), rel=1e-12, abs=0)
    assert est.hfu == pytest.approx(4 * hardware / (step * 4 * 20e12), rel=1e-12, abs=0)
    assert est.capacity_bytes == 80e9 and est.bubble_fraction == 0


def test_recompute_counts_as_hardware_flops():
    block = 2 * 128 * 64 * (192 + 64 + 256 + 256) + 2 * 2 * 128 * 128 * 64     # one block's forward, t = 1
    model = 3 * (4 * block + 2 * 128 * 64 * 999)
    pad, flash = 3 * 2 * 128 * 64, 4 * 2 * 128 * 128 * 64
    full = run(tp2dp2(recompute="full"))
    assert full.hardware_flops_per_step == pytest.approx(4 * (model + 4 * block + flash + pad), rel=1e-12, abs=0)
    sel = run(tp2dp2(recompute="selective"), attention="eager")
    assert sel.hardware_flops_per_step == pytest.approx(4 * (model + 4 * 2 * 2 * 128 * 128 * 64 + pad), rel=1e-12, abs=0)


def test_zero1_hides_its_reduce_scatter_behind_backward_and_tp():
    plan = tp2dp2(zero=1, bucket_elements=1000)
    rs = ag = PSI_TP2 * 2 * (1 / 2) / (INTER / 2)
    window = 4 * (B_T2 + 2 * AR_T2)
    assert run(plan).time.dp_sync == pytest.approx(rs - 0.5 * min(rs, window) + ag, rel=1e-12, abs=0)


def test_a_plan_that_does_not_fit_says_by_how_much():
    small = cluster(device=dataclasses.replace(DEVICE, memory_gb=1.0))
    est = estimate(MODEL, small, train(tp2dp2()), tp2dp2())
    mem = est.stage_memory[0]
    assert not est.feasible
    assert est.reasons == (f"stage 0 needs {mem.total / 1e9:.1f} GB > 1.0 GB: runtime allowance "
                           f"{mem.overhead / 1e9:.1f} GB",)
    assert mem.total > 1e9 and f"{mem.total / 1e9:.1f}" == "1.0"


def test_pipeline_messages_in_fp32_and_with_bigger_micro_batches():
    plan = Plan(dp=2, pp=2, zero=1, micro_batch=2, grad_accum=2, precision="fp32", bucket_elements=1000)
    p2p = 2 * 128 * 2 * 64 * 4 / (INTER / 2)
    assert run(plan).time.pp_comm == pytest.approx(2 * p2p, rel=1e-12, abs=0)


def test_tp_comm_of_a_last_stage_leaves_the_embedding_out():
    # SP: an all-gather or reduce-scatter of b s h over TP 2 moves half of an all-reduce. Per
    # block forward 2 all-gathers + 2 reduce-scatters, backward 4 all-gathers + 2 reduce-scatters
    # and the replicated parameters' gradients (2 LayerNorms x weight and bias, 2 row-parallel
    # biases: 6 all-reduces of h bf16); the last stage: the output layer's forward all-gather,
    # backward all-gather + reduce-scatter, the final LayerNorm's 2 and the cross-entropy's 3
    t = run(Plan(tp=2, pp=2, micro_batch=1, grad_accum=4, sequence_parallel=True)).time
    param = 64 * 2 * 2 * (1 / 2) / INTRA
    block = 10 * AR_T2 / 2 + 6 * param
    assert t.tp_comm == pytest.approx(4 * (2 * block + 3 * AR_T2 / 2 + 2 * param + CE_AR_T2), rel=1e-12, abs=0)


def test_cpu_with_attention_dropout_runs_the_math_path():
    cpu = dataclasses.replace(DEVICE, kind="cpu")
    drop = dataclasses.replace(MODEL, attention_dropout=0.1)
    est = run(tp2dp2(), drop, c=cluster(device=cpu))
    model = 3 * (4 * 2 * 128 * 64 * (192 + 64 + 256 + 256) + 4 * 2 * 2 * 128 * 128 * 64 + 2 * 128 * 64 * 999)
    assert est.hardware_flops_per_step == pytest.approx(4 * (model + 3 * 2 * 128 * 64), rel=1e-12, abs=0)
    scores = 4 * 128 * 128 * (2 * 2 + 2 * 2 + 1) / 2 / HBM            # softmax + dropout stored and re-read
    b = 2 * (GEMM_T2 + CORE_T2) + 2 * (ELEM_T2 + scores)
    assert est.time.backward == pytest.approx(2 * (4 * b + 2 * (FIRST_C + last_c(500)) / 3), rel=1e-12, abs=0)


def test_selective_recompute_with_sequence_parallelism_and_scaled_factors():
    softmax = 4 * 128 * 128 * 4 / 2 / HBM
    sp = run(tp2dp2(recompute="selective", sequence_parallel=True), attention="eager").time
    assert sp.recompute == pytest.approx(2 * 4 * (CORE_T2 + softmax), rel=1e-12, abs=0)
    scaled = run(tp2dp2(recompute="selective"), c=cluster(device=SCALED), attention="eager").time
    assert scaled.recompute == pytest.approx(2 * 4 * (CORE_T2 * 3 + softmax * 4), rel=1e-12, abs=0)


def test_fp32_activations_and_the_scaled_working_block():
    fp32 = run(tp2dp2(precision="fp32")).stage_memory[0]
    act = block_activation_bytes(MODEL, 128, 1, 2, sequence_parallel=False, recompute="none", act_bytes=4.0,
                                 kernel="flash")
    assert fp32.activations == pytest.approx(4 * act + EMB_T2_ACTS, rel=1e-12, abs=0)
    full = run(tp2dp2(recompute="full"), c=cluster(device=SCALED)).stage_memory[0]
    work = 1.5 * _acts_per_block(tp2dp2()) - 128 * 64 * 2 + SHARED + 2 * 8 * 128   # scaled: the block's
    assert full.activations == pytest.approx(4 * 128 * 64 * 2 + EMB_T2_ACTS + work, rel=1e-12, abs=0)


def test_zero3_updates_a_shard():
    plan = Plan(dp=4, zero=3, micro_batch=1, grad_accum=2, bucket_elements=1000)
    assert run(plan).time.optimizer == pytest.approx(PSI_T1 / 4 * 30 / HBM, rel=1e-12, abs=0)


def test_zero1_owned_gradients_per_pipeline_stage():
    """PP 2 x DP 2, two blocks per stage. Stage 0 = embedding (63,936) + 2 blocks = 163,904
    elements, partitions of 81,952: rank 0 reaches into block 0's FFN input weight, which ends at
    97,216; rank 1 starts inside it (at 80,832): 163,904 - 80,832 = 83,072. Stage 1 = 2 blocks +
    final LayerNorm + output layer = 164,032, partitions of 82,016: rank 0 reaches into block 1's
    FFN input weight (ending at 83,264), rank 1 starts inside it (at 66,880): 97,152."""
    lc = layer_costs(MODEL, cluster(), train(Plan(dp=2, pp=2, zero=1, micro_batch=1, grad_accum=4)),
                     Plan(dp=2, pp=2, zero=1, micro_batch=1, grad_accum=4))
    assert lc.stage_owned(0, 2, 2, 2) == max(97_216, 163_904 - 80_832) == 97_216
    assert lc.stage_owned(1, 2, 2, 2) == max(83_264, 164_032 - 66_880) == 97_152
    assert lc.stage_owned(0, 1, 4, 4) == RANK0_OWNED                   # one stage: embedding, blocks and head
