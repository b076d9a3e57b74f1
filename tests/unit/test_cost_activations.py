"""Activation memory, term by term, against values computed by hand (docs/runtime.md "What each
layer keeps for backward"; DeepSpeed's PipelineEngine buffers), and against the executor's
blocks measured with saved-tensor hooks.

Toy model: h 64, 4 heads of d 16, 2 KV groups, SwiGLU FFN 96, RMSNorm, rotary (8 of 16 dims),
vocabulary 1001 (1002 padded at TP 2); b 3, s 16, bf16 (e = 2) unless a test says otherwise.
Each expected value is written out term by term, so a term removed, halved or doubled fails.
"""
from __future__ import annotations

import dataclasses

import pytest

from planner.cost import layer_costs, memory, pipeline
from planner.cost.attention import selective_saves_memory
from planner.cost.tp import replicated_grad_allreduces, tp_block_comm, tp_stage_comm
from planner.specs import ModelSpec, Plan, TrainSpec, parse_cluster, preset, scale

TOY = ModelSpec(name="toy", hidden=64, layers=4, heads=4, kv_groups=2, ffn_hidden=96, activation="swiglu",
                vocab=1001, max_seq=64, norm="rmsnorm", position="rotary", linear_bias=False)
B, S, E = 3, 16, 2.0
SB = B * S                                                              # 48 rows


def block(model: ModelSpec = TOY, t: int = 1, sp: bool = False, recompute: str = "none", kernel: str = "flash",
          e: float = E) -> float:
    return memory.block_activation_bytes(model, S, B, t, sequence_parallel=sp, recompute=recompute, act_bytes=e,
                                         kernel=kernel)


# --- one block --------------------------------------------------------------------------------
def test_flash_block_keeps_inputs_stats_qkv_logsumexp_output_and_ffn():
    want = (4 * 2 * SB * 64            # block input, residual sum, QKV input, FFN input
            + 2 * 4 * SB               # two RMSNorm rstd, fp32
            + 2 * SB * (4 + 2 + 2) * 16  # q, k, v
            + 4 * SB * 4               # fp32 logsumexp b x heads x s
            + 2 * SB * 4 * 16          # attention output
            + 2 * SB * 96 * 4)         # gate + up, SiLU output, product
    assert block() == want == 81024


def test_eager_block_keeps_the_softmax_and_the_math_path_with_dropout_its_mask_and_output():
    want_eager = (4 * 2 * SB * 64 + 2 * 4 * SB
                  + 2 * SB * 16 * (4 + 2 + 2)    # q / sqrt(d), K^T, V
                  + 2 * B * 4 * S * S            # softmax b heads s s
                  + 2 * SB * 4 * 16 + 2 * SB * 96 * 4)
    assert block(kernel="eager") == want_eager
    drop = dataclasses.replace(TOY, attention_dropout=0.1)
    # the same kernel with attention dropout: + its bool mask and its output per score
    assert block(drop, kernel="eager") == want_eager + (1 + 2) * B * 4 * S * S
    assert block(drop, kernel="math") == block(drop, kernel="eager")     # the CPU fallback runs eagerly
    # flash fuses the dropout: no mask kept
    assert block(drop, kernel="flash") == block()


def test_hidden_dropout_adds_two_one_byte_masks_of_the_residual_stream():
    drop = dataclasses.replace(TOY, hidden_dropout=0.1)
    assert block(drop) - block() == 2 * 1 * SB * 64
    assert block(drop, t=2, sp=True) - block(t=2, sp=True) == 2 * 1 * SB * 64 / 2     # sequence shards


def test_layernorm_keeps_mean_and_rstd_in_the_activation_dtype_and_gelu_two_ffn_tensors():
    ln = dataclasses.replace(TOY, norm="layernorm")
    assert block(ln) - block() == 2 * (2 * 2 * SB - 4 * SB)             # (mean + rstd) x e vs fp32 rstd
    assert block(ln, e=4.0) - block(e=4.0) == 2 * (2 * 4 * SB - 4 * SB)
    gelu = dataclasses.replace(TOY, activation="gelu")
    assert block() - block(gelu) == 2 * SB * 96 * (4 - 2)               # GELU: its input and output


