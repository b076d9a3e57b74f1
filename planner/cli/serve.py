"""`planner serve`: parse -> load specs -> planner.serve.search -> print and write reports/<name>/."""
from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from planner.cli.common import (apply_variants, command_line, console, comparison_table, load_cluster, load_model,
                                model_options, serving_comparison, variant_option)
from planner.errors import SpecError
from planner.rundir import check_writable
from planner.serve.memory import engine_budget
from planner.serve.launch import launch_script
from planner.serve.outputs import calibration_badge, latency_curve, render_report, write_serve_run
from planner.serve.search import Space, distinct, require_target, search_deployments
from planner.serve.spec import LATENCY_METRICS, SEARCH_KV, SEARCH_WEIGHTS, ServeEstimate, Target, Workload
from planner.specs.compare import comparison_doc

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}$")


def _target(kw: dict[str, Any]) -> Target | None:
    given = [(k, kw[f"target_{k}"]) for k in ("p50_ms", "p99_ms", "qps") if kw[f"target_{k}"] is not None]
    if len(given) > 1:
        raise SpecError("--target-*", f"give one target, got {', '.join('--target-' + k.replace('_', '-') for k, _ in given)}",
                        "pick one of --target-p50-ms, --target-p99-ms, --target-qps")
    if not given:
        return None
    k, v = given[0]
    if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
        raise SpecError(f"--target-{k.replace('_', '-')}", f"must be a positive number, got {v}", "e.g. 210")
    if k == "qps":
        return Target(kind="qps", value=float(v), metric=kw["latency_metric"])
    return Target(kind=k[:3], value=float(v) / 1e3, metric=kw["latency_metric"])


def _ms(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x * 1e3:,.1f}"


def _table(ranked: list[ServeEstimate], top: int) -> Table:
    t = Table(title="top deployments (per-GPU memory in GiB)")
    for col in ("#", "TPxR", "batch", "weights", "KV", "chunk", "TTFT ms", "TPOT ms", "e2e p50", "e2e p99",
                "at QPS", "QPS@target", "max QPS", "mem W/KV/act/rt"):
        t.add_column(col, justify="right")
    for i, e in enumerate(ranked[:top], 1):
        d, m = e.deployment, e.memory_gb
        t.add_row(str(i), f"{d.tp}x{d.replicas}", str(d.max_batch), d.weight_precision, d.kv_precision,
                  str(d.prefill_chunk or "-"), _ms(e.ttft_s), _ms(e.tpot_s), _ms(e.e2e_p50_s), _ms(e.e2e_p99_s),
                  f"{e.rate_qps:.2f}", "-" if e.qps_at_target is None else f"{e.qps_at_target:.2f}",
                  f"{e.max_qps:.2f}",
                  f"{m['weights']:.1f}/{m['kv_cache']:.1f}/{m['activations']:.2f}/{m['runtime']:.1f}")
    return t


@click.command()
@model_options
@variant_option
@click.option("--gpus", required=True, metavar="[NODESx]GPUSxTYPE", help="e.g. 1xA100, 8xH100, 2xcpu.")
@click.option("--profile", "profile_path", default=None, metavar="PROFILE.JSON",
              help="A measured or calibrated profile replacing the built-in one.")
@click.option("--prompt-len", type=int, default=512, show_default=True, help="Median prompt tokens.")
@click.option("--output-len", type=int, default=256, show_default=True, help="Median generated tokens.")
@click.option("--prompt-sigma", type=float, default=0.0, show_default=True,
              help="Log-normal sigma of prompt lengths (0: all equal).")
@click.option("--output-sigma", type=float, default=0.0, show_default=True,
              help="Log-normal sigma of output lengths (0: all equal).")
@click.option("--mean-output-len", type=float, default=0.0, show_default=True,
              help="Requests stop at end-of-sequence before --output-len (max_tokens): their mean generated tokens "
                   "(0: every request generates --output-len).")
@click.option("--concurrency", type=int, default=0, show_default=True,
              help="Closed loop: N users, each sending its next request when its last one finished (0: Poisson).")
@click.option("--trace", "trace_path", default=None, metavar="FILE",
              help="Request lengths to replay: one 'prompt_tokens,output_tokens' pair per line (or a JSON list).")
