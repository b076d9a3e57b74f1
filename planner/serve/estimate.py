"""One deployment's serving estimate: can vLLM start it, does the workload fit the model, and
its memory, unloaded latencies, saturation throughput, QPS at a target and latency
percentiles under load (the step times of planner/serve/cost.py, the queueing simulation of
planner/serve/queue.py)."""
from __future__ import annotations

from planner.errors import SpecError
from planner.serve.cost import decode_step_time_s, prompt_time_s, request_overhead_s
from planner.serve.memory import serve_memory
from planner.serve.spec import Deployment, ServeEstimate, Target, Workload
from planner.specs.cluster import ClusterSpec
from planner.specs.model import ModelSpec

__all__ = ["check_workload", "deployment_problems", "estimate_serving"]


def deployment_problems(model: ModelSpec, cluster: ClusterSpec, dep: Deployment) -> list[str]:
    """Why vLLM could not start this deployment on this cluster (empty: it can)."""
    out = []
    if dep.gpus > cluster.world_size:
        out.append(f"needs {dep.gpus} GPUs, the cluster has {cluster.world_size}")
    if dep.tp > cluster.gpus_per_node:
        out.append(f"TP {dep.tp} spans nodes ({cluster.gpus_per_node} GPUs per node)")
    if model.heads % dep.tp:
        out.append(f"TP {dep.tp} does not divide the {model.heads} attention heads")
    if model.kv_heads % dep.tp and dep.tp % model.kv_heads:
        out.append(f"TP {dep.tp} neither divides nor is a multiple of the {model.kv_heads} KV heads")
    if dep.kv_precision == "fp8" and not cluster.device.fp8:
        out.append(f"{cluster.device.name} has no FP8 support for an fp8 KV cache")
    if dep.weight_precision == "fp8" and not cluster.device.fp8:
        out.append(f"{cluster.device.name} has no FP8 tensor cores for fp8 weights")
    return out


def check_workload(model: ModelSpec, workload: Workload) -> None:
    """Bad input, not an infeasible deployment: the longest request exceeds the model's context."""
    if workload.max_total() > model.max_seq:
        if workload.trace:
            raise SpecError("--trace", f"its longest request, prompt + output = {workload.max_total()} tokens, "
                            f"exceeds {model.name}'s context of {model.max_seq}",
                            f"keep every line's prompt + output <= {model.max_seq}")
        extra = "" if workload.prompt_sigma == 0 and workload.output_sigma == 0 else \
            " (the 99.9th percentile of the length distributions)"
        raise SpecError("--prompt-len/--output-len",
                        f"prompt + output = {workload.max_total()} tokens{extra} exceeds {model.name}'s "
                        f"context of {model.max_seq}",
                        f"keep prompt + output <= {model.max_seq}")


# --- the estimate -------------------------------------------------------------------------
def estimate_serving(model: ModelSpec, cluster: ClusterSpec, dep: Deployment, workload: Workload, *,
                     target: Target | None = None, requests: int = 300, seed: int | None = None,
                     rate_qps: float | None = None) -> ServeEstimate:
    """Memory, unloaded latencies, saturation throughput, QPS at the target and the latency
    percentiles (planner/serve/queue.py) of one deployment. Infeasible is a value with reasons.

    The percentiles are simulated at `rate_qps` when given (above saturation too: the estimate
    is then `overloaded`, its queue growing by rate - max_qps requests/s, and the percentiles
    are those of `requests` requests into that growing queue), else at the QPS at the target,
    else at 80% of max_qps. With Workload.concurrency (closed loop) they are the N users' own
    load, and a target is met or not at it."""
    from planner.serve import queue
    check_workload(model, workload)
    mem = serve_memory(model, cluster, dep, workload)
    memory_gb = {k: mem[k] for k in ("weights", "kv_cache", "activations", "runtime", "total", "capacity")}
    reasons = deployment_problems(model, cluster, dep)
    if not mem["fits"]:
        if mem["short_gb"] > 0:
            reasons.append(f"weights {mem['weights']:.1f} + activations {mem['activations']:.1f} + runtime "
                           f"{mem['runtime']:.1f} GiB exceed the usable {mem['capacity']:.1f} GiB by "
                           f"{mem['short_gb']:.1f} GiB")
        else:
            reasons.append(f"KV cache of {mem['kv_capacity_tokens']} tokens holds no sequence of "
                           f"{workload.max_total()} tokens")
    base = dict(deployment=dep, memory_gb=memory_gb, kv_capacity_tokens=mem["kv_capacity_tokens"],
                batch_limit=mem["batch_limit"])
    if reasons:
        return ServeEstimate(feasible=False, reasons=tuple(reasons), **base)
    alone_ttft = prompt_time_s(model, cluster, dep, workload.prompt_len) + request_overhead_s(cluster, dep)
    alone_tpot = decode_step_time_s(model, cluster, dep, 1, workload.prompt_len + 1)
    run = queue.replica_runner(model, cluster, dep, workload, mem, requests=requests, seed=seed)
    max_qps = queue.saturation_qps(run)
    if workload.concurrency:
        stats = run(1.0)  # the closed loop: its own rate
        qat = None
        if target is not None:
            ok = stats["achieved_qps"] >= target.value if target.kind == "qps" \
                else queue.metric_value(stats, target) <= target.value
            qat = stats["achieved_qps"] if ok else None
        rate = stats["achieved_qps"]
    else:
        qat = queue.qps_at_target(run, target, max_qps) if target is not None else None
        if rate_qps is not None:
            rate = rate_qps
        elif target is None:
            rate = 0.8 * max_qps
        elif target.kind == "qps":
            rate = min(target.value, max_qps)
        else:
            rate = qat if qat else 0.0
        stats = run(rate) if rate > 0 else run(max_qps * 1e-3)
        rate = stats["rate_qps"]
    meets = None if target is None else qat is not None
    over = not workload.concurrency and rate > max_qps
    block_gib = mem["kv_cache"] / mem["kv_blocks"] if mem["kv_blocks"] else 0.0
    in_use = mem["weights"] + mem["activations"] + mem["runtime"] + stats.get("peak_kv_blocks", 0) * block_gib
    return ServeEstimate(
        feasible=True, ttft_s=stats["ttft_s"]["mean"], tpot_s=stats["tpot_s"]["mean"],
        e2e_p50_s=stats["e2e_s"]["p50"], e2e_p99_s=stats["e2e_s"]["p99"], e2e_mean_s=stats["e2e_s"]["mean"],
        ttft_p50_s=stats["ttft_s"]["p50"],
        ttft_p99_s=stats["ttft_s"]["p99"], tpot_p50_s=stats["tpot_s"]["p50"], tpot_p99_s=stats["tpot_s"]["p99"],
        ttft_alone_s=alone_ttft, tpot_alone_s=alone_tpot, rate_qps=rate, qps_at_target=qat,
        meets_target=meets, max_qps=max_qps, overloaded=over, backlog_growth_qps=rate - max_qps if over else 0.0,
        queue_p99_s=stats["queue_s"]["p99"], preemptions=stats["preemptions"], memory_in_use_gb=in_use, **base)
