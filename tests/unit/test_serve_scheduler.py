"""The engines' step scheduler (planner/serve/scheduler.py) and the workloads the simulation
serves with it (planner/serve/queue.py), on cases small enough to follow step by step."""
from __future__ import annotations

import math

import pytest

from planner.serve import queue
from planner.serve.scheduler import Scheduler, SchedulerConfig
from planner.serve.spec import Workload


def run_steps(cfg: SchedulerConfig, lens: list[tuple[int, int]], steps: int) -> list[tuple]:
    s = Scheduler(cfg, lens)
    for i in range(len(lens)):
        s.add(i)
    out = []
    for _ in range(steps):
        st = s.schedule()
        out.append((list(st.chunks), list(st.decodes), list(st.preempted)))
        s.complete(st)
    return out


def test_vllm_budget_mixes_chunks_and_decodes():
    # budget 8 tokens: A's prompt of 10 is cut 8 + 2; B (prompt 5) fills the 6 tokens left beside
    # A's last chunk; then both decode, one token each
    steps = run_steps(SchedulerConfig(engine="vllm", max_num_batched_tokens=8), [(10, 3), (5, 3)], 4)
    assert steps[0] == ([(0, 8, 0)], [], [])
    assert steps[1] == ([(0, 2, 8), (1, 5, 0)], [], [])
    assert steps[2] == ([], [0, 1], [])
    # unbounded budget: both prompts in one step (vLLM batches several prefills)
    assert run_steps(SchedulerConfig(engine="vllm"), [(10, 3), (5, 3)], 1)[0] == ([(0, 10, 0), (1, 5, 0)], [], [])


def test_vllm_decodes_first_then_new_prompts_in_the_same_step():
    s = Scheduler(SchedulerConfig(engine="vllm", max_num_batched_tokens=4), [(2, 5), (6, 2)])
    s.add(0)
    s.complete(s.schedule())              # A's prefill: its first token
    s.add(1)
    st = s.schedule()
    assert st.decodes == [0] and st.chunks == [(1, 3, 0)]   # A's decode takes 1 of the 4 tokens
    assert s.decode_context(st) == 3                       # A attends to its 2 cached + 1 new


def test_sglang_and_executor_do_not_mix():
    s = Scheduler(SchedulerConfig(engine="sglang", max_num_batched_tokens=4), [(2, 5), (6, 2)])
    s.add(0)
    s.complete(s.schedule())
    s.add(1)
    st = s.schedule()
    assert st.decodes == [] and st.chunks == [(1, 4, 0)]    # a prefill batch alone, chunked at 4
    # the executor: one whole prompt per step, prefills first
    steps = run_steps(SchedulerConfig(engine="executor"), [(10, 2), (5, 2)], 3)
    assert [c for c, _, _ in steps] == [[(0, 10, 0)], [(1, 5, 0)], []]
    assert steps[2][1] == [0, 1]


def test_vllm_v0_batches_whole_waiting_prompts_and_never_mixes():
    # vLLM V0 without chunked prefill: every waiting prompt that fits the budget goes into one
    # prefill step, whole; a prompt arriving while others decode waits for its own prefill step
    cfg = SchedulerConfig(engine="vllm-v0", max_num_batched_tokens=32768)
    steps = run_steps(cfg, [(256, 3), (256, 3), (300, 2)], 3)
    assert steps[0] == ([(0, 256, 0), (1, 256, 0), (2, 300, 0)], [], [])
    assert steps[1] == ([], [0, 1, 2], [])
    s = Scheduler(cfg, [(2, 5), (6, 2)])
    s.add(0)
    s.complete(s.schedule())
    s.add(1)
    st = s.schedule()
    assert st.decodes == [] and st.chunks == [(1, 6, 0)]    # the prefill alone, A's decode waits
    s.complete(st)
    assert s.schedule().decodes == [0, 1]
    # the budget caps a step and prompts are not cut: the third waits for the next prefill step
    steps = run_steps(SchedulerConfig(engine="vllm-v0", max_num_batched_tokens=600), [(256, 3)] * 3, 2)
    assert steps[0] == ([(0, 256, 0), (1, 256, 0)], [], [])
    assert steps[1] == ([(2, 256, 0)], [], [])


