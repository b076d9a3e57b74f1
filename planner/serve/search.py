"""The deployment search behind `planner serve`.

Every (TP degree, max batch, weight precision, KV precision, prefill chunk) that uses all the
GPUs (replicas = GPUs / TP, TP inside a node) is sized in memory and given a cheap analytic
throughput and unloaded latency; the most promising `simulate` of them get the full estimate
(the queueing simulation and the bisection for the QPS at the target), and are ranked.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from planner.errors import SpecError
from planner.serve.cost import decode_step_time_s, prompt_time_s
from planner.serve.memory import serve_memory
from planner.serve.estimate import check_workload, deployment_problems, estimate_serving
from planner.serve.spec import SEARCH_WEIGHTS, Deployment, ServeEstimate, Target, Workload
from planner.specs.cluster import ClusterSpec
from planner.specs.model import ModelSpec

BATCHES = (1, 4, 8, 16, 32, 64, 128, 256)
CHUNKS = (0, 512, 8192)
"""Tokens per step: the engine's default (cost.engine_budget), small, large."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Space:
    """The choices the search enumerates (a CLI flag narrows one to a single value)."""

    tp: tuple[int, ...] = ()
    """TP degrees; () = every divisor of the GPU count that fits a node and the heads."""
    max_batch: tuple[int, ...] = BATCHES
    weight_precision: tuple[str, ...] = SEARCH_WEIGHTS
    kv_precision: tuple[str, ...] = ("bf16", "fp8")
    """fp8 only where the device supports it; int8 only when asked for."""
    prefill_chunk: tuple[int, ...] = CHUNKS
    engine: str = "vllm"
    prefix_caching: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeSearch:
    ranked: list[ServeEstimate]
    """Full estimates, best first."""
    evaluated: int
    infeasible: int
    reasons: dict[str, int] = field(default_factory=dict)
    """Infeasibility reason (first words) -> count."""
    concurrency: int = 0
    """The workload's closed-loop users (0: Poisson arrivals): the ranking's throughput is theirs."""