def test_tensor_and_sequence_parallel_shards():
    # TP 2: heads 2, KV groups 1, FFN 48 per rank; the residual stream whole
    t2 = (4 * 2 * SB * 64 + 2 * 4 * SB + 2 * SB * (2 + 1 + 1) * 16 + 4 * SB * 2 + 2 * SB * 2 * 16
          + 2 * SB * 48 * 4)
    assert block(t=2) == t2
    # SP: norm inputs, QKV/FFN inputs and statistics on s/2
    assert block(t=2, sp=True) == t2 - (4 * 2 * SB * 64 + 2 * 4 * SB) / 2


def test_selective_and_full_recompute():
    qkv_out = 2 * SB * (4 + 2 + 2) * 16 + 2 * SB * 4 * 16              # the checkpoint's QKV output, dense input
    rest = 4 * 2 * SB * 64 + 2 * 4 * SB + 2 * SB * 96 * 4
    assert block(recompute="selective") == rest + qkv_out
    assert block(recompute="selective", kernel="eager") == rest + qkv_out
    assert block(recompute="full") == 2 * SB * 64                       # the block input
    assert block(recompute="full", t=2, sp=True) == 2 * SB * 64 / 2


def test_selective_recompute_saves_memory_only_where_scores_are_stored():
    """With flash, selective recompute saves the logsumexp alone (4 b s a/T per block, 1% of this
    block): the search offers it only for eager and the CPU math path, which save the s^2 terms."""
    assert block() - block(recompute="selective") == 4 * SB * 4
    assert block(kernel="eager") - block(recompute="selective") == 2 * B * 4 * S * S
    cluster = parse_cluster("8xA100")
    flash, eager = TrainSpec(global_batch=8, seq_len=S), TrainSpec(global_batch=8, seq_len=S, attention="eager")
    assert not selective_saves_memory(TOY, flash, cluster.device.kind)
    assert selective_saves_memory(TOY, eager, cluster.device.kind)


def test_korthikanti_table2_exactly_for_eager_gpt_and_the_flash_case():
    """Korthikanti et al. 2022, Table 2 (T = 1, a = g, GELU f = 4h, LayerNorm, bf16, dropout 0.1,
    eager): 34 s b h + 5 a s^2 b plus the norm statistics 2 x (2 + 2) b s; flash without
    dropout: 32 s b h + 4 b s a, no s^2 term."""
    s, b, h, a = 512, 2, 256, 8
    gpt = ModelSpec(name="gpt", hidden=h, heads=a, layers=2, ffn_hidden=4 * h, activation="gelu", vocab=1000,
                    max_seq=s, norm="layernorm", position="learned", hidden_dropout=0.1, attention_dropout=0.1)
    got = memory.block_activation_bytes(gpt, s, b, 1, sequence_parallel=False, recompute="none", act_bytes=2.0,
                                        kernel="eager")
    assert got == 34 * s * b * h + 5 * a * s * s * b + 2 * 4 * b * s
    dry = dataclasses.replace(gpt, hidden_dropout=0.0, attention_dropout=0.0)
    got = memory.block_activation_bytes(dry, s, b, 1, sequence_parallel=False, recompute="none", act_bytes=2.0,
                                        kernel="flash")
    assert got == 32 * s * b * h + 4 * b * s * a + 2 * 4 * b * s


# --- shared by a stage, embedding, head -------------------------------------------------------
def test_shared_tensors_of_a_stage():
    mask, rot = 2 * B * 1 * S * S, 2 * 4 * SB * 4                      # b 1 s s bf16; cos, sin b s 4 fp32
    assert memory.rotary_dims(TOY) == 8 and memory.rotary_dims(scale(preset("chatglm3-6b"), "tiny")) == 16
    kw = {"act_bytes": E, "plain": True, "recomputed": False}
    assert memory.shared_bytes(TOY, S, B, 1, kernel="flash", **kw) == mask + rot
    assert memory.shared_bytes(TOY, S, B, 1, kernel="eager", **kw) == rot      # eager adds the mask, keeps none
    assert memory.shared_bytes(TOY, S, B, 1, kernel="flash", act_bytes=E, plain=False, recomputed=True) == 2 * 8 * SB
    assert memory.cache_bytes(TOY, S, B, 1, E) == mask + rot
    alibi = dataclasses.replace(TOY, position="alibi")
    assert memory.shared_bytes(alibi, S, B, 2, kernel="flash", **kw) == 2 * B * 2 * S * S   # per head / TP, no rotary
    assert memory.rotary_dims(alibi) == 0
    # llama rotates the whole head (rotary_fraction 1): 16 dims of TOY's 16, cos and sin twice as wide
    llama = dataclasses.replace(TOY, rotary_fraction=1.0)
    assert memory.rotary_dims(llama) == 16
    assert memory.shared_bytes(llama, S, B, 1, kernel="flash", **kw) == mask + 2 * rot


