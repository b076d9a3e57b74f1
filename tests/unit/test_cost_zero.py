"""DeepSpeed's ZeRO as it runs (planner/cost/zero.py) and its variants, pinned to hand-computed values.

The toy device of test_cost_terms (no latency unless a test adds it; links INTRA inside a
node, INTER per node between nodes), 2 nodes x 2 devices, the 4-block model (h 64), bf16,
with a host: 100 GB memory per node, PCIe 10 GB/s, CPU Adam 1e9 parameters/s per node,
NVMe 5 GB/s. Fetched tensors (above 10 x 64 = 640 elements): per block QKV 12,288, out
4,096, FFN in 16,384, FFN out 16,384; the embedding 63,936; the output layer 63,936.
"""
from __future__ import annotations

import dataclasses
import math

import pytest

from planner.cost import engines, zero
from planner.cost.factors import device_factors
from planner.errors import SpecError
from planner.specs import Plan
from planner.specs.hardware import Host, Link
from planner.specs.cluster import ClusterSpec
from planner.specs.validate import plan_problems
from test_cost_terms import DEVICE, INTER, INTRA, MODEL, PSI_T1, run, train

HOST = Host(cpu_memory_gb=100, pcie_gbps=10, cpu_adam_gparams=1, nvme_gbps=5)
DEV = dataclasses.replace(DEVICE, host=HOST)
FETCHED_BLOCK = (12_288, 4_096, 16_384, 16_384)
FETCHED = 4 * len(FETCHED_BLOCK) + 2                    # tensors fetched per pass: 18
FETCHED_ELEMS = 4 * sum(FETCHED_BLOCK) + 2 * 63_936      # 324,480


def cluster(nodes=2, per_node=2, dev=DEV, inter_lat=0.0, intra_lat=0.0, host=None) -> ClusterSpec:
    return ClusterSpec(nodes=nodes, gpus_per_node=per_node, device=dev,
                       intra_node=Link(name="i", busbw_gbps=INTRA / 1e9, latency_us=intra_lat),
                       inter_node=Link(name="e", busbw_gbps=INTER / 1e9, latency_us=inter_lat), host=host)


def z3(**kw) -> Plan:
    base = dict(dp=4, zero=3, micro_batch=1, grad_accum=1, bucket_elements=1000, overlap_comm=False)
    return Plan(**{**base, **kw})


def comm_total(plan: Plan, c: ClusterSpec | None = None) -> float:
    t = run(plan, c=c or cluster()).time
    return t.zero_gather + t.dp_sync


def test_every_collective_pays_its_latency():
    # compute is far smaller than communication here, so what hides is fixed (half of each
    # unit's compute) and adding latency adds exactly count x steps x latency: 2 passes x 18
    # fetched tensors + ceil(327,936 / 1000) = 328 reduce-scatter buckets. The group of 4 spans
    # 2 nodes with 2 ranks each: hierarchically 1 intra-node step and 1 network step per
    # collective (the flat ring's 3 network steps would triple it)
    plan = z3()
    base = comm_total(plan)
    slow = comm_total(plan, cluster(inter_lat=10.0))
    assert slow - base == pytest.approx((2 * FETCHED + math.ceil(PSI_T1 / 1000)) * 1 * 10e-6, rel=1e-11, abs=0)
    intra = comm_total(plan, cluster(intra_lat=4.0))
    assert intra - base == pytest.approx((2 * FETCHED + 328) * 1 * 4e-6, rel=1e-11, abs=0)
    # latency_scale multiplies it
    scaled = dataclasses.replace(DEV, factors={**DEV.factors, "latency_scale": 0.5})
    half = comm_total(plan, cluster(dev=scaled, inter_lat=10.0))
    assert half - base == pytest.approx((2 * FETCHED + 328) * 1 * 10e-6 * 0.5, rel=1e-11, abs=0)
    # a bigger reduce bucket means fewer reduce-scatters: 33 buckets of 10,000
    big = comm_total(dataclasses.replace(plan, bucket_elements=10_000), cluster(inter_lat=10.0))
    assert big - comm_total(dataclasses.replace(plan, bucket_elements=10_000)) == pytest.approx(
        (2 * FETCHED + 33) * 1 * 10e-6, rel=1e-11, abs=0)


def test_fetch_overhead_is_per_fetched_tensor_and_never_hidden():
    dev = dataclasses.replace(DEV, factors={**DEV.factors, "zero3_fetch_overhead_s": 1e-3})
    t0 = run(z3(), c=cluster()).time.zero_gather
    t1 = run(z3(), c=cluster(dev=dev)).time.zero_gather
    assert t1 - t0 == pytest.approx(2 * FETCHED * 1e-3, rel=1e-11, abs=0)
    # a checkpointed block is gathered for its recompute, and its backward gathers again what was
    # released in between: with a reuse distance of 1000 elements all but the FFN output (3 x 4 more)
    r0 = run(z3(recompute="full"), c=cluster()).time.zero_gather
    r1 = run(z3(recompute="full"), c=cluster(dev=dev)).time.zero_gather
    assert r1 - r0 == pytest.approx((2 * FETCHED + 12) * 1e-3, rel=1e-11, abs=0)


