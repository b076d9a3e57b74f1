"""The deployment search of `planner serve` (planner/serve/search.py): what it ranks by."""
from __future__ import annotations

import pytest

from planner.cli.common import load_cluster, load_model
from planner.errors import SpecError
from planner.serve.search import Space, distinct, require_target, search_deployments, served_qps
from planner.serve.spec import Target, Workload

# one batch size, bf16, whole prompts: the only choice left is TP 1 x 2 replicas or TP 2 x 1
SPACE = Space(max_batch=(64,), weight_precision=("bf16",), kv_precision=("bf16",), prefill_chunk=(0,))


@pytest.fixture(scope="module")
def specs():
    return load_model("chatglm3-6b", None), load_cluster("2xA100", None, None, None, None)


def _search(specs, users, **kw):
    model, cluster = specs
    w = Workload(prompt_len=512, output_len=64, concurrency=users)
    return search_deployments(model, cluster, w, space=SPACE, requests=40, **kw)


def test_closed_loop_ranks_by_the_rate_its_users_get(specs):
    """One user keeps one engine busy at a time: two TP 1 replicas saturate higher (max QPS) but
    serve that user slower than one TP 2 engine, so TP 2 ranks first (ranking by saturation QPS,
    the old key, put TP 1 x 2 first)."""
    r = _search(specs, 1)
    by_tp = {e.deployment.tp: e for e in r.ranked}
    assert set(by_tp) == {1, 2} and r.concurrency == 1
    assert by_tp[1].max_qps > by_tp[2].max_qps            # the old key prefers TP 1 x 2 ...
    assert by_tp[2].rate_qps > by_tp[1].rate_qps           # ... the one user is served faster by TP 2
    assert r.ranked[0].deployment.tp == 2
    assert served_qps(r.ranked[0], Workload(prompt_len=512, output_len=64, concurrency=1)) == r.ranked[0].rate_qps
    assert served_qps(r.ranked[0], Workload(prompt_len=512, output_len=64)) == r.ranked[0].max_qps


@pytest.mark.parametrize("users", [1, 2])
def test_closed_loop_rate_counts_only_the_users_there_are(specs, users):
    """A closed loop's rate is its users over their mean request latency (Little's law, no think
    time): 1 user on 2 replicas is 1 user, not one per replica (the old scaling x replicas gave
    twice the rate at 1 user). 2 users on 2 replicas: one each, the same per-user rate."""
    e = {x.deployment.tp: x for x in _search(specs, users).ranked}[1]
    assert e.deployment.replicas == 2
    assert e.rate_qps * e.e2e_mean_s == pytest.approx(users, rel=0.02)


def test_closed_loop_qps_target_miss_names_the_users_rate(specs):
    with pytest.raises(SpecError) as err:
        require_target(_search(specs, 1, target=Target(kind="qps", value=50.0)), Target(kind="qps", value=50.0))
    assert "serves 1 users 2.1 QPS" in str(err.value) and "TP2 x 1" in str(err.value)


def test_closed_loop_shows_a_batch_above_its_users_once(specs):
    """8 users never fill a batch of 16 or 64: the same deployment for them (same rate, TTFT,
    TPOT, p99), though max QPS grows with the batch; one row, the smallest batch, is shown.
    Compared by max QPS (the open-loop rule) they were three rows."""
    model, cluster = specs
    w = Workload(prompt_len=512, output_len=64, concurrency=8)
    space = Space(tp=(2,), max_batch=(8, 16, 64), weight_precision=("bf16",), kv_precision=("bf16",),
                  prefill_chunk=(0,))
    ranked = search_deployments(model, cluster, w, space=space, requests=40).ranked
    assert len(ranked) == 3 and len({round(e.max_qps, 6) for e in ranked}) == 3
    assert len(distinct(ranked)) == 3
    assert [e.deployment.max_batch for e in distinct(ranked, 8)] == [8]