def test_embedding_keeps_ids_flags_and_position_ids():
    assert memory.embedding_bytes(TOY, S, B, 1) == 8 * SB
    assert memory.embedding_bytes(TOY, S, B, 2) == 8 * SB + 1 * SB
    learned = dataclasses.replace(TOY, position="learned")
    assert memory.embedding_bytes(learned, S, B, 2) == 8 * SB + 1 * SB + 8 * SB


def test_head_keeps_norm_output_input_fp32_softmax_and_loss_buffers():
    want = (2 * SB * 64 + 4 * SB          # final-norm input and rstd
            + 2 * SB * 64                 # output-layer input
            + 4 * SB * 1002 / 2           # fp32 softmax over V_pad / T
            + (1 + 8 + 4) * SB + 4)       # target flags, shard-local targets, weights; the count
    assert memory.head_bytes(TOY, S, B, 2, sequence_parallel=False, act_bytes=E) == want
    sp = memory.head_bytes(TOY, S, B, 2, sequence_parallel=True, act_bytes=E)
    assert want - sp == (2 * SB * 64 + 4 * SB + 2 * SB * 64) / 2
    assert memory.logits_bytes(TOY, S, B, 2, E) == 2 * SB * 1002 / 2


# --- DeepSpeed's pipeline -----------------------------------------------------------------------
def test_pipeline_buffers_per_stage():
    msg, hidden = 2 * SB * 64 + 2 * 8 * SB, 2 * SB * 64
    kw = {"sequence_parallel": False, "act_bytes": E, "p": 3, "m": 4}
    # first stage: its output message per micro-batch in flight; the gradient buffer and the
    # loaded ids / positions / segments in its 3 pipe buffers (min(p, m) = 3)
    assert memory.pipeline_bytes(TOY, S, B, 1, stage=0, **kw) == (msg, hidden + 3 * 3 * 8 * SB)
    # inner stage: the received and the output message; the receive and gradient buffers
    assert memory.pipeline_bytes(TOY, S, B, 1, stage=1, **kw) == (2 * msg, msg + hidden)
    # last stage: the received message; the receive buffer, labels in 2 buffers, the previous logits
    assert memory.pipeline_bytes(TOY, S, B, 1, stage=2, **kw) == (msg, msg + 2 * 8 * SB + 2 * SB * 1001)
    one = {**kw, "m": 1}                                                  # one micro-batch: no previous logits
    assert memory.pipeline_bytes(TOY, S, B, 1, stage=2, **one) == (msg, msg + 2 * 8 * SB)
    assert memory.pipeline_bytes(TOY, S, B, 1, stage=0, sequence_parallel=False, act_bytes=E, p=1, m=4) == (0, 0)
    assert [memory.pipe_buffers(4, i, 8) for i in range(4)] == [4, 3, 2, 2]


def test_in_flight_micro_batches_are_deepspeeds_train_schedule():
    """1F1B as DeepSpeed's TrainSchedule runs it: the most forwards whose backward has not run,
    stage by stage, is min(p - i, m) (deepspeed/runtime/pipe/schedule.py)."""
    sched = pytest.importorskip("deepspeed.runtime.pipe.schedule")
    for p in (2, 3, 4):
        for m in (1, 2, 3, 8):
            peaks = []
            for i in range(p):
                live = peak = 0
                s = sched.TrainSchedule(micro_batches=m, stages=p, stage_id=i)
                for cmds in s.steps():
                    for c in cmds:
                        live += isinstance(c, sched.ForwardPass) - isinstance(c, sched.BackwardPass)
                        peak = max(peak, live)
                peaks.append(peak)
                assert s.num_pipe_buffers() == memory.pipe_buffers(p, i, m)
            assert tuple(peaks) == pipeline.in_flight(p, m, 1)