def test_recompute_gathers_again_only_what_was_released():
    # reuse distance (stage3_max_reuse_distance = the live elements): between a tensor's
    # recompute and its backward the tensors after it run twice
    assert zero.reuse_gathers(FETCHED_BLOCK, 1000) == (12_288, 4_096, 16_384)
    assert zero.reuse_gathers(FETCHED_BLOCK, 32_768) == (12_288, 4_096)        # FFN in: 2 x 16,384 away
    assert zero.reuse_gathers(FETCHED_BLOCK, 2 * 36_864) == ()
    # the regathered 32,768 elements of each of the 4 blocks join backward's collectives, whose
    # window grows by the blocks' forward: on this slow network only half of that forward hides
    from test_cost_terms import F_T1
    ag = 2 * (3 / 4) / INTER
    extra = comm_total(z3(recompute="full")) - comm_total(z3())
    assert extra == pytest.approx(4 * (32_768 * ag - 0.5 * F_T1), rel=1e-11, abs=0)
    kept = comm_total(z3(recompute="full", live_elements=100_000)) - comm_total(z3(live_elements=100_000))
    assert kept == pytest.approx(4 * (0 - 0.5 * F_T1), rel=1e-11, abs=0)


def test_qwz_gathers_forward_weights_in_int8():
    ag = (3 / 4) / INTER
    diff = comm_total(z3()) - comm_total(z3(quantized_weights=True))
    # forward gathers: 2 bytes -> 1 + 4/2048 per element (int8 and one fp32 scale per 2048)
    assert diff == pytest.approx(FETCHED_ELEMS * (2 - (1 + 4 / 2048)) * ag, rel=1e-11, abs=0)


def test_hpz_keeps_backward_gathers_inside_the_node():
    # hpZ 2: backward gathers over the 2 ranks of a node (INTRA, (2-1)/2) instead of 4 across
    # nodes; what backward hides is half its compute, at most the gathers themselves
    from test_cost_terms import B_T1, FIRST_C, last_c
    units = [(63_936, 2 * FIRST_C / 3, 1), (49_152, B_T1, 4), (63_936, 2 * last_c(999) / 3, 1)]
    diff = 0.0
    for elems, bw, count in units:
        across, inside = elems * 2 * (3 / 4) / INTER, elems * 2 * (1 / 2) / INTRA
        diff += count * ((across - min(across, 0.5 * bw)) - (inside - min(inside, 0.5 * bw)))
    assert comm_total(z3()) - comm_total(z3(hpz=2)) == pytest.approx(diff, rel=1e-11, abs=0)
    # the embedding's backward is too short to hide even the node-local gather; the blocks' hides it
    assert 63_936 * 1e-11 > 0.5 * 2 * FIRST_C / 3 and 49_152 * 1e-11 < 0.5 * B_T1


def test_mics_shards_inside_the_node_and_all_reduces_across_replicas():
    # MiCS 2: every gather and reduce-scatter inside the node (2 ranks, INTRA); once per step
    # the gradient partition (psi / 2, bf16) is all-reduced across the 2 replicas, whose two
    # groups {0, 2} and {1, 3} both cross nodes: each gets half a node's network
    t = run(z3(mics_shard=2, grad_accum=2), c=cluster()).time
    plain = run(z3(dp=2, grad_accum=2), c=cluster(nodes=1)).time     # the same shard group alone
    ar = PSI_T1 * 2 / 2 * 2 * (1 / 2) / (INTER / 2)
    assert t.dp_sync + t.zero_gather == pytest.approx(plain.dp_sync + plain.zero_gather + ar, rel=1e-11, abs=0)


def test_qgz_reduces_in_int4_inside_then_across_nodes():
    # one 1000-element... bucket: intra-node reduce-scatter of 0.5 + 4/2048 bytes per element
    # over 2 ranks, then across the 2 nodes over half of it
    q = 0.5 + 4 / 2048
    rs = PSI_T1 * q * (1 / 2) / INTRA + PSI_T1 / 2 * q * (1 / 2) / INTER
    plain = PSI_T1 * 2 * (3 / 4) / INTER
    # with overlap off and this little compute, the reduction is exposed in full either way
    assert comm_total(z3()) - comm_total(z3(quantized_gradients=True)) == pytest.approx(plain - rs, rel=1e-11, abs=0)


def test_optimizer_offload_moves_states_to_the_host_and_adam_to_the_cpu():
    plan = z3(offload_optimizer="cpu")
    est = run(plan, c=cluster())
    part = PSI_T1 / 4
    # Adam over the partition, the node's 2 ranks sharing 1e9 params/s; the bf16 partition back over PCIe
    assert est.time.optimizer == pytest.approx(part * 2 / 1e9 + part * 2 / 10e9, rel=1e-12, abs=0)
    # host: fp32 master, two moments, the fp32 gradient and the bf16 gradient partition: 18 bytes per element
    assert est.host_memory_bytes == pytest.approx(18 * part, rel=1e-12, abs=0)
    assert est.stage_memory[0].optimizer == 0.0
    # NVMe: the swap of 28 bytes per element for the node's 2 ranks at 5 GB/s is slower than Adam here? no:
    nv = run(z3(offload_optimizer="nvme"), c=cluster())
    swap = part * 28 * 2 / 5e9
    assert nv.time.optimizer == pytest.approx(max(part * 2 / 1e9, swap) + part * 2 / 10e9, rel=1e-12, abs=0)
    assert nv.nvme_bytes == pytest.approx(18 * part, rel=1e-12, abs=0)        # master, moments, both gradients
    # the host keeps a double-buffered sub-group (min(partition, 1000) x 32 bytes)
    assert nv.host_memory_bytes == pytest.approx(32 * 1000, rel=1e-12, abs=0)