def test_blocks_on_demand_and_recompute_preemption():
    # 4 blocks of 4 tokens; two requests of prompt 4, output 6 (10 tokens, 3 blocks each): both
    # start (1 block each), grow, and when the 5th block is missing the last admitted is preempted
    cfg = SchedulerConfig(engine="vllm", block_size=4, kv_blocks=4)
    s = Scheduler(cfg, [(4, 6), (4, 6)])
    s.add(0)
    s.add(1)
    st = s.schedule()
    assert st.chunks == [(0, 4, 0), (1, 4, 0)] and s.free == 2
    s.complete(st)                        # both have 4 tokens cached and their first token out
    st = s.schedule()                     # each needs a second block for its 5th token
    assert st.decodes == [0, 1] and s.free == 0
    s.complete(st)
    for _ in range(3):                    # tokens 6..8 fit the second blocks
        s.complete(s.schedule())
    st = s.schedule()                     # 9th token: a third block each, none free: B preempted
    assert st.preempted == [1] and st.decodes == [0] and s.preemptions == 1
    assert s.target[1] == 4 + 5 and s.computed[1] == 0 and list(s.waiting) == [1]
    # B recomputes its prompt and 5 generated tokens once A has left
    r = queue.simulate(lambda n, c: 0.1, lambda b, c: 0.01, Workload(prompt_len=4, output_len=6), math.inf,
                       requests=2, max_batch=2, kv_blocks=4, block_size=4)
    assert r["preemptions"] == 1


def test_cache_too_small_for_one_request_is_an_error():
    with pytest.raises(ValueError, match="KV blocks"):
        Scheduler(SchedulerConfig(kv_blocks=2, block_size=4), [(8, 4)])


def test_prefix_caching_skips_the_shared_blocks():
    # a shared prefix of 20 tokens = 1 whole block of 16: the second request computes 30 - 16
    cfg = SchedulerConfig(engine="vllm", prefix_len=20, prefix_caching=True)
    s = Scheduler(cfg, [(30, 1), (30, 1)])
    s.add(0)
    st = s.schedule()
    assert st.chunks == [(0, 30, 0)]
    s.complete(st)
    s.add(1)
    assert s.schedule().chunks == [(1, 14, 16)]
    # without caching: the whole prompt again
    s = Scheduler(SchedulerConfig(engine="vllm", prefix_len=20), [(30, 1), (30, 1)])
    s.add(0)
    s.complete(s.schedule())
    s.add(1)
    assert s.schedule().chunks == [(1, 30, 0)]


def test_closed_loop_users():
    # one user: requests back to back, each alone: e2e = prefill + 3 decodes, QPS = 1 / e2e
    pre, dec = (lambda n, c: 0.1), (lambda b, c: 0.01)
    w = Workload(prompt_len=10, output_len=4)
    r = queue.simulate(pre, dec, w, math.inf, requests=5, max_batch=8, concurrency=1)
    assert r["e2e_s"]["p50"] == pytest.approx(0.13)
    assert r["achieved_qps"] == pytest.approx(1 / 0.13)
    # two users share the decode steps (executor: two prefills, then 3 decodes of both)
    r = queue.simulate(pre, dec, w, math.inf, requests=4, max_batch=8, concurrency=2, engine="executor")
    assert r["e2e_s"]["p50"] == pytest.approx(0.23)
    assert r["achieved_qps"] == pytest.approx(4 / 0.46)


def test_trace_lengths_and_mixed_step_cost():
    w = Workload(prompt_len=1, output_len=1, trace=((10, 2), (20, 3)))
    assert w.sample(3, None) == [(10, 2), (20, 3), (10, 2)]     # replayed in order, cycling
    assert w.max_total() == 23 and w.mean_lengths() == (15.0, 2.5)
    calls = []

    def mixed(chunks, batch, ctx):
        calls.append((tuple(chunks), batch, ctx))
        return 0.2
    queue.simulate(lambda n, c: 0.1, lambda b, c: 0.01, w, math.inf, requests=2, max_batch=4, mixed_fn=mixed)
    assert calls == [(((10, 0), (20, 0)), 0, 0)]                # both prompts in one mixed step


def test_finish_early_frees_the_request():
    # the executor's engine stops a request at its end-of-sequence token: it leaves the batch
    s = Scheduler(SchedulerConfig(engine="executor", max_num_seqs=1, block_size=4, kv_blocks=8), [(4, 9), (4, 2)])
    s.add(0)
    s.add(1)
    s.complete(s.schedule())
    assert s.running == [0] and s.free == 7 and s.schedule().decodes == [0]   # batch full: 1 waits
    s.finish(0)
    assert s.running == [] and s.free == 8
    assert s.schedule().chunks == [(1, 4, 0)]


def test_workload_round_trips_through_json():
    # serve_metrics.json and serve_plan.json store Workload.to_dict(); benchmarks rebuild it
    import json
    w = Workload(prompt_len=10, output_len=4, trace=((10, 2), (20, 3)), concurrency=3, prefix_len=4)
    assert Workload(**json.loads(json.dumps(w.to_dict()))) == w
    assert Workload(**Workload(prompt_len=5, output_len=2).to_dict()).trace == ()