# --- the stage totals the estimate and the search share -------------------------------------------
CPU = parse_cluster("4xcpu")


def lc(plan: Plan, model: ModelSpec = TOY):
    return layer_costs(model, CPU, TrainSpec(global_batch=plan.global_batch, seq_len=S), plan)


def test_one_stage_extras():
    mask, rot = 2 * B * S * S, 2 * 4 * SB * 4
    head = 2 * SB * 64 * 2 + 4 * SB + 4 * SB * 1001 + 13 * SB + 4
    c = lc(Plan(dp=4, micro_batch=B))
    assert c.first_stage_act_bytes == 8 * SB                             # ids
    assert c.last_stage_act_bytes == head + 2 * SB * 1001 + mask + rot   # + transient logits, shared set
    # a recomputed block rebuilds the mask and cos/sin; the checkpoints hold the ids
    full = lc(Plan(dp=4, micro_batch=B, recompute="full"))
    assert full.block_work_bytes == block() - block(recompute="full") + mask + rot + 16 * SB
    assert full.block_act_bytes_full_recompute == 2 * SB * 64
    # selective: no plain block keeps the mask or cos/sin; the cache still holds one set
    sel = lc(Plan(dp=4, micro_batch=B, recompute="selective"), dataclasses.replace(TOY, attention_dropout=0.1))
    assert sel.last_stage_act_bytes == head + 2 * SB * 1001 + mask + rot


def test_pipeline_first_stage_spreads_its_fixed_buffers_over_its_micro_batches():
    mask, rot = 2 * B * S * S, 2 * 4 * SB * 4
    msg, hidden = 2 * SB * 64 + 16 * SB, 2 * SB * 64
    c = lc(Plan(dp=2, pp=2, micro_batch=B, grad_accum=4))
    assert c.in_flight == (2, 1)
    fixed0 = hidden + 2 * 3 * 8 * SB                                     # gradient buffer, 2 loaded inputs
    assert c.first_stage_act_bytes == pytest.approx(8 * SB + mask + rot + msg + fixed0 / 2, rel=1e-15, abs=0)
    head = 2 * SB * 64 * 2 + 4 * SB + 4 * SB * 1001 + 13 * SB + 4
    assert c.last_stage_act_bytes == head + 2 * SB * 1001 + mask + rot + msg + msg + 2 * 8 * SB + 2 * SB * 1001


# --- sequence-parallel traffic -----------------------------------------------------------------
def test_sequence_parallel_collectives_per_block_and_stage():
    bw, lat = 1e9, 1e-4
    sbh = S * B * 64 * E
    ar = lambda n: n * 2 * (1 / 2) / bw + 2 * lat                       # TP 2 ring
    ag = lambda n: n * (1 / 2) / bw + lat                             
    assert tp_block_comm(TOY, S, B, 2, E, False, (bw, lat), 1.0) == (2 * ar(sbh), 2 * ar(sbh))
    fwd, bwd = tp_block_comm(TOY, S, B, 2, E, True, (bw, lat), 1.0)
    assert replicated_grad_allreduces(TOY) == 2                          # two RMSNorm weights, no biases
    assert fwd == pytest.approx(4 * ag(sbh), rel=1e-12, abs=0)
    assert bwd == pytest.approx(6 * ag(sbh) + 2 * ar(64 * E), rel=1e-12, abs=0)
    glm = dataclasses.replace(TOY, norm="layernorm", linear_bias=True, position="learned")
    assert replicated_grad_allreduces(glm) == 6
    first, last = tp_stage_comm(TOY, S, B, 2, E, False, (bw, lat), 1.0)
    ce = 3 * ar(S * B * 4)
    assert (first, last) == (ar(sbh), pytest.approx(ar(sbh) + ce, rel=1e-12, abs=0))
    first, last = tp_stage_comm(TOY, S, B, 2, E, True, (bw, lat), 1.0)
    assert first == pytest.approx(2 * ag(sbh), rel=1e-12, abs=0)        # reduce-scatter; all-gather back
    assert last == pytest.approx(3 * ag(sbh) + ar(64 * E) + ce, rel=1e-12, abs=0)
    first, last = tp_stage_comm(glm, S, B, 2, E, True, (bw, lat), 1.0)
    assert first == pytest.approx(ar(sbh) + ag(sbh), rel=1e-12, abs=0)  # learned positions: all-reduce, split
    assert last == pytest.approx(3 * ag(sbh) + 2 * ar(64 * E) + ce, rel=1e-12, abs=0)