def test_zero12_offload_buffers():
    # ZeRO-1/2 with optimizer offload, measured by the executor (tests/integration/test_zero_variants.py):
    # device: the weights and a staging buffer of the largest tensor (63,936: embedding / output);
    # host: fp32 master, moments and gradient, a 16-bit partition for the copy back, a staging
    # buffer; ZeRO-2 accumulating over micro-batches also keeps a 16-bit accumulated partition
    psi, largest = 1000.0, 63_936
    for zero, accum, extra in ((1, 1, 0), (2, 1, 0), (2, 2, 2 * psi / 4)):
        plan = Plan(dp=4, zero=zero, grad_accum=accum, offload_optimizer="cpu")
        assert engines.state_bytes(plan, psi, 0.0, "device", largest) == pytest.approx(2 * psi + 2 * largest)
        assert engines.state_bytes(plan, psi, 0.0, "host", largest) == pytest.approx(
            (4 + 8 + 4 + 2) * psi / 4 + 2 * largest + extra)
    z3 = Plan(dp=4, zero=3, offload_optimizer="cpu")
    assert engines.state_bytes(z3, psi, 100.0, "host") == pytest.approx((4 + 8 + 4 + 2) * psi / 4)
    assert engines.state_bytes(z3, psi, 100.0, "device") == pytest.approx(2 * psi / 4 + 2 * 100 + 2 * 50_000_000)


def test_zero2_offload_copies_gradients_every_micro_batch():
    plan = Plan(dp=4, zero=2, micro_batch=1, grad_accum=2, bucket_elements=1000, overlap_comm=False)
    with_off = run(dataclasses.replace(plan, offload_optimizer="cpu"), c=cluster()).time.dp_sync
    without = run(plan, c=cluster()).time.dp_sync
    assert with_off - without == pytest.approx(2 * PSI_T1 / 4 * 2 / 10e9, rel=1e-11, abs=0)


def test_parameter_offload_copies_each_partition_before_its_gather():
    # each fetched tensor's 1/4 partition crosses PCIe before each of its 2 gathers; compute is
    # too small to hide it
    diff = comm_total(z3(offload_params="cpu")) - comm_total(z3())
    assert diff == pytest.approx(2 * FETCHED_ELEMS * 2 / 4 / 10e9, rel=1e-11, abs=0)
    est = run(z3(offload_params="cpu"), c=cluster())
    assert est.host_memory_bytes == pytest.approx(2 * PSI_T1 / 4, rel=1e-12, abs=0)   # the bf16 partition


def test_variant_memory_on_the_device():
    psi, small = 1000.0, 100.0
    p = z3(hpz=2)
    held, back, _ = engines.footprint(p).evaluate(psi, small)
    plain, _, _ = engines.footprint(z3()).evaluate(psi, small)
    assert held[0] - plain[0] == pytest.approx(2 * (psi - small) / 2)       # the secondary partition (no small ones)
    q_back = engines.footprint(z3(quantized_weights=True)).evaluate(psi, small)[1]
    p_back = engines.footprint(z3()).evaluate(psi, small)[1]
    assert q_back[3] - p_back[3] == pytest.approx(1 * min(psi, 1000))       # int8 gathered weights
    m_held, _, _ = engines.footprint(z3(mics_shard=2)).evaluate(psi, small)
    assert m_held[2] == pytest.approx(12 * psi / 2)                          # optimizer over 2, not 4