@click.option("--prefix-len", type=int, default=0, show_default=True,
              help="Prompt tokens every request shares (a system prompt); cached with --prefix-caching.")
@click.option("--prefix-caching", is_flag=True, default=False, help="Reuse the shared prefix's KV blocks.")
@click.option("--rate-qps", type=float, default=None,
              help="Show the deployments at this arrival rate (requests/s), above saturation too.")
@click.option("--engine", type=click.Choice(["vllm", "sglang"]), default="vllm", show_default=True,
              help="The serving engine the plan and its launch script are for.")
@click.option("--weights", default=None, metavar="DIR|HF_ID",
              help="The checkpoint the launch script loads (required for int4/int8: a quantized one).")
@click.option("--target-p50-ms", type=float, default=None, help="Median latency target (of --latency-metric), ms.")
@click.option("--target-p99-ms", type=float, default=None, help="99th-percentile latency target, ms.")
@click.option("--target-qps", type=float, default=None, help="Throughput target, requests/s over all GPUs.")
@click.option("--latency-metric", type=click.Choice(list(LATENCY_METRICS)), default="e2e", show_default=True,
              help="What a latency target bounds: e2e request latency, time to first token, time per output token.")
@click.option("--tp", type=int, default=None, help="Only this tensor-parallel degree.")
@click.option("--max-batch", type=int, default=None, help="Only this maximum batch (vLLM --max-num-seqs).")
@click.option("--weight-precision", type=click.Choice(list(SEARCH_WEIGHTS)), default=None, help="Only this weight precision.")
@click.option("--kv-precision", type=click.Choice(list(SEARCH_KV)), default=None, help="Only this KV-cache precision.")
@click.option("--prefill-chunk", type=int, default=None, help="Only this prefill chunk (0: whole prompt).")
@click.option("--requests", type=click.IntRange(10, 100_000), default=300, show_default=True,
              help="Requests per queueing simulation.")
@click.option("--seed", type=click.IntRange(0, 2**31), default=0, show_default=True,
              help="Seed of arrivals and lengths.")
@click.option("--top", type=click.IntRange(1, 50), default=5, show_default=True, help="Deployments to show.")
@click.option("--name", default=None, help="Run directory name (default: serve_<model>_<gpus>).")
@click.option("--out-dir", default="reports", show_default=True, type=click.Path(file_okay=False),
              help="Parent of the run directory.")