# --- the executor's blocks, measured ---------------------------------------------------------------
MEASURED = [(name, att, p, rc) for name in ("chatglm3-6b", "glm-10b", "glm-130b")
            for att, p in (("flash", 0.0), ("eager", 0.0), ("eager", 0.1), ("flash", 0.1))
            for rc in ("none", "selective", "full")]


@pytest.mark.parametrize("name,attention,p,recompute", MEASURED)
def test_the_cost_model_charges_what_the_executor_keeps(name: str, attention: str, p: float, recompute: str) -> None:
    """Saved-tensor hooks (planner.model.recompute.saved_for_backward) on the second of two blocks
    on a CPU: its own storages equal block_activation_bytes, the storages both blocks keep equal
    shared_bytes (the kernel the CPU runs: attention dropout takes the math path)."""
    pytest.importorskip("torch")
    from planner.cost.attention import attention_kernel
    from planner.model.recompute import storage_bytes
    from saved_blocks import two_blocks_saved
    spec = dataclasses.replace(scale(preset(name), "tiny"), hidden_dropout=p, attention_dropout=p)
    b, s = 2, 24
    kernel = attention_kernel(spec, TrainSpec(global_batch=b, seq_len=s, attention=attention), "cpu")
    own_saved, shared_saved, _ = two_blocks_saved(spec, b, s, attention, recompute)
    own, shared = storage_bytes(own_saved), storage_bytes(shared_saved)
    assert own == memory.block_activation_bytes(spec, s, b, 1, sequence_parallel=False, recompute=recompute,
                                                act_bytes=2.0, kernel=kernel)
    assert shared == memory.shared_bytes(spec, s, b, 1, act_bytes=2.0, kernel=kernel,
                                         plain=recompute == "none", recomputed=recompute != "none")


def test_zero3_blocks_each_keep_their_own_mask_and_rotary():
    """DeepSpeed's ZeRO-3 hooks hand each block new id tensors, so the stage cache rebuilds the
    mask and cos/sin per block (measured: planner.runtime.observe.measure.ActivationRecorder)."""
    mask, rot = 2 * B * S * S, 2 * 4 * SB * 4
    z0, z3 = lc(Plan(dp=4, micro_batch=B)), lc(Plan(dp=4, zero=3, micro_batch=B))
    assert z3.block_act_bytes - z0.block_act_bytes == mask + rot
    assert z0.last_stage_act_bytes - z3.last_stage_act_bytes == mask + rot       # no longer once per stage
    assert z3.block_act_bytes_full_recompute == z0.block_act_bytes_full_recompute
    sel = dataclasses.replace(TOY, attention_dropout=0.1)                      # selective: the core rebuilds them
    s0 = lc(Plan(dp=4, micro_batch=B, recompute="selective"), sel)
    s3 = lc(Plan(dp=4, zero=3, micro_batch=B, recompute="selective"), sel)
    assert s3.block_act_bytes == s0.block_act_bytes