def test_variants_that_cannot_run_say_so():
    c = cluster()
    t = train(z3())
    assert any("hpz 3" in r.line for r in plan_problems(MODEL, cluster(per_node=3, nodes=1), train(z3(dp=3)), z3(dp=3, hpz=3))) is False
    six = cluster(nodes=1, per_node=6)
    assert any("plan.hpz 4 does not divide" in r.line for r in plan_problems(MODEL, six, train(Plan(dp=4, zero=3)),
                                                                         Plan(dp=4, zero=3, hpz=4)))
    assert any("--nvme-gbps" in r.line for r in plan_problems(MODEL, cluster(host=dataclasses.replace(HOST, nvme_gbps=0)),
                                                         t, z3(offload_optimizer="nvme")))
    assert any("--cpu-mem-gb" in r.line for r in plan_problems(MODEL, cluster(dev=DEVICE), t, z3(offload_optimizer="cpu")))
    from planner.specs import parse_cluster
    cpu = parse_cluster("4xcpu")
    assert any("quantizer" in r.line for r in plan_problems(MODEL, cpu, t, z3(quantized_weights=True)))
    assert any("quantizer" in r.line for r in plan_problems(MODEL, cpu, t, z3(quantized_gradients=True)))
    assert not any("quantizer" in r.line for r in plan_problems(MODEL, cpu, t, z3(hpz=2)))
    from planner.cost import estimate
    small = cluster(host=dataclasses.replace(HOST, cpu_memory_gb=1e-4))
    reasons = estimate(MODEL, small, t, z3(offload_optimizer="cpu")).reasons
    # 2 ranks x 16 bytes x 327,936 / 4 = 2.6 MB per node > 90% of 0.1 MB
    assert reasons == ("offloaded states need 0 GB of host memory per node > 0 GB usable of 0 GB (--cpu-mem-gb): "
                       "offload less, use NVMe, or more nodes",)
    for kw, field in ((dict(dp=4, zero=3, mics_shard=3), "plan.mics_shard"), (dict(dp=4, zero=3, hpz=3), "plan.hpz"),
                      (dict(dp=4, zero=2, hpz=2), "plan.hpz"), (dict(dp=4, zero=0, offload_optimizer="cpu"),
                                                                 "plan.offload_optimizer"),
                      (dict(dp=4, zero=2, offload_params="cpu"), "plan.offload_params"),
                      (dict(dp=4, zero=3, offload_params="disk"), "plan.offload_params")):
        with pytest.raises(SpecError, match=field):
            Plan(**kw)


def test_units_of_a_zero3_model():
    us = zero.units(MODEL, z3(), 1.0, 2.0, (0.1, 0.2), (0.3, 0.6), 1, 640)
    assert [(u.tensors, u.count, u.recomputed) for u in us] == [
        ((63_936,), 1, False), (FETCHED_BLOCK, 3, False), (FETCHED_BLOCK, 1, True), ((63_936,), 1, False)]


# --- what the mutation run found untested ---------------------------------------------------
def test_engine_names_say_which_variants_apply():
    base = engines.engine_for(z3()).name
    assert base == "DeepSpeedZeroOptimizer_Stage3"
    full = z3(offload_optimizer="cpu", offload_params="cpu", hpz=2, quantized_weights=True)
    assert engines.engine_for(full).name == base + " + optimizer offload to cpu, parameter offload to cpu, hpZ, qwZ"
    assert engines.engine_for(z3(offload_params="nvme")).name == base + " + parameter offload to nvme"


def test_nvme_parameters_keep_a_host_swap_buffer_of_the_live_parameters():
    # psi 10,000 > live 1000: the swap buffer is capped by the live parameters, on the host;
    # the weight partition (10,000 / 4 x 2 bytes) on NVMe
    plan = z3(offload_params="nvme")
    assert engines.host_bytes(plan, 10_000.0, 0.0) == pytest.approx(2 * 1000)
    assert engines.host_bytes(plan, 10_000.0, 0.0, location="nvme") == pytest.approx(2 * 10_000 / 4)
    # on the device: the reduce bucket, the gradient partition and the optimizer states, no weights
    assert engines.state_bytes(plan, 10_000.0, 0.0) == pytest.approx(2 * 1000 + 2 * 10_000 / 4 + 12 * 10_000 / 4)
    # qwZ's int8 buffer is capped the same way (backward phase, buckets)
    q = engines.footprint(z3(quantized_weights=True)).evaluate(10_000.0, 0.0)[1][3]
    p = engines.footprint(z3()).evaluate(10_000.0, 0.0)[1][3]
    assert q - p == pytest.approx(1 * 1000)


def test_footprint_locations_and_staging_buffers():
    # the search's precompiled footprint agrees with the buffers: a GPU leaves host and NVMe
    # buffers out, a CPU device (resident) counts the host ones and never the NVMe ones
    psi, small, largest = 10_000.0, 100.0, 4_000.0
    for plan in (z3(offload_optimizer="cpu", hpz=2), z3(offload_optimizer="nvme", offload_params="nvme"),
                 Plan(dp=4, zero=1, offload_optimizer="cpu"), Plan(dp=4, zero=2, grad_accum=2, offload_optimizer="cpu"),
                 Plan(dp=4, zero=2, offload_optimizer="cpu")):
        eng = engines.engine_for(plan)
        for resident in (False, True):
            held, back, step = engines.footprint(plan, resident, largest).evaluate(psi, small)
            sz = engines.sizes(plan, psi, small, largest=largest)
            want = sum(eng.bytes_by_role(sz, ("always", "grads"), location="device").values())
            if resident:
                want += sum(eng.bytes_by_role(sz, ("always", "grads"), location="host").values())
            assert sum(held) == pytest.approx(want, rel=1e-12, abs=0)
    # ZeRO-1 offload: the device staging buffer is the largest tensor's size
    held, _, _ = engines.footprint(Plan(dp=4, zero=1, offload_optimizer="cpu"), False, largest).evaluate(psi, 0.0)
    assert held[2] == pytest.approx(2 * largest)                        # optimizer role on the device
    # hpZ through the buffers' own sizes too
    sz = engines.sizes(z3(hpz=2), psi, small)
    assert engines.engine_for(z3(hpz=2)).bytes_by_role(sz)["params"] == pytest.approx(
        2 * psi / 4 + 2 * small + 2 * (psi - small) / 2)
    # the host bytes count the ZeRO-1/2 staging buffer of the largest tensor
    assert engines.host_bytes(Plan(dp=4, zero=1, offload_optimizer="cpu"), psi, 0.0, largest=largest) == \
        pytest.approx(18 * psi / 4 + 2 * largest)
    assert engines.state_bytes(Plan(dp=4, zero=2), psi, 0.0) == pytest.approx(2 * psi + 2 * psi / 4 + 12 * psi / 4)


