"""The continuous-batching simulation (planner/serve/queue.py) on cases checkable by hand:
constant step times, so every latency is a sum of steps."""
from __future__ import annotations

import math

import pytest

from planner.serve import queue
from planner.serve.spec import Target, Workload


def constant(prefill: float, decode: float, calls: list | None = None):
    def pre(tokens: int, context: int) -> float:
        if calls is not None:
            calls.append(("prefill", tokens, context))
        return prefill

    def dec(batch: int, context_tokens: int) -> float:
        if calls is not None:
            calls.append(("decode", batch, context_tokens))
        return decode
    return pre, dec


def test_one_request_alone():
    calls: list = []
    pre, dec = constant(0.1, 0.01, calls)
    r = queue.simulate(pre, dec, Workload(prompt_len=10, output_len=4), 1.0, requests=1, max_batch=8)
    assert r["ttft_s"]["p50"] == pytest.approx(0.1)                    # TTFT = the prefill
    assert r["e2e_s"]["p50"] == pytest.approx(0.1 + 3 * 0.01)          # + (n - 1) decode steps
    assert r["tpot_s"]["p50"] == pytest.approx(0.01)
    # the decode steps attend to 11, 12, 13 tokens (prompt + generated, the new one included)
    assert calls == [("prefill", 10, 0), ("decode", 1, 11), ("decode", 1, 12), ("decode", 1, 13)]


def test_wake_cost_on_the_first_step_after_an_idle_wait():
    # 2 requests 10 s apart (rate 1e-9 ~ never overlapping): each one's prefill follows an idle
    # wait and pays wake_s; its decode steps do not
    calls: list = []
    pre, dec = constant(0.1, 0.01, calls)
    r = queue.simulate(pre, dec, Workload(prompt_len=10, output_len=4), 1e-3, requests=2, max_batch=8, wake_s=0.005)
    assert r["ttft_s"]["p50"] == pytest.approx(0.1 + 0.005)
    assert r["e2e_s"]["p50"] == pytest.approx(0.105 + 3 * 0.01)
    assert r["tpot_s"]["p50"] == pytest.approx(0.01)
    # all at time 0: only the very first step wakes the engine
    r = queue.simulate(pre, dec, Workload(prompt_len=10, output_len=1), math.inf, requests=2, max_batch=1,
                       wake_s=0.005)
    # TTFTs 0.005 + 0.1 and 0.105 + 0.1 (the second prefill follows the first, no wait): mean 0.155
    assert r["ttft_s"]["mean"] == pytest.approx((0.105 + 0.205) / 2)


def test_chunked_prefill_steps():
    calls: list = []
    pre, dec = constant(0.1, 0.01, calls)
    queue.simulate(pre, dec, Workload(prompt_len=10, output_len=2), 1.0, requests=1, prefill_chunk=4)
    assert calls == [("prefill", 4, 0), ("prefill", 4, 4), ("prefill", 2, 8), ("decode", 1, 11)]


def test_batch_of_one_serialises():
    pre, dec = constant(0.1, 0.01)
    r = queue.simulate(pre, dec, Workload(prompt_len=10, output_len=4), math.inf, requests=2, max_batch=1)
    # both at t = 0: the first ends at 0.13, the second starts then: TTFT 0.23, e2e 0.26
    assert r["ttft_s"]["mean"] == pytest.approx((0.1 + 0.23) / 2)
    assert r["e2e_s"]["mean"] == pytest.approx((0.13 + 0.26) / 2)
    assert r["achieved_qps"] == pytest.approx(2 / 0.26)


def test_batch_shares_decode_steps():
    calls: list = []
    pre, dec = constant(0.1, 0.01, calls)
    r = queue.simulate(pre, dec, Workload(prompt_len=10, output_len=4), math.inf, requests=2, max_batch=2)
    # two prefills (prefill first), then 3 decode steps of both: e2e 0.23 for both
    assert r["e2e_s"]["p50"] == pytest.approx(0.23)
    assert [c for c in calls if c[0] == "decode"] == [("decode", 2, 22), ("decode", 2, 24), ("decode", 2, 26)]