def candidates(model: ModelSpec, cluster: ClusterSpec, workload: Workload, space: Space) -> Iterable[Deployment]:
    n = cluster.world_size
    tps = space.tp or tuple(t for t in range(1, n + 1) if n % t == 0 and t <= cluster.gpus_per_node)
    kvs = tuple(k for k in space.kv_precision if k != "fp8" or cluster.device.fp8)
    wps = tuple(w for w in space.weight_precision if w != "fp8" or cluster.device.fp8)
    for t in tps:
        for b in space.max_batch:
            for w in wps:
                for kv in kvs:
                    for c in space.prefill_chunk:
                        if c and c >= workload.max_prompt():
                            continue  # a chunk longer than any prompt is the whole prompt
                        yield Deployment(tp=t, replicas=max(1, n // t), max_batch=b, weight_precision=w,
                                         kv_precision=kv, prefill_chunk=c, engine=space.engine,
                                         prefix_caching=space.prefix_caching)


def analytic(model: ModelSpec, cluster: ClusterSpec, dep: Deployment, workload: Workload,
             mem: dict[str, Any]) -> tuple[float, float]:
    """(throughput of all replicas with the batch full, requests/s; one request's latency alone, s):
    a full batch of B sequences finishes B requests every B prefills plus output_len decode steps
    at the mid-generation context; alone: its prefill plus output_len - 1 decode steps. In a
    closed loop of N users the batch never holds more than a replica's users (ceil(N / replicas))
    and only N users are served: the throughput is that batch's, taken N / B times (each user at
    the rate of one in that batch; exact when the replicas divide N)."""
    b = max(1, min(dep.max_batch, mem["batch_limit"]))
    if workload.concurrency:
        b = min(b, -(-workload.concurrency // dep.replicas))
    mp, mo = workload.mean_lengths()
    p, o = max(1, round(mp)), max(1, round(mo))
    pre = prompt_time_s(model, cluster, dep, p)
    mid = b * (p + o // 2 + 1)
    cycle = b * pre + o * decode_step_time_s(model, cluster, dep, b, mid)
    alone = pre + (o - 1) * decode_step_time_s(model, cluster, dep, 1, p + o // 2 + 1)
    if workload.concurrency:
        return min(workload.concurrency, dep.replicas * b) / cycle, alone
    return dep.replicas * b / cycle, alone


def served_qps(est: ServeEstimate, workload: Workload) -> float:
    """The throughput a deployment is ranked by: its saturation throughput (max_qps) for an open
    arrival stream, which may rise to it; in a closed loop of N users the rate those N users get
    (rate_qps, the simulated loop's achieved throughput), which no deployment exceeds whatever its
    saturation throughput: two replicas that 1 user cannot both keep busy serve 1 user's rate."""
    return est.rate_qps if workload.concurrency else est.max_qps


def _score(est: ServeEstimate, target: Target | None, workload: Workload) -> tuple:
    """Sort key, smaller is better."""
    qps = served_qps(est, workload)
    if target is None:
        return (-qps, est.e2e_p50_s)
    if target.kind == "qps":
        lat = est.e2e_p50_s if target.metric == "e2e" else getattr(est, f"{target.metric}_p50_s")
        return (not est.meets_target, lat, -qps)
    return (not est.meets_target, -(est.qps_at_target or 0.0), est.e2e_p50_s)


def search_deployments(model: ModelSpec, cluster: ClusterSpec, workload: Workload, *, target: Target | None = None,
                       space: Space = Space(), simulate: int = 24, requests: int = 300,
                       seed: int | None = None, rate_qps: float | None = None) -> ServeSearch:
    """Rank the deployments of `space` on `cluster` for `workload` (best first)."""
    check_workload(model, workload)
    pool, reasons, evaluated = [], {}, 0
    for dep in candidates(model, cluster, workload, space):
        evaluated += 1
        problems = deployment_problems(model, cluster, dep)
        mem = serve_memory(model, cluster, dep, workload)
        if not problems and not mem["fits"]:
            problems = ["does not fit in memory" if mem["short_gb"] > 0 else "KV cache holds no sequence"]
        if problems:
            key = problems[0]
            reasons[key] = reasons.get(key, 0) + 1
            continue
        qps, alone = analytic(model, cluster, dep, workload, mem)
        pool.append((dep, qps, alone))
    if not pool:
        return ServeSearch(ranked=[], evaluated=evaluated, infeasible=evaluated, reasons=reasons,
                           concurrency=workload.concurrency)
    if target is not None and target.kind in ("p50", "p99") and target.metric == "e2e":
        ok = [x for x in pool if x[2] <= target.value]
        rest = sorted((x for x in pool if x[2] > target.value), key=lambda x: x[2])
        picked = sorted(ok, key=lambda x: -x[1])[:simulate] or rest[:max(1, simulate // 4)]
        if len(picked) < simulate:
            picked += [x for x in sorted(ok, key=lambda x: x[2]) if x not in picked][:simulate // 4]
    elif target is not None and target.kind == "qps":
        ok = sorted((x for x in pool if x[1] >= 0.8 * target.value), key=lambda x: x[2])
        picked = ok[:simulate] or sorted(pool, key=lambda x: -x[1])[:max(1, simulate // 4)]
    else:
        by_qps = sorted(pool, key=lambda x: -x[1])
        picked = by_qps[:simulate]
        picked += [x for x in sorted(pool, key=lambda x: x[2]) if x not in picked][:simulate // 4]
    ests = [estimate_serving(model, cluster, dep, workload, target=target, requests=requests, seed=seed,
                             rate_qps=rate_qps) for dep, _, _ in picked]
    ests.sort(key=lambda e: _score(e, target, workload))
    return ServeSearch(ranked=ests, evaluated=evaluated, infeasible=evaluated - len(pool), reasons=reasons,
                       concurrency=workload.concurrency)


def distinct(ranked: list[ServeEstimate], concurrency: int = 0) -> list[ServeEstimate]:
    """The ranking with one row per deployment that behaves differently: a larger max batch that
    the load never fills gives the same estimate as the smaller one (same TP, precisions and
    budget; TTFT, TPOT, p99 and the throughput ranked by within 1%: max QPS, or with
    `concurrency` N closed-loop users the rate they get, which a batch above N leaves unchanged
    while raising max QPS), and only the first of them is kept."""
    def same(a: ServeEstimate, b: ServeEstimate) -> bool:
        da, db = a.deployment, b.deployment
        if (da.tp, da.weight_precision, da.kv_precision, da.prefill_chunk) != \
                (db.tp, db.weight_precision, db.kv_precision, db.prefill_chunk):
            return False
        qa, qb = (a.rate_qps, b.rate_qps) if concurrency else (a.max_qps, b.max_qps)
        pairs = [(a.ttft_s, b.ttft_s), (a.tpot_s, b.tpot_s), (a.e2e_p99_s, b.e2e_p99_s), (qa, qb)]
        return all(abs(x - y) <= 0.01 * max(abs(x), abs(y), 1e-12) for x, y in pairs)
    out: list[ServeEstimate] = []
    for e in ranked:
        if not any(same(e, k) for k in out):
            out.append(e)
    return out


def closest_miss(result: ServeSearch, target: Target) -> str:
    """Which deployment comes closest to a target none meets, and by how much."""
    if not result.ranked:
        why = "; ".join(f"{k} ({v})" for k, v in sorted(result.reasons.items(), key=lambda kv: -kv[1])[:3])
        return f"no deployment fits at all: {why}"
    users = result.concurrency
    if target.kind == "qps":
        def got_qps(e: ServeEstimate) -> float:
            return e.rate_qps if users else e.max_qps
        best = max(result.ranked, key=got_qps)
        short = 100.0 * (1 - got_qps(best) / target.value)
        what = f"serves {users} users {got_qps(best):.1f} QPS" if users else f"sustains {got_qps(best):.1f} QPS"
        return f"closest: {best.deployment.describe()} {what}, {short:.0f}% short of {target.value:g}"
    attr = {"e2e": "e2e", "ttft": "ttft", "tpot": "tpot"}[target.metric]
    best = min(result.ranked, key=lambda e: getattr(e, f"{attr}_{target.kind}_s"))
    got = getattr(best, f"{attr}_{target.kind}_s")
    load = f"with {users} users" if users else "even at the lowest load"
    return (f"closest: {best.deployment.describe()} reaches {target.metric} {target.kind} {got * 1e3:.0f} ms "
            f"{load}, {got / target.value:.2f}x the {target.value * 1e3:g} ms target")


def require_target(result: ServeSearch, target: Target | None) -> None:
    """SpecError naming the closest deployment when no ranked deployment meets the target."""
    if not result.ranked:
        raise SpecError("--gpus", closest_miss(result, target or Target(kind="qps", value=1.0)),
                        "use more or larger GPUs, or a shorter prompt/output")
    if target is not None and not any(e.meets_target for e in result.ranked):
        flag = "--target-qps" if target.kind == "qps" else f"--target-{target.kind}-ms"
        raise SpecError(flag, f"no deployment meets {target.describe()}; {closest_miss(result, target)}",
                        "relax the target or add GPUs")