def cpu_cluster():
    from planner.specs import parse_cluster
    return parse_cluster("2xcpu")


def test_a_cpu_device_copies_and_steps_in_its_own_memory():
    c = cpu_cluster()
    f = device_factors(c.device).replace(optimizer_scale=2.0)
    hbm = c.device.hbm_bandwidth_gbps * 1e9
    assert zero.host_copy(c, 1e6) == pytest.approx(1e6 / hbm, rel=1e-12, abs=0)
    plan = Plan(dp=2, zero=2, offload_optimizer="cpu")
    # no PCIe and no CPU Adam: the memory-bound step over the partition (28 bytes per element)
    assert zero.offload_step_time(c, plan, 1e6, 2.0, f) == pytest.approx(1e6 / 2 * 28 / hbm * 2.0, rel=1e-12, abs=0)


def test_offload_step_time_on_a_node_of_one_gpu_and_its_scales():
    one = cluster(nodes=1, per_node=1)
    f = device_factors(DEV).replace(cpu_adam_scale=1.5, optimizer_scale=1.0)
    plan = Plan(dp=1, zero=2, offload_optimizer="cpu")
    assert zero.offload_step_time(one, plan, 1e6, 2.0, f) == pytest.approx(1e6 / 1e9 * 1.5 + 1e6 * 2 / 10e9,
                                                                           rel=1e-12, abs=0)
    nv = Plan(dp=1, zero=3, offload_optimizer="nvme")
    assert zero.offload_step_time(one, nv, 1e6, 4.0, f) == pytest.approx(
        max(1e6 / 1e9 * 1.5, 1e6 * 28 / 5e9) + 1e6 * 4 / 10e9, rel=1e-12, abs=0)
    # TP 2 on the 2-GPU node leaves one rank per node sharing the CPU
    tp = Plan(dp=2, tp=2, zero=2, offload_optimizer="cpu")
    assert zero.offload_step_time(cluster(), tp, 1e6, 2.0, f) == pytest.approx(
        1e6 / 2 / 1e9 * 1.5 + 1e6 / 2 * 2 / 10e9, rel=1e-12, abs=0)


def test_offload_in_fp32_moves_4_byte_gradients_and_weights():
    # fp32: the gradient copies and the weights back are 4 bytes per element
    t16 = run(z3(offload_optimizer="cpu"), c=cluster()).time
    t32 = run(z3(offload_optimizer="cpu", precision="fp32"), c=cluster()).time
    part = PSI_T1 / 4
    assert t32.optimizer - t16.optimizer == pytest.approx(part * 2 / 10e9, rel=1e-11, abs=0)
    z2 = Plan(dp=4, zero=2, micro_batch=1, grad_accum=2, bucket_elements=1000, overlap_comm=False)
    a = run(dataclasses.replace(z2, offload_optimizer="cpu", precision="fp32"), c=cluster()).time.dp_sync
    b = run(dataclasses.replace(z2, precision="fp32"), c=cluster()).time.dp_sync
    assert a - b == pytest.approx(2 * PSI_T1 / 4 * 4 / 10e9, rel=1e-12, abs=0)


def test_zero1_offload_copies_once_per_step_and_pipelines_do_not_overlap_it():
    z1 = Plan(dp=4, zero=1, micro_batch=1, grad_accum=2, bucket_elements=1000, overlap_comm=False)
    a = run(dataclasses.replace(z1, offload_optimizer="cpu"), c=cluster()).time.dp_sync
    b = run(z1, c=cluster()).time.dp_sync
    assert a - b == pytest.approx(PSI_T1 / 4 * 2 / 10e9, rel=1e-12, abs=0)           # once per step
    # one rank, no DP traffic: the copy is all there is (ZeRO-Offload on one GPU)
    solo = Plan(dp=1, zero=2, micro_batch=1, grad_accum=2, overlap_comm=False, offload_optimizer="cpu")
    assert run(solo, c=cluster(nodes=1, per_node=1)).time.dp_sync == pytest.approx(2 * PSI_T1 * 2 / 10e9, rel=1e-12, abs=0)