def test_kv_blocks_bound_the_batch():
    pre, dec = constant(0.1, 0.01)
    # each request needs ceil(14 / 16) = 1 block; one block: serial although max_batch is 2
    r = queue.simulate(pre, dec, Workload(prompt_len=10, output_len=4), math.inf, requests=2, max_batch=2, kv_blocks=1)
    assert r["e2e_s"]["mean"] == pytest.approx((0.13 + 0.26) / 2)


def test_saturation_throughput():
    # output 1: a request is one prefill; all queued at 0 the engine completes 1 / 0.1 per second
    pre, dec = constant(0.1, 0.01)
    r = queue.simulate(pre, dec, Workload(prompt_len=10, output_len=1), math.inf, requests=50, max_batch=4)
    assert r["achieved_qps"] == pytest.approx(10.0)
    # below saturation (1 QPS, 0.1 s of work each) almost nobody waits; above it the queue grows
    light = queue.simulate(pre, dec, Workload(prompt_len=10, output_len=1), 1.0, requests=200)
    heavy = queue.simulate(pre, dec, Workload(prompt_len=10, output_len=1), 20.0, requests=200)
    assert light["e2e_s"]["p50"] == pytest.approx(0.1)
    assert heavy["e2e_s"]["p50"] > 3.0


def test_seeded_lengths():
    w = Workload(prompt_len=100, output_len=50, prompt_sigma=0.5, output_sigma=0.5, seed=3)
    pre, dec = constant(0.1, 0.01)
    a = queue.simulate(pre, dec, w, 2.0, requests=30)
    b = queue.simulate(pre, dec, w, 2.0, requests=30)
    c = queue.simulate(pre, dec, w, 2.0, requests=30, seed=4)
    assert a == b and a != c


def test_qps_at_target_bisection():
    def run(rate: float) -> dict:          # latency equal to the rate: the answer is the target itself
        return {"e2e_s": {"p50": rate, "p99": 2 * rate}}
    assert queue.qps_at_target(run, Target(kind="p50", value=0.5), 1.0) == pytest.approx(0.5, rel=1e-2)
    assert queue.qps_at_target(run, Target(kind="p99", value=0.5), 1.0) == pytest.approx(0.25, rel=1e-2)
    assert queue.qps_at_target(run, Target(kind="p50", value=1e-4), 1.0) is None      # not even at no load
    assert queue.qps_at_target(run, Target(kind="p50", value=5.0), 1.0) == queue.SUSTAINABLE
    assert queue.qps_at_target(run, Target(kind="qps", value=0.8), 1.0) == 1.0
    assert queue.qps_at_target(run, Target(kind="qps", value=1.5), 1.0) is None


def test_draw_requests_is_sample_then_gaps_from_one_seeded_stream():
    import random
    w = Workload(prompt_len=10, output_len=4)  # no sigma: sample draws nothing from the stream
    lens, arrival = queue.draw_requests(w, 2.0, 3, seed=5)
    rng = random.Random(5)
    g = [rng.expovariate(1.0) for _ in range(3)]
    assert lens == [(10, 4)] * 3
    assert arrival == pytest.approx([g[0] / 2, (g[0] + g[1]) / 2, (g[0] + g[1] + g[2]) / 2])
    assert queue.draw_requests(w, math.inf, 3, seed=5)[1] == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        queue.draw_requests(w, 0.0, 3, seed=5)


def test_loadgen_sends_the_simulated_requests():
    pytest.importorskip("torch")
    from planner.runtime.serve.loadgen import make_requests
    w = Workload(prompt_len=20, output_len=8, prompt_sigma=0.4, output_sigma=0.4)
    lens, arrival = queue.draw_requests(w, 3.0, 12, seed=9, max_total=64)
    reqs = make_requests(w, 3.0, 12, 9, vocab=100, max_seq=64)
    assert [(len(r.prompt), r.output_len) for r in reqs] == lens
    assert [r.arrival_s for r in reqs] == arrival