# --- the terms a search plan switches on, at the stage level --------------------------------------
def test_sequence_parallel_reaches_the_blocks_head_and_pipeline_messages():
    mask, rot = 2 * B * S * S, 2 * 4 * SB * 4
    c = lc(Plan(tp=2, dp=2, micro_batch=B, sequence_parallel=True))
    assert c.block_act_bytes == block(t=2, sp=True)
    assert c.last_stage_act_bytes == (memory.head_bytes(TOY, S, B, 2, sequence_parallel=True, act_bytes=E)
                                      + 2 * SB * 1002 / 2 + mask + rot)
    hidden = 2 * SB * 64 / 2                                             # the message's b s/t h half
    msg = hidden + 16 * SB
    kw = {"sequence_parallel": True, "act_bytes": E, "p": 3}
    assert memory.pipeline_bytes(TOY, S, B, 2, stage=1, m=4, **kw) == (2 * msg, msg + hidden)
    # TP 2 without SP: the message is the whole b s h
    whole = 2 * SB * 64 + 16 * SB
    assert memory.pipeline_bytes(TOY, S, B, 2, stage=1, m=4, **{**kw, "sequence_parallel": False}) == (
        2 * whole, whole + 2 * SB * 64)
    # two micro-batches: the last stage still keeps the previous logits (b s V_pad/t, bf16)
    last = memory.pipeline_bytes(TOY, S, B, 2, stage=2, m=2, **kw)
    assert last == (msg, msg + memory.pipe_buffers(3, 2, 2) * 8 * SB + 2 * SB * 1002 / 2)
    pp = lc(Plan(tp=2, pp=2, micro_batch=B, grad_accum=4, sequence_parallel=True))
    fixed0 = hidden + 2 * 3 * 8 * SB                                     # gradient buffer, 2 loaded inputs
    assert pp.first_stage_act_bytes == pytest.approx(memory.embedding_bytes(TOY, S, B, 2) + mask + rot + msg
                                                     + fixed0 / 2, rel=1e-15, abs=0)
    assert pp.last_stage_act_bytes == pytest.approx(
        memory.head_bytes(TOY, S, B, 2, sequence_parallel=True, act_bytes=E) + 2 * SB * 1002 / 2 + mask + rot
        + msg + msg + 2 * 8 * SB + 2 * SB * 1002 / 2, rel=1e-15, abs=0)


def test_selective_recompute_under_eager_attention_keeps_less_and_rebuilds_the_core():
    from planner.cost.attention import attention_kernel
    train = TrainSpec(global_batch=4 * B, seq_len=S, attention="eager")
    k = attention_kernel(TOY, train, "cpu")
    sel = layer_costs(TOY, CPU, train, Plan(dp=4, micro_batch=B, recompute="selective"))
    assert sel.block_act_bytes == block(recompute="selective", kernel=k) < block(kernel=k)
    rebuilt = memory.shared_bytes(TOY, S, B, 1, act_bytes=E, kernel=k, plain=True, recomputed=True)
    assert sel.block_work_bytes == rebuilt + block(kernel=k) - block(recompute="selective", kernel=k)


def test_alibi_masks_are_per_head_over_tp_wherever_they_are_kept():
    alibi = dataclasses.replace(TOY, position="alibi")
    mask = 2 * B * (4 // 2) * S * S                                      # b heads/t s s bf16, no cos/sin
    z1 = lc(Plan(tp=2, dp=2, zero=1, micro_batch=B), alibi)
    z3 = lc(Plan(tp=2, dp=2, zero=3, micro_batch=B), alibi)
    assert z3.block_act_bytes - z1.block_act_bytes == mask               # ZeRO-3: each block its own
    head = memory.head_bytes(alibi, S, B, 2, sequence_parallel=False, act_bytes=E) + 2 * SB * 1002 / 2
    assert z1.last_stage_act_bytes == head + mask
    full = lc(Plan(tp=2, dp=2, zero=1, micro_batch=B, recompute="full"), alibi)
    assert full.block_work_bytes == mask + 16 * SB + block(alibi, t=2) - block(alibi, t=2, recompute="full")
    # ZeRO-3 + full recompute: the recomputed block rebuilds its own mask next to what it kept
    z3full = lc(Plan(tp=2, dp=2, zero=3, micro_batch=B, recompute="full"), alibi)
    assert z3full.block_work_bytes - full.block_work_bytes == mask


def test_a_selective_pipeline_stage_keeps_no_shared_set_per_micro_batch():
    """Selective recompute: no plain block keeps the mask and cos/sin, so the first stage holds
    only the cache's one set, spread over its in-flight micro-batches."""
    mask, rot = 2 * B * S * S, 2 * 4 * SB * 4
    msg, hidden = 2 * SB * 64 + 16 * SB, 2 * SB * 64
    c = lc(Plan(dp=2, pp=2, micro_batch=B, grad_accum=4, recompute="selective"),
           dataclasses.replace(TOY, attention_dropout=0.1))
    fixed0 = hidden + 2 * 3 * 8 * SB
    assert c.first_stage_act_bytes == pytest.approx(8 * SB + msg + (mask + rot + fixed0) / 2, rel=1e-15, abs=0)