def test_zero12_latency_is_paid_per_bucket():
    # ZeRO-2 DP 4 over 2 nodes, 10 us per network step: per micro-batch 328 reduce-scatters of
    # 1000 elements, per step 328 all-gathers, each 1 network step (2 nodes, hierarchical) where
    # a flat ring would take 3; with no overlap all of it is exposed
    plan = Plan(dp=4, zero=2, micro_batch=1, grad_accum=2, bucket_elements=1000, overlap_comm=False)
    slow = run(plan, c=cluster(inter_lat=10.0)).time.dp_sync
    base = run(plan, c=cluster()).time.dp_sync
    assert slow - base == pytest.approx((2 * 328 + 328) * 1 * 10e-6, rel=1e-11, abs=0)
    # one bucket when the model is smaller than the bucket; ZeRO-0's flat buffer holds 5e8 elements
    big = dataclasses.replace(plan, bucket_elements=1_000_000)
    assert run(big, c=cluster(inter_lat=10.0)).time.dp_sync - run(big, c=cluster()).time.dp_sync == \
        pytest.approx((2 + 1) * 1 * 10e-6, rel=1e-11, abs=0)
    z0 = Plan(dp=4, zero=0, micro_batch=1, grad_accum=2, bucket_elements=1000, precision="fp32")
    # one all-reduce over 2 nodes x 2: ring and tree both take 2 network steps (2 (m - 1) =
    # 2 ceil(log2 m)) and 2 (k - 1) = 2 intra-node steps
    assert run(z0, c=cluster(inter_lat=10.0)).time.dp_sync - run(z0, c=cluster()).time.dp_sync == \
        pytest.approx(2 * 10e-6, rel=1e-11, abs=0)
    assert run(z0, c=cluster(intra_lat=3.0)).time.dp_sync - run(z0, c=cluster()).time.dp_sync == \
        pytest.approx(2 * 3e-6, rel=1e-11, abs=0)


def test_zero3_counts_its_collectives_and_fetches():
    from planner.cost.estimate import zero3_comm
    from planner.cost.factors import cluster_factors
    from planner.cost.block import block_times
    from planner.cost.model import layer_costs_of
    c = cluster()
    for plan, fetches, colls in ((z3(), 2 * FETCHED, 2 * FETCHED + 328),
                                 (z3(quantized_gradients=True), 2 * FETCHED, 2 * FETCHED + 2 * 328),
                                 (z3(recompute="full"), 2 * FETCHED + 12, 2 * FETCHED + 12 + 328)):
        f = cluster_factors(c)
        bt = block_times(MODEL, c, train(plan), plan, f)
        lc = layer_costs_of(MODEL, c, train(plan), plan, f, bt)
        ckpt = plan.checkpointed_per_stage(MODEL.layers)[0]
        z = zero3_comm(MODEL, c, plan, f, lc, bt, ckpt)
        assert (z.fetches, z.collectives) == (fetches, colls)


def test_zero3_offload_copies_gradients_and_parameters_for_recompute():
    # optimizer offload: the reduced partition crosses PCIe every micro-batch, behind backward with
    # the reduce-scatters (here nothing more hides: the network is the bottleneck)
    a = comm_total(z3(offload_optimizer="cpu"))
    assert a - comm_total(z3()) == pytest.approx(PSI_T1 * 2 / 4 / 10e9, rel=1e-11, abs=0)
    # parameter offload under recompute: the regathered tensors (32,768 per block) are copied again
    r = comm_total(z3(recompute="full", offload_params="cpu")) - comm_total(z3(recompute="full"))
    assert r == pytest.approx((2 * FETCHED_ELEMS + 4 * 32_768) * 2 / 4 / 10e9, rel=1e-11, abs=0)


def test_units_at_the_threshold_and_a_tied_output_layer():
    # a tensor of exactly the threshold stays whole (DeepSpeed: ds_numel <= threshold)
    us = zero.units(MODEL, z3(), 1.0, 2.0, (0.1, 0.2), (0.3, 0.6), 0, 4_096)
    assert us[1].tensors == (12_288, 16_384, 16_384)
    assert us[0].tensors == (63_936,) and us[-1].tensors == (63_936,)
    tied = dataclasses.replace(MODEL, tied_embeddings=True)
    us = zero.units(tied, z3(), 1.0, 2.0, (0.1, 0.2), (0.3, 0.6), 0, 640)
    assert us[-1].tensors == () and us[-1].elements == 128     # the output layer is the embedding


def test_the_host_check_counts_every_rank_of_the_node():
    from planner.cost import estimate
    t = train(z3())
    part = PSI_T1 / 4
    need = 2 * 18 * part                                         # 2 ranks per node, 18 bytes per element
    ok = cluster(host=dataclasses.replace(HOST, cpu_memory_gb=need / 0.9 / 1e9 * 1.01))
    short = cluster(host=dataclasses.replace(HOST, cpu_memory_gb=need / 0.9 / 1e9 * 0.99))
    assert not estimate(MODEL, ok, t, z3(offload_optimizer="cpu")).reasons
    assert any("host memory per node" in r for r in estimate(MODEL, short, t, z3(offload_optimizer="cpu")).reasons)
    # a CPU cluster is its own host: no separate host check
    assert not any("host memory" in r for r in estimate(MODEL, cpu_cluster(), train(Plan(dp=2, zero=3)),
                                                        Plan(dp=2, zero=3, offload_optimizer="cpu")).reasons)