def test_request_overhead_makes_the_next_closed_loop_request_wait_for_the_step_under_way():
    """Two users, prefill 1 s, decode 0.5 s (a mixed step costs both). r0 (1 token) and r1 (3
    tokens) are prefilled together (2 s); r0 is done and its user sends r2, which reaches the
    engine 0.1 s later: the decode of r1 (2.0-2.5 s) is under way, so r2 joins the next step
    (2.5-4.0 s). TTFT as the client sees it: r0, r1 2.0 + 0.1; r2 4.0 - 2.1 + 0.1 = 2.0. With no
    overhead r2 joins at 2.0 (step 2.0-3.5): TTFT 1.5."""
    pre, dec = constant(1.0, 0.5)
    w = Workload(prompt_len=10, output_len=3, trace=((10, 1), (10, 3), (10, 1)))
    r = queue.simulate(pre, dec, w, 1.0, requests=3, max_batch=2, concurrency=2, request_overhead_s=0.1)
    assert r["ttft_s"]["mean"] == pytest.approx((2.1 + 2.1 + 2.0) / 3)
    assert r["e2e_s"]["p99"] == pytest.approx(4.0 + 0.1, rel=0.01)  # r1: 0 -> 4.0, plus the overhead
    r0 = queue.simulate(pre, dec, w, 1.0, requests=3, max_batch=2, concurrency=2)
    assert r0["ttft_s"]["mean"] == pytest.approx((2.0 + 2.0 + 1.5) / 3)


def test_a_burst_reaches_an_idle_engine_one_request_at_a_time():
    """Three users send at once; the server hands their requests over 0.01 s apart (it tokenizes
    them in turn). The idle engine starts with r0 alone (prefill 1 s, one output token: done at
    1.0); r1 and r2 arrived during it and share the next step (the default mixed step is the sum
    of its chunks: 2 s, done at 3.0). TTFT, counted from the send at 0: 1.0, 3.0, 3.0. Handed over
    all at once (handover 0) the three share the first step: 3.0 each."""
    pre, dec = constant(1.0, 0.5)
    w = Workload(prompt_len=10, output_len=1, trace=((10, 1),) * 3)
    r = queue.simulate(pre, dec, w, 1.0, requests=3, max_batch=8, concurrency=3, handover_s=0.01)
    assert r["ttft_s"]["mean"] == pytest.approx((1.0 + 3.0 + 3.0) / 3)
    assert r["steps"] == 2
    r0 = queue.simulate(pre, dec, w, 1.0, requests=3, max_batch=8, concurrency=3)
    assert r0["ttft_s"]["mean"] == pytest.approx(3.0) and r0["steps"] == 1


def test_handover_is_the_servers_sequential_tokenization():
    from planner.serve import cost
    from planner.serve.spec import Deployment
    # vLLM issue #19012: the API server tokenizes requests one after another, ~1k tokens per ms
    assert cost.handover_s(Deployment(), 256) == pytest.approx(256e-6)
    assert cost.handover_s(Deployment(engine="sglang"), 1000) == pytest.approx(1e-3)
    assert cost.handover_s(Deployment(engine="executor"), 256) == 0.0  # in-process, already tokenized


def test_requests_stopping_at_end_of_sequence():
    from planner.errors import SpecError
    import random
    # L = 2: E[min(G, 2)] = 1 + (1 - p) = 2 - p, so a mean of 1.5 is p = 0.5
    assert Workload(prompt_len=4, output_len=2, mean_output_len=1.5).stop_probability() == pytest.approx(0.5)
    w = Workload(prompt_len=256, output_len=128, mean_output_len=100)
    outs = [o for _, o in w.sample(20_000, random.Random(1))]
    assert max(outs) == 128 and min(outs) >= 1 and sum(outs) / len(outs) == pytest.approx(100, rel=0.01)
    assert w.mean_lengths()[1] == 100
    assert Workload(prompt_len=256, output_len=128).stop_probability() == 0.0
    for bad in (dict(mean_output_len=129), dict(mean_output_len=0.5), dict(mean_output_len=50, trace=((4, 4),))):
        with pytest.raises(SpecError, match="--mean-output-len"):
            Workload(prompt_len=256, output_len=128, **bad)
