"""The runtime the cost model describes: TP splits, DeepSpeed's engines, the rank layout, the
attention kernel. Hand-computed values; DeepSpeed 0.19.8 source cited in planner/cost."""
from __future__ import annotations

import dataclasses

import pytest

from planner.cost import engines, params
from planner.cost.attention import attention_kernel, selective_saves_memory
from planner.cost.comm import cross_node_boundaries, group_links, group_sharing
from planner.search import Space
from planner.specs import ModelSpec, Plan, TrainSpec, parse_cluster, preset, scale

GQA = ModelSpec(name="gqa", hidden=128, layers=4, heads=8, kv_groups=2, ffn_hidden=96, activation="swiglu",
                vocab=1001, max_seq=256, norm="rmsnorm", position="rotary", qkv_bias=True, linear_bias=False)
TIED = ModelSpec(name="tied", hidden=64, layers=4, heads=4, ffn_hidden=256, activation="gelu", vocab=1000,
                 max_seq=32, norm="layernorm", position="learned", tied_embeddings=True)


# --- parameters per TP rank ------------------------------------------------------------------
def test_block_split_by_heads_kv_groups_and_glu_halves():
    # q = 8 x 16 = 128, kv = 2 x 16 = 32; TP 2: 4 query heads, 1 KV group, half of gate and of up
    t2 = params.block_tensors(GQA, 2).numels
    assert t2 == (128, 128 * (128 + 64) // 2, (128 + 64) // 2, 128 * 128 // 2, 128, 128 * 2 * 96 // 2, 96 * 128 // 2)
    assert params.block_tensors(GQA, 1).total == GQA.layer_params


def test_row_parallel_biases_and_norms_are_replicated():
    m = dataclasses.replace(TIED, position="rotary")
    t1, t4 = params.block_tensors(m, 1).total, params.block_tensors(m, 4).total
    replicated = 4 * 64 + 64 + 64                      # two LayerNorms (weight, bias); two row-parallel biases
    assert t4 == replicated + (t1 - replicated) // 4


def test_embedding_and_output_use_the_padded_vocabulary():
    # vocabulary 1001: TP 2 pads to 1002 (501 rows per rank), TP 4 to 1004
    assert params.first_stage_tensors(GQA, 2).numels == (501 * 128,)
    assert params.last_stage_tensors(GQA, 4, 1).numels == (128, 251 * 128)
    plan = Plan(dp=1, tp=2, pp=2, micro_batch=1)
    assert params.stage_params(GQA, plan) == (501 * 128 + 2 * params.block_tensors(GQA, 2).total,
                                              2 * params.block_tensors(GQA, 2).total + 128 + 501 * 128)


def test_tied_embeddings_and_learned_positions():
    # without PP the output layer is the embedding's own shard: counted once
    whole = params.stage_params(TIED, Plan(tp=2, micro_batch=1))
    blocks = 4 * params.block_tensors(TIED, 2).total
    assert whole == (blocks + 500 * 64 + 32 * 64 + 128,)          # embedding shard + replicated positions + norm
    # under PP the last stage holds its own copy of the shard (DeepSpeed TiedLayerSpec), not the positions
    pp = params.stage_params(TIED, Plan(tp=2, pp=2, micro_batch=1))
    half = 2 * params.block_tensors(TIED, 2).total
    assert pp == (500 * 64 + 32 * 64 + half, half + 128 + 500 * 64)


def test_zero3_persistent_parameters_are_the_small_tensors():
    thr = params.persistence_threshold(GQA)                        # 10 x hidden = 1280
    assert thr == 1280
    assert params.block_tensors(GQA, 1).small(thr) == 128 + 192 + 128


# --- DeepSpeed's engines ---------------------------------------------------------------------
@pytest.mark.parametrize("zero,precision,pp,name", [
    (0, "fp32", 1, "torch AdamW"), (0, "fp32", 2, "torch AdamW"), (0, "bf16", 1, "FP16_Optimizer"),
    (0, "fp16", 2, "FP16_Optimizer"), (0, "bf16", 2, "BF16_Optimizer"), (1, "bf16", 2, "DeepSpeedZeroOptimizer"),
    (2, "fp32", 1, "DeepSpeedZeroOptimizer"), (3, "bf16", 1, "DeepSpeedZeroOptimizer_Stage3")])
def test_engine_choice_follows_deepspeed(zero, precision, pp, name):
    assert engines.engine_for(Plan(dp=2, pp=pp, zero=zero, precision=precision, micro_batch=1)).name.startswith(name)


def _roles(plan: Plan, psi: float, small: float = 0.0, phases=("always", "grads", "backward")) -> dict:
    return engines.engine_for(plan).bytes_by_role(engines.sizes(plan, psi, small), phases)


def test_engine_buffers_per_phase():
    psi = 1000.0
    # BF16_Optimizer, DP 4: bf16 weights, p.grad + the flat accumulation buffer, fp32 master + moments / 4
    bf = Plan(dp=4, pp=2, zero=0, micro_batch=1)
    assert _roles(bf, psi) == {"params": 2000, "grads": 4000, "optimizer": 3000, "buckets": 0}
    assert _roles(bf, psi, phases=("step",))["grads"] == 1000              # fp32 copy of its gradient partition
    # after the step only the persistent buffers remain (what the executor counts under a pipeline)
    assert _roles(bf, psi, phases=("always",)) == {"params": 2000, "grads": 2000, "optimizer": 3000, "buckets": 0}
    # ZeRO-2 fp32: weights 4, the owned gradient partition 4/d, an fp32 master copy 4/d and moments 8/d
    z2 = Plan(dp=4, zero=2, precision="fp32", micro_batch=1, bucket_elements=300)
    assert _roles(z2, psi) == {"params": 4000, "grads": 1000, "optimizer": 3000, "buckets": 2 * 4 * 300}
    # the flat ZeRO-0 all-reduce copy is capped at 5e8 elements
    z0 = Plan(dp=4, zero=0, micro_batch=1)
    assert _roles(z0, 1e9)["buckets"] == 2 * 5e8


def test_engine_collectives_per_stage():
    def kinds(plan):
        return [(c.kind, c.bytes, c.per, c.overlap) for c in engines.engine_for(plan).collectives]
    assert kinds(Plan(dp=2, zero=0, micro_batch=1)) == [("all_reduce", 2, "step", False)]
    assert kinds(Plan(dp=2, pp=2, zero=0, micro_batch=1)) == [("all_reduce", 2, "step", False),
                                                               ("all_gather", 2, "step", False)]
    # the pipeline engine turns overlap_comm off for ZeRO-1
    assert kinds(Plan(dp=2, pp=2, zero=1, micro_batch=1)) == [("reduce_scatter", 2, "step", False),
                                                               ("all_gather", 2, "step", False)]
    assert kinds(Plan(dp=2, zero=2, precision="fp32", micro_batch=1)) == [("reduce_scatter", 4, "micro_batch", True),
                                                                          ("all_gather", 4, "step", False)]
    assert kinds(Plan(dp=2, zero=3, micro_batch=1)) == []    # per tensor and per bucket: planner/cost/zero.py


def test_footprint_matches_the_engine_description():
    for plan in (Plan(dp=4, zero=z, pp=p, precision=pr, micro_batch=1, bucket_elements=700, overlap_comm=o)
                 for z in range(4) for p in (1, 2) for pr in ("bf16", "fp32") for o in (True, False)
                 if not (p > 1 and z > 1)):
        eng, fp = engines.engine_for(plan), engines.footprint(plan)
        for psi, small in ((1000.0, 10.0), (3e9, 5e6)):
            held, back, step = fp.evaluate(psi, small)
            sz = engines.sizes(plan, psi, small)
            want = [eng.bytes_by_role(sz, ph) for ph in (("always", "grads"), ("backward",), ("step",))]
            assert held == pytest.approx(list(want[0].values()), rel=1e-12, abs=1e-9)
            assert back == pytest.approx(list(want[1].values()), rel=1e-12, abs=1e-9)
            assert step == pytest.approx(sum(want[2].values()), rel=1e-12, abs=1e-9)


# --- rank layout -----------------------------------------------------------------------------
def test_boundaries_cross_nodes_exactly_where_the_layout_puts_them():
    assert cross_node_boundaries(8, 12, 8, 8) == (True,) * 7        # GLM-130B published: TP 4 x DP 24 -> dp*tp = 96
    assert cross_node_boundaries(4, 1, 2, 4) == (False, True, False)  # two stages per node
    assert cross_node_boundaries(8, 2, 1, 8) == (False, False, False, True, False, False, False)
    assert cross_node_boundaries(4, 3, 1, 4) == (True, True, True)   # dp*tp = 3 does not divide the node


def test_dp_groups_get_the_link_they_span():
    # 3 nodes x 4: DP 3 per stage; stage 1 (ranks 3-5) and 2 (6-8) cross nodes; node 1 carries both
    assert group_sharing(4, 3, 1, 4, "dp") == (0, 2, 2, 0)
    c = parse_cluster("3x4xA100")
    links = group_links(c, Plan(dp=3, pp=4, micro_batch=1), "dp")
    assert links[0][0] == c.intra_node.busbw_gbps * 1e9
    assert links[1][0] == pytest.approx(c.inter_node.busbw_gbps * 1e9 / 2)
    # TP 8 x DP 2 on 2 x 8: the 8 DP groups all cross the two nodes: 1/8 of the network each
    c2 = parse_cluster("2x8xA100")
    assert group_links(c2, Plan(dp=2, tp=8, micro_batch=1), "dp")[0][0] == pytest.approx(
        c2.inter_node.busbw_gbps * 1e9 / 8)
    assert group_links(c2, Plan(dp=2, tp=8, micro_batch=1), "tp")[0][0] == c2.intra_node.busbw_gbps * 1e9


def test_published_glm130b_pipeline_traffic_is_a_per_gpu_share():
    from planner.cost import estimate
    m, c = preset("glm-130b"), parse_cluster("96x8xA100-40GB")
    plan = Plan(dp=24, tp=4, pp=8, zero=1, micro_batch=1, grad_accum=176, recompute="full")
    est = estimate(m, c, TrainSpec(global_batch=4224, seq_len=2048), plan)
    eff = c.device.factors.get("comm_efficiency", 1.0) * c.device.factors["network_efficiency"]  # DeepSpeed's
    # b s h bf16 over 1/8 of 180 GB/s at InfiniBand's measured 0.84 (profiles/links/classes.json) x the
    # runtime's network efficiency, + the class's 17.4 us per send and one 11.5 us network step
    one = 2048 * 12288 * 2 / (180e9 / 8 * 0.84 * eff) + 17.4e-6 + 11.5e-6
    assert est.time.pp_comm == pytest.approx(176 * 2 * one, rel=1e-12, abs=0)   # ~0.79 s


# --- attention kernel ------------------------------------------------------------------------
def test_attention_kernel_and_where_selective_recompute_is_offered():
    chatglm, glm = preset("chatglm3-6b"), preset("glm-130b")          # attention dropout 0 and 0.1
    flash, eager = TrainSpec(global_batch=8, seq_len=128), TrainSpec(global_batch=8, seq_len=128, attention="eager")
    assert attention_kernel(glm, flash, "gpu") == "flash"               # flash has dropout on GPUs
    assert attention_kernel(glm, flash, "cpu") == "math"                # the CPU falls back to the math path
    assert attention_kernel(chatglm, flash, "cpu") == "flash"
    assert attention_kernel(chatglm, eager, "gpu") == "eager"
    assert not selective_saves_memory(glm, flash, "gpu") and selective_saves_memory(glm, flash, "cpu")
    space = Space(model=chatglm, cluster=parse_cluster("8xA100"), train=dataclasses.replace(flash, global_batch=64))
    assert space.recompute_modes() == ("none", "full")
    assert {s.recompute for s in space.shapes()} == {"none", "full"}
    assert dataclasses.replace(space, train=dataclasses.replace(eager, global_batch=64)).recompute_modes() == (
        "none", "selective", "full")


def test_step_only_buffers_and_capped_buckets():
    psi = 1000.0
    step = ("step",)
    assert _roles(Plan(dp=4, zero=1, micro_batch=1), psi, phases=step)["grads"] == 4 * psi / 4
    z3 = Plan(dp=4, zero=3, micro_batch=1, bucket_elements=100)
    assert _roles(z3, psi, phases=step)["grads"] == 4 * min(psi / 4, 100)       # one sub-group at a time
    assert _roles(z3, psi, 10.0)["params"] == 2 * psi / 4 + 2 * 10
    assert _roles(z3, 50.0, phases=("backward",))["buckets"] == 2 * 50          # gathered: at most the parameters
    # ZeRO-1 without overlap_comm: one reduce bucket; under a pipeline (overlap_comm turned off)
    # two, reduce_gradients(pipeline_parallel) appending one (measured, docs/lab.md)
    assert _roles(Plan(dp=4, zero=1, overlap_comm=False, micro_batch=1, bucket_elements=300), psi)["buckets"] == 600
    assert _roles(Plan(dp=4, pp=2, zero=1, micro_batch=1, bucket_elements=300), psi)["buckets"] == 1200
    assert _roles(Plan(dp=4, zero=0, precision="fp32", micro_batch=1), 1e9)["buckets"] == 4 * 5e8


@pytest.mark.parametrize("plan,module,optimizer", [
    # where the executor's count finds each buffer (measured: README "The cost model"), phases
    # as measured: after backward (no pipeline) or after the step (pipeline)
    (Plan(dp=2, zero=0, precision="fp32", micro_batch=1), (4, 4), 8),
    (Plan(dp=2, zero=0, micro_batch=1), (2, 2), 12),
    (Plan(dp=2, zero=1, micro_batch=1), (2, 0), 1 + 6),
    (Plan(dp=2, zero=2, precision="fp32", micro_batch=1), (4, 0), 2 + 6),
    (Plan(dp=2, zero=3, micro_batch=1, bucket_elements=10), (1, 0), 1 + 6 + 20 / 1000),
    (Plan(dp=2, pp=2, zero=0, micro_batch=1), (2, 0), 2 + 6),
    (Plan(dp=2, pp=2, zero=1, micro_batch=1), (2, 0), 6),
    (Plan(dp=2, pp=2, zero=0, precision="fp32", micro_batch=1), (4, 0), 8),
    (Plan(dp=2, pp=2, zero=0, precision="fp16", micro_batch=1), (2, 0), 12),
])
def test_which_buffers_the_executor_counts_where(plan, module, optimizer):
    phases = ("always",) if plan.pp > 1 else ("always", "grads")
    eng, sz = engines.engine_for(plan), engines.sizes(plan, 1000.0, 0.0)
    mod = eng.bytes_by_role(sz, phases, held_by="module")
    opt = eng.bytes_by_role(sz, phases, held_by="optimizer")
    assert (mod["params"], mod["grads"]) == (module[0] * 1000, module[1] * 1000)
    assert sum(opt.values()) == pytest.approx(optimizer * 1000, rel=1e-12, abs=0)


def test_the_engines_read_the_knobs_the_ds_config_sets():
    """The buffers sized from plan.bucket_elements and the persistence threshold are the
    values planner/dsconfig.py writes into ds_config.json."""
    from planner import dsconfig
    model = preset("chatglm3-6b")
    plan = Plan(dp=8, zero=3, micro_batch=1, bucket_elements=12_345_678, overlap_comm=False)
    z = dsconfig.ds_config(plan, model, TrainSpec(global_batch=8, seq_len=128), parse_cluster("8xA100"))[
        "zero_optimization"]
    assert z["stage3_param_persistence_threshold"] == params.persistence_threshold(model)
    assert z["reduce_bucket_size"] == z["stage3_max_live_parameters"] == z["sub_group_size"] == plan.bucket_elements
    assert z["overlap_comm"] is plan.overlap_comm


@pytest.mark.parametrize("zero,overlap,psi,want", [
    (1, True, 1500.0, 1500), (1, True, 5000.0, 2000), (1, False, 1500.0, 1000), (2, True, 800.0, 800),
    (3, True, 800.0, 800), (3, True, 5000.0, 1000)])
def test_a_cpu_counts_only_the_bucket_pages_the_gradients_touch(zero, overlap, psi, want):
    """DeepSpeed allocates its reduce buckets with torch.empty and fills them with the rank's
    gradients: a CPU's resident set holds min(psi, buckets x bucket_elements) elements of them
    (ZeRO-1/2 double-buffer under overlap_comm), a GPU's allocator the whole buckets."""
    plan = Plan(dp=2, zero=zero, micro_batch=1, grad_accum=1, bucket_elements=1000, overlap_comm=overlap)
    eng = engines.engine_for(plan)
    buckets = [b for b in eng.buffers if b.basis == "reduce_bucket"]
    assert len(buckets) == 1 and buckets[0].count == (2 if overlap and zero < 3 else 1)
    got = eng.bytes_by_role(engines.sizes(plan, psi, 0.0, resident=True), ("always", "backward"))["buckets"]
    full = eng.bytes_by_role(engines.sizes(plan, psi, 0.0), ("always", "backward"))["buckets"]
    live = 2 * min(psi, 1000) if zero == 3 else 0                    # ZeRO-3's gathered weights, written
    assert full == 2 * 1000 * buckets[0].count + live                # bf16, allocated
    assert got == 2 * want + live                                    # bf16, touched
    held, back, _ = engines.footprint(plan, resident=True).evaluate(psi, 0.0)
    assert held[3] + back[3] == got


def test_zero1_owned_gradients_reach_the_engine_and_buffers_validate_their_count():
    plan = Plan(dp=2, zero=1, micro_batch=1, grad_accum=1)
    eng = engines.engine_for(plan)
    assert eng.bytes_by_role(engines.sizes(plan, 1000.0, 0.0, owned=700.0), ("grads",))["grads"] == 2 * 700
    assert eng.bytes_by_role(engines.sizes(plan, 1000.0, 0.0), ("grads",))["grads"] == 2 * 1000 / 2
    held, _, _ = engines.footprint(plan).evaluate(1000.0, 0.0, 700.0)
    assert held[1] == 2 * 700                                        # ZeRO-1 holds no other gradient then
    with pytest.raises(AssertionError):
        engines.Buffer(name="x", role="grads", bytes=2.0, count=2)   # only reduce buckets come in pairs
    with pytest.raises(AssertionError):
        engines.Buffer(name="x", role="buckets", bytes=2.0, basis="reduce_bucket", count=0)


def test_the_estimate_counts_touched_bucket_pages_on_a_cpu_only():
    """The same profile as a CPU and as a GPU: only the reduce buckets differ, by the pages the
    gradients never touch (ZeRO-2, two buckets of 10^7 elements, psi < 2 x 10^7)."""
    from planner.cost import estimate
    model, train = scale(preset("chatglm3-6b"), "tiny"), TrainSpec(global_batch=4, seq_len=64)
    cpu = parse_cluster("2xcpu")
    gpu = dataclasses.replace(cpu, device=dataclasses.replace(cpu.device, kind="gpu"))
    plan = Plan(dp=2, zero=2, micro_batch=2, grad_accum=1, bucket_elements=10_000_000)
    a, b = estimate(model, cpu, train, plan).stage_memory[0], estimate(model, gpu, train, plan).stage_memory[0]
    psi = params.stage_params(model, plan)[0]
    assert b.buckets - a.buckets == 2 * (2 * 10_000_000 - psi)
    assert (a.params, a.grads, a.optimizer, a.activations) == (b.params, b.grads, b.optimizer, b.activations)