def test_headroom_is_the_fixed_allowance_inside_the_peak():
    base = run(z3(), c=cluster())
    assert base.headroom_bytes == 1e9
    more = run(z3(), c=dataclasses.replace(cluster(), memory_headroom=2.5))
    assert more.headroom_bytes == 2.5e9
    assert more.peak_memory_bytes - base.peak_memory_bytes == pytest.approx(1.5e9, rel=1e-12, abs=0)


def test_qgz_inside_one_node_is_one_int4_reduce_scatter():
    # DP 2 on one node of 2: no second hop, the reduce-scatter itself carries int4
    one = cluster(nodes=1)
    q = 0.5 + 4 / 2048
    plain = comm_total(z3(dp=2), one)
    quant = comm_total(z3(dp=2, quantized_gradients=True), one)
    assert plain - quant == pytest.approx(PSI_T1 * (2 - q) * (1 / 2) / INTRA, rel=1e-11, abs=0)


def test_nvme_parameters_share_the_nodes_nvme():
    # one GPU per node (DP 4 over 4 nodes): each fetched partition is read from the node's NVMe
    # (5 GB/s, the node's only rank) and copied over PCIe, before each of its 2 gathers
    four = cluster(nodes=4, per_node=1)
    diff = comm_total(z3(offload_params="nvme"), four) - comm_total(z3(offload_params="cpu"), four)
    assert diff == pytest.approx(2 * FETCHED_ELEMS * 2 / 4 / 5e9, rel=1e-11, abs=0)


def test_zero3_windows_include_tp_and_reduce_scatters_hide_with_overlap():
    # on a fast network (100x INTRA inside the node, DP 2 on one node) compute exceeds the
    # gathers: with overlap_comm the reduce-scatters hide too, without it they are exposed
    fast = cluster(nodes=1, per_node=2)
    fast = dataclasses.replace(fast, intra_node=Link(name="i", busbw_gbps=INTRA / 1e9 * 100, latency_us=0))
    on = comm_total(z3(dp=2, overlap_comm=True), fast)
    off = comm_total(z3(dp=2, overlap_comm=False), fast)
    assert on == pytest.approx(0.0, abs=1e-15) and off > 0
    # TP 2 x DP 2 on 2 x 2: the blocks' TP collectives are part of the windows the gathers hide behind
    from planner.cost.estimate import zero3_comm
    from planner.cost.factors import cluster_factors
    from planner.cost.block import block_times
    from planner.cost.model import layer_costs_of
    plan = Plan(dp=2, tp=2, zero=3, micro_batch=1, grad_accum=1, bucket_elements=1000, overlap_comm=False)
    c = cluster()
    f = cluster_factors(c)
    bt = block_times(MODEL, c, train(plan), plan, f)
    lc = layer_costs_of(MODEL, c, train(plan), plan, f, bt)
    seen = []
    orig = zero.units
    zero.units = lambda *a: seen.append(a) or orig(*a)
    try:
        zero3_comm(MODEL, c, plan, f, lc, bt, 0)
    finally:
        zero.units = orig
    (_, _, fw, bw, first, last, _, _), = seen
    assert bt.tp_fwd > 0 and fw == bt.forward + bt.tp_fwd and bw == bt.backward + bt.tp_bwd
    one = lc.first_stage_time - lc.first_stage_tp
    assert first == (one / 3, 2 * one / 3) and lc.first_stage_tp > 0
    assert last[0] == pytest.approx((lc.last_stage_time - lc.last_stage_tp) / 3, rel=1e-15)


def test_zero3_in_fp32_gathers_4_bytes_per_element():
    # without any hiding (dp_overlap 0) the exposed communication is every byte on the wire:
    # 2 gathers of every fetched tensor and the reduce-scatters of the whole model, 4 bytes each
    none = dataclasses.replace(DEV, factors={**DEV.factors, "dp_overlap": 0.0})
    c = cluster(dev=none)
    assert comm_total(z3(precision="fp32"), c) == pytest.approx(
        (2 * FETCHED_ELEMS + PSI_T1) * 4 * (3 / 4) / INTER, rel=1e-11, abs=0)


def test_more_counts_and_latencies():
    from planner.cost.estimate import zero3_comm
    from planner.cost.factors import cluster_factors
    from planner.cost.block import block_times
    from planner.cost.model import layer_costs_of

    def counts(plan, c):
        f = cluster_factors(c)
        bt = block_times(MODEL, c, train(plan), plan, f)
        lc = layer_costs_of(MODEL, c, train(plan), plan, f, bt)
        z = zero3_comm(MODEL, c, plan, f, lc, bt, 0)
        return z.fetches, z.collectives
    # MiCS adds no per-micro-batch collective (its replica all-reduce is per step); one bucket
    # when the model is smaller than it
    assert counts(z3(mics_shard=2), cluster()) == (2 * FETCHED, 2 * FETCHED + 328)
    assert counts(z3(bucket_elements=1_000_000), cluster()) == (2 * FETCHED, 2 * FETCHED + 1)
    base = comm_total(z3(bucket_elements=1_000_000))
    assert comm_total(z3(bucket_elements=1_000_000), cluster(inter_lat=10.0)) - base == pytest.approx(
        (2 * FETCHED + 1) * 1 * 10e-6, rel=1e-11, abs=0)
    # qgZ's two hops pay their own links' latency: 1 step inside the node, 1 across
    q = z3(quantized_gradients=True)
    lat = comm_total(q, cluster(inter_lat=10.0, intra_lat=1.0)) - comm_total(q)
    # (the gathers: 1 intra-node step and 1 network step each)
    assert lat == pytest.approx(2 * FETCHED * (1e-6 + 10e-6) + 328 * (1e-6 + 10e-6), rel=1e-11, abs=0)
    # MiCS's replica all-reduce pays latency_scale too: 2 ranks, 2 steps of 10 us, halved
    m = z3(mics_shard=2)
    half = dataclasses.replace(DEV, factors={**DEV.factors, "latency_scale": 0.5})
    mics_lat = comm_total(m, cluster(dev=half, inter_lat=10.0)) - comm_total(m, cluster(dev=half))
    assert mics_lat == pytest.approx(2 * 10e-6 * 0.5, rel=1e-11, abs=0)