@click.pass_context
def serve(ctx: click.Context, **kw: Any) -> None:
    """Find how to serve a model on the GPUs (TP x replicas, batch, precisions, prefill chunk) and
    write serve_plan.json, serve_top.json, vllm_serve.sh and serve_report.html."""
    command = command_line(ctx)
    model = apply_variants(load_model(kw["model_arg"], kw["scale"]), kw["variants"])
    cluster = load_cluster(kw["gpus"], kw["profile_path"], None, None, None)
    trace = ()
    if kw["trace_path"] is not None:
        from planner.serve.trace import read_trace
        trace = read_trace(kw["trace_path"])
    workload = Workload(prompt_len=kw["prompt_len"], output_len=kw["output_len"], prompt_sigma=kw["prompt_sigma"],
                        output_sigma=kw["output_sigma"], seed=kw["seed"], trace=trace, concurrency=kw["concurrency"],
                        prefix_len=kw["prefix_len"], mean_output_len=kw["mean_output_len"])
    if kw["prefix_len"] and kw["prefix_len"] >= workload.prompt_len and not trace:
        raise SpecError("--prefix-len", f"{kw['prefix_len']} is not shorter than the prompt ({workload.prompt_len})",
                        "give the shared part of the prompt, e.g. half of --prompt-len")
    rate = kw["rate_qps"]
    if rate is not None and not (math.isfinite(rate) and rate > 0):
        raise SpecError("--rate-qps", f"must be a positive number of requests/s, got {rate}", "e.g. 20")
    if rate is not None and kw["concurrency"]:
        raise SpecError("--rate-qps", "and --concurrency both set the load", "give one of them")
    if kw["concurrency"] and kw["requests"] < 2 * kw["concurrency"]:
        # fewer than two requests per user: the users' first burst is all there is, not a loop
        raise SpecError("--concurrency", f"{kw['concurrency']} users need at least {2 * kw['concurrency']} "
                        f"--requests (each user sends two or more; got {kw['requests']})",
                        f"raise --requests to {max(300, 10 * kw['concurrency'])} or lower --concurrency")
    target = _target(kw)
    space = _space(kw, cluster)
    out_dir, name = _destination(kw, model)

    result = search_deployments(model, cluster, workload, target=target, space=space, requests=kw["requests"],
                                seed=kw["seed"], rate_qps=rate)
    require_target(result, target)
    ranked = distinct([e for e in result.ranked if e.meets_target is not False],
                      workload.concurrency)[:max(kw["top"], 3)]
    best = ranked[0]
    script = launch_script(model, kw["model_arg"], best.deployment, workload, best,
                           budget=engine_budget(cluster, best.deployment), weights=kw["weights"])
    curves = [(f"#{i} {e.deployment.tp}x{e.deployment.replicas} b{e.deployment.max_batch} "
               f"{e.deployment.weight_precision}", latency_curve(model, cluster, e, workload, requests=kw["requests"],
                                                                 seed=kw["seed"]))
              for i, e in enumerate(ranked[:3], 1)]
    inputs = {"model": model.to_dict(), "cluster": cluster.to_dict(), "workload": workload.to_dict(),
              "target": target.to_dict() if target else None, "scale": kw["scale"], "model_arg": kw["model_arg"],
              "profile": cluster.device.path, "command": command, "requests": kw["requests"],
              "calibration": calibration_badge(cluster)}
    compare = None
    if model.variant_label:  # the same deployment for the base model, side by side (terminal, json, report)
        from planner.serve.estimate import estimate_serving
        base = estimate_serving(model.base(), cluster, best.deployment, workload, target=target,
                                requests=kw["requests"], seed=kw["seed"])
        compare = serving_comparison(model.base(), base, model, best, best.deployment)
    variant_doc = {"variant_comparison": comparison_doc(model, compare, deployment=best.deployment.describe())} \
        if compare else {}
    files = {
        "serve_plan.json": {"version": 1, "inputs": inputs, "deployment": best.deployment.to_dict(),
                            "description": best.deployment.describe(), "estimate": best.to_json(), **variant_doc},
        "serve_top.json": {"version": 1, "evaluated": result.evaluated, "infeasible": result.infeasible,
                           "infeasible_reasons": result.reasons, "top": [e.to_json() for e in ranked],
                           "curves": {label: pts for label, pts in curves}},
        f"{kw['engine']}_serve.sh": script,
        "serve_report.html": render_report(f"{model.name} on {cluster.spec}", workload, target, ranked, curves,
                                           script, result.evaluated, result.infeasible,
                                           variant=variant_doc.get("variant_comparison"),
                                           badge=calibration_badge(cluster)),
    }
    run_dir = out_dir / name
    written = write_serve_run(run_dir, files)
    _print_result(model, cluster, workload, target, result, ranked, best, compare, kw)
    console().print(f"wrote {run_dir}/: {', '.join(written)}")