def test_estimate_host_bytes_and_message():
    from planner.cost import estimate
    z1 = Plan(dp=4, zero=1, micro_batch=1, grad_accum=1, offload_optimizer="cpu")
    est = run(z1, c=cluster())
    assert est.host_memory_bytes == pytest.approx(18 * PSI_T1 / 4 + 2 * 63_936, rel=1e-12, abs=0)  # + staging buffer
    # the reason names the node's need: every rank of the node, in GB
    from planner.specs import parse_cluster, preset
    from planner.specs import TrainSpec as T
    m, t = preset("glm-10b"), T(global_batch=16, seq_len=1024)
    c = parse_cluster("2x8xA100", cpu_mem_gb=80)
    e = estimate(m, c, t, Plan(dp=16, zero=3, offload_optimizer="cpu"))
    need = e.host_memory_bytes * 8 / 1e9
    assert need > 72 and any(f"offloaded states need {need:.0f} GB of host memory per node > 72 GB usable of 80 GB"
                             in r for r in e.reasons)
    # a CPU cluster keeps offloaded states in its own memory: no host check even with --cpu-mem-gb
    cpu = parse_cluster("2xcpu", cpu_mem_gb=1e-6)
    assert not any("host memory" in r for r in estimate(MODEL, cpu, train(Plan(dp=2, zero=3)),
                                                        Plan(dp=2, zero=3, offload_optimizer="cpu")).reasons)


def test_pipeline_offload_copy_is_not_hidden_and_defaults():
    # ZeRO-1 with a pipeline: DeepSpeed turns overlap_comm off, so the copy to the host is exposed
    p = Plan(dp=2, pp=2, zero=1, micro_batch=1, grad_accum=2, bucket_elements=1000, overlap_comm=True)
    a = run(dataclasses.replace(p, offload_optimizer="cpu"), c=cluster()).time.dp_sync
    b = run(p, c=cluster()).time.dp_sync
    from test_cost_terms import BLOCK_T1, HEAD_T1
    psi_last = 2 * BLOCK_T1 + HEAD_T1          # the slowest stage's parameters (stage 1: 2 blocks + head)
    assert a - b == pytest.approx(psi_last / 2 * 2 / 10e9, rel=1e-11, abs=0)
    # defaults: no largest-tensor buffer unless the size is given
    z1 = Plan(dp=4, zero=1, offload_optimizer="cpu")
    assert engines.state_bytes(z1, 1000.0, 0.0) == pytest.approx(2 * 1000)
    assert engines.host_bytes(z1, 1000.0, 0.0) == pytest.approx(18 * 1000 / 4)
    assert engines.footprint(z1).evaluate(1000.0, 0.0)[0][2] == 0.0
    assert engines.engine_for(z3(hpz=2)).name == "DeepSpeedZeroOptimizer_Stage3 + hpZ"


def test_live_parameters_bound_the_gathered_weights():
    # stage3_max_live_parameters apart from the bucket: 5000 live of a 10,000-element device
    plan = z3(live_elements=5_000)
    back = engines.footprint(plan).evaluate(10_000.0, 0.0)[1]
    assert back[3] == pytest.approx(2 * 5_000)                         # gathered weights, backward
    sz = engines.sizes(plan, 10_000.0, 0.0)
    assert engines.engine_for(plan).bytes_by_role(sz, ("backward",))["buckets"] == pytest.approx(2 * 5_000)


def test_nvme_parameters_on_a_node_of_two():
    # 2 ranks per node read their partitions through the node's one NVMe: twice the time each
    two = cluster()
    diff = comm_total(z3(offload_params="nvme"), two) - comm_total(z3(offload_params="cpu"), two)
    assert diff == pytest.approx(2 * FETCHED_ELEMS * 2 / 4 * 2 / 5e9, rel=1e-11, abs=0)


def test_a_plan_without_offload_keeps_nothing_off_the_device():
    est = run(z3(hpz=2), c=cluster())
    assert (est.host_memory_bytes, est.nvme_bytes) == (0.0, 0.0)
    assert (est.to_json()["host_memory_gb"], est.to_json()["nvme_gb"]) == (0.0, 0.0)