def _space(kw: dict[str, Any], cluster: Any) -> Space:
    """The deployments to search: the engine's space narrowed by --tp, --max-batch,
    --prefill-chunk, --kv-precision and --weight-precision (each checked against the GPUs)."""
    space = Space(engine=kw["engine"], prefix_caching=kw["prefix_caching"])
    if kw["tp"] is not None:
        if kw["tp"] < 1 or cluster.world_size % kw["tp"]:
            raise SpecError("--tp", f"{kw['tp']} does not divide the {cluster.world_size} GPUs",
                            "give a divisor of the GPU count")
        space = dataclasses.replace(space, tp=(kw["tp"],))
    if kw["max_batch"] is not None:
        if kw["max_batch"] < 1:
            raise SpecError("--max-batch", f"must be >= 1, got {kw['max_batch']}", "e.g. 64")
        space = dataclasses.replace(space, max_batch=(kw["max_batch"],))
    if kw["prefill_chunk"] is not None:
        if kw["prefill_chunk"] < 0:
            raise SpecError("--prefill-chunk", f"must be >= 0, got {kw['prefill_chunk']}", "0 or e.g. 512")
        space = dataclasses.replace(space, prefill_chunk=(kw["prefill_chunk"],))
    kv = space.kv_precision
    if kw["kv_precision"] is not None:
        if kw["kv_precision"] == "fp8" and not cluster.device.fp8:
            raise SpecError("--kv-precision", f"{cluster.device.name} cannot run an fp8 KV cache (no FP8 support; "
                            "profile field fp8)", "use --kv-precision bf16, or an Ada/Hopper GPU")
        if kw["kv_precision"] == "int8":
            raise SpecError("--kv-precision", f"{kw['engine']} has no int8 KV cache (vLLM --kv-cache-dtype auto|fp8; "
                            "SGLang auto|fp8_e5m2|fp8_e4m3)", "use --kv-precision bf16, or fp8 on a Hopper/Ada GPU")
        kv = (kw["kv_precision"],)
    wp = (kw["weight_precision"],) if kw["weight_precision"] else space.weight_precision
    if kw["weight_precision"] == "fp8" and not cluster.device.fp8:
        raise SpecError("--weight-precision", f"{cluster.device.name} has no FP8 tensor cores for fp8 weights "
                        "(profile field fp8)", "use bf16, int8 or int4 weights, or a Hopper/Ada GPU")
    space = dataclasses.replace(space, weight_precision=wp, kv_precision=kv)
    return space


def _destination(kw: dict[str, Any], model: Any) -> tuple[Path, str]:
    """--out-dir and --name (default serve_<model>_<gpus>), checked before the search runs."""
    name = kw["name"] or re.sub(r"[^A-Za-z0-9_.+-]+", "-", f"serve_{model.name}_{kw['gpus']}").strip("-.")[:120]
    if not _NAME_RE.match(name) or name in (".", ".."):
        raise SpecError("--name", f"{name!r} is not a plain directory name", "use letters, digits, '.', '_', '+', '-'")
    out_dir = Path(kw["out_dir"])
    if out_dir.exists() and not out_dir.is_dir():
        raise SpecError("--out-dir", f"{out_dir} is not a directory", "give a directory path")
    check_writable(out_dir / name, "--out-dir")
    return out_dir, name


def _no_target(workload: Workload) -> str:
    if workload.concurrency:
        return f"none (ranked by the requests/s {workload.concurrency} closed-loop users get)"
    return "none (ranked by max QPS at 80% load)"


def _print_result(model: Any, cluster: Any, workload: Workload, target: Target | None, result: Any,
                  ranked: list[ServeEstimate], best: ServeEstimate, compare: Any, kw: dict[str, Any]) -> None:
    """What the search found, for the terminal."""
    out = console()
    out.print(f"{model.name} on {cluster.spec}: prompt {workload.prompt_len}, output {workload.output_len}; "
              f"target {target.describe() if target else _no_target(workload)}; "
              f"{result.evaluated} deployments, {result.infeasible} infeasible")
    out.print(_table(ranked, kw["top"]))
    out.print(f"best: {best.deployment.describe()} ({calibration_badge(cluster)})")
    if workload.concurrency:
        out.print(f"closed loop, {workload.concurrency} users: {best.rate_qps:.2f} requests/s, TTFT p99 "
                  f"{_ms(best.ttft_p99_s)} ms, e2e p99 {_ms(best.e2e_p99_s)} ms")
    if best.overloaded:
        out.print(f"overloaded: {best.rate_qps:g} requests/s offered, {best.max_qps:.2f} served at most; the queue "
                  f"grows by {best.backlog_growth_qps:.2f} requests/s (over {kw['requests']} requests the wait "
                  f"reaches p99 {_ms(best.queue_p99_s)} ms, e2e p99 {_ms(best.e2e_p99_s)} ms, and keeps growing)")
    if best.preemptions:
        out.print(f"KV cache full at this load: {best.preemptions} preemptions (recomputed) in "
                  f"{kw['requests']} requests")
    if compare:
        out.print(comparison_table(f"--variant on {best.deployment.describe()}: {model.describe()}",
                                   compare, model.base().name, model.name))
