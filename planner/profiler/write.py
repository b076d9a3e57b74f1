"""Raw measurements -> a profile in the schema of planner/specs/hardware.py, written atomically.

Measured profiles carry `"builtin": false` so the built-in lookup by name ignores them; they
are used through `--profile PATH`. Every number's source is in "sources"; raw figures with
sample counts and spreads are in "measured".
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from planner.profiler.steps import step_section
from planner.profiler.gemm import efficiency_curve, peak_tflops
from planner.profiler.run import ProfileOptions
from planner.rundir import atomic_write_json
from planner.specs.hardware import PRECISIONS, SCHEMA_VERSION, find_device, profile_from_dict


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def _builtin_for(kind: str, device_name: str) -> Any:
    """The built-in profile closest to the measured device (for the tiers we cannot measure)."""
    if kind == "cpu":
        return find_device("cpu")[0]
    for word in re.findall(r"[A-Za-z]+\d+[A-Za-z0-9-]*", device_name):
        try:
            return find_device(word)[0]
        except Exception:
            continue
    return None


def build(raw: dict[str, Any], env: dict[str, Any], opts: ProfileOptions, *, name: str, kind: str,
          memory_gb: float, per_node: int) -> dict[str, Any]:
    """The profile dict (validated by profile_from_dict before it is returned)."""
    best = peak_tflops(raw["gemm"] + raw["gemm_square"])
    peaks = {p: (best[p].tflops if p in best else 0.0) for p in PRECISIONS}
    curve_prec = opts.precision if opts.precision in best else "fp32"
    curve = efficiency_curve([r for r in raw["gemm"] + raw["gemm_square"] if r.precision == curve_prec],
                             best[curve_prec].tflops)
    # each other precision gets its own curve from its own GEMMs (square probes at least): the
    # fp32 and bf16 kernels reach different fractions of their peaks at the same size
    by_precision = {}
    for p in PRECISIONS:
        rs = [r for r in raw["gemm"] + raw["gemm_square"] if r.precision == p]
        if p != curve_prec and p in best and len({r.shape.flops for r in rs}) >= 2:
            by_precision[p] = efficiency_curve(rs, best[p].tflops)
    sources = {
        "gemm_efficiency_by_precision": "measured: each precision's own GEMMs / its own peak (the curve above "
                                        "applies to precisions not listed)",
        "peak_tflops": "measured: best GEMM per precision (model-shape sweep + square probes), torch.matmul, "
                       "median of timed repeats after warm-up",
        "gemm_efficiency": f"measured: {curve_prec} GEMMs of {opts.model.name}'s layer shapes (QKV, attention output, "
                           f"FFN, output layer; per TP rank) / peak, median per half-decade of FLOPs",
        "hbm_bandwidth_gbps": "measured: " + raw["copy"]["method"],
        "memory_gb": "measured: " + ("torch.cuda total_memory" if kind == "gpu" else "/proc/meminfo MemTotal "
                                     "(shared by all processes)"),
        "gpus_per_node": "measured: CUDA device count" if kind == "gpu" else "the --procs used for profiling",
    }
    if kind == "cpu":
        sources["peak_tflops"] += (f"; one CPU 'device' is one of {opts.procs} processes: measured with "
                                   f"{env.get('torch_threads')} thread(s) each, as the executor runs its ranks")
    builtin = _builtin_for(kind, env.get("device", ""))
    links: dict[str, dict[str, Any]] = {}
    groups = sorted(raw["comm"], key=int)
    if groups:
        n = groups[-1]
        fit = raw["comm"][n]["all_reduce"]["fit"]
        steps = 2 * (int(n) - 1)  # ring all-reduce latency steps, as planner/cost/comm.py counts them
        links["intra_node"] = {"name": f"{raw['backend']} between {n} processes (measured)",
                               "busbw_gbps": fit["busbw_gbps"], "latency_us": fit["alpha_us"] / steps}
        sources["intra_node"] = (f"measured: {raw['backend']} all-reduce on {n} processes, alpha-beta fit over "
                                 f"{fit['points']} sizes; busbw = algbw x 2(n-1)/n (nccl-tests); latency = alpha / "
                                 f"2(n-1) ring steps")
    elif builtin is not None:
        links["intra_node"] = {"name": builtin.intra_node.name, "busbw_gbps": builtin.intra_node.busbw_gbps,
                               "latency_us": builtin.intra_node.latency_us}
        sources["intra_node"] = f"not measured (one process): copied from built-in profile {builtin.name}"
    else:
        raise ValueError("no collective measured and no built-in profile to take the link from")
    if builtin is not None:
        links["inter_node"] = {"name": builtin.inter_node.name, "busbw_gbps": builtin.inter_node.busbw_gbps,
                               "latency_us": builtin.inter_node.latency_us}
        sources["inter_node"] = f"not measured (one machine): copied from built-in profile {builtin.name}"
    else:
        links["inter_node"] = dict(links["intra_node"], name="unknown network (set --inter-gbps)")
        sources["inter_node"] = "not measured (one machine) and no built-in profile matches: intra-node figures"
    data: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION, "name": name, "kind": kind, "builtin": False, "aliases": [],
        "memory_gb": memory_gb, "peak_tflops": peaks, "hbm_bandwidth_gbps": raw["copy"]["gbps"],
        "gemm_efficiency": curve, "gemm_efficiency_by_precision": by_precision, "gpus_per_node": per_node, **links, "factors": {}, "sources": sources,
    }
    if kind == "cpu" and builtin is not None and builtin.lab:
        data["lab"] = dict(builtin.lab)
        sources["lab"] = f"not measured: copied from built-in profile {builtin.name} (its sources say how)"
    step = step_section(raw, opts, data)
    if step["block"] or step["tp_allreduce"]:
        sources["step.framework"] = ("measured: the executor's DeepSpeed engine on one process, steps of 1 and 4 "
                                     "micro-batches (planner.profiler.engine), minus the cost model's forward + "
                                     "backward and Adam update for the same plan")
        data["step"] = step
        sources["step.block"] = ("measured: the executor's block (one TP rank, no communication) forward + backward "
                                 "per precision at the block points = scale x the cost model's block compute "
                                 "(planner.cost.block.block_compute_time: GEMMs + attention core + element-wise) + "
                                 "overhead_s; weighted least squares on relative residuals (planner/specs/step.py)")
        sources["step.tp_allreduce"] = ("measured: the executor's block with its TP group minus without, / 4 "
                                        "all-reduces, per (micro-batch, sequence, precision); alpha-beta fit "
                                        "(planner.profiler.comm.in_step)")
        if step.get("optimizer"):
            sources["step.optimizer"] = ("measured: the executor's optimizer step alone (torch AdamW; bf16: the "
                                         "wrapper's gradient conversion, norm, fp32 master update and copy back) on "
                                         "flat tensors of two sizes, the slope per parameter "
                                         "(planner.profiler.optimizer)")
        if step.get("parallel"):
            sources["step.parallel"] = ("measured: the executor's DeepSpeed engine on 2 processes, DP2 ZeRO-0 and PP2, "
                                        "steps of 1 and 4 micro-batches (planner.profiler.engine.measure_parallel), "
                                        "minus the cost model's terms with the block and framework probes "
                                        "(planner.profiler.steps.parallel_section)")
    data["measured"] = measured_section(raw, env, opts, best, data)
    profile_from_dict(data, name)  # the schema check the loader applies
    return data



def measured_section(raw: dict[str, Any], env: dict[str, Any], opts: ProfileOptions, best: dict[str, Any],
                     data: dict[str, Any]) -> dict[str, Any]:
    layer_rows = []
    prof = profile_from_dict(data, data["name"])
    for p in raw["layers"]:
        row = p.to_dict()
        row["cost_model"] = cost_model_point(opts, prof, p.micro_batch, p.seq, p.tp, p.precision or opts.precision,
                                             p.model_spec)
        layer_rows.append(row)
    return {
        "environment": env,
        "options": {"model": opts.model.to_dict(), "precision": opts.precision, "quick": opts.quick,
                    "procs": opts.procs, "max_tp": opts.max_tp},
        "wall_s": raw["wall_s"],
        "load_average": raw.get("load"),
        "allocator": raw.get("allocator"),
        "gemm": [r.to_dict() for r in raw["gemm"]],
        "gemm_square": [r.to_dict() for r in raw["gemm_square"]],
        "engine": raw.get("engine") or [],
        "optimizer": raw.get("optimizer") or [],
        "peak_gemm": {p: r.to_dict() for p, r in best.items()},
        "copy": raw["copy"],
        "layers": layer_rows,
        "comm": {"backend": raw["backend"], "groups": raw["comm"]},
        "notes": raw["notes"],
    }


def cost_model_point(opts: ProfileOptions, prof: Any, b: int, s: int, tp: int,
                     precision: str | None = None, model: Any = None) -> dict[str, Any]:
    """What planner.cost predicts for this block (time and saved bytes), beside the measurement.
    The one place the profiler asks the cost model: its activation bytes are
    planner.cost.memory.block_activation_bytes through layer_costs, for the attention kernel
    and dropout the TrainSpec and model below imply."""
    try:
        from planner.cost import layer_costs
        from planner.specs.cluster import ClusterSpec
        from planner.specs.plan import Plan
        from planner.specs.train import TrainSpec
        per_node = max(tp, prof.gpus_per_node)
        per_node += (-per_node) % tp
        cluster = ClusterSpec(nodes=1, gpus_per_node=per_node, device=prof, intra_node=prof.intra_node,
                              inter_node=prof.inter_node)
        prec = precision or opts.precision
        plan = Plan(dp=1, tp=tp, pp=1, micro_batch=b, grad_accum=1, precision=prec)
        lc = layer_costs(model or opts.model, cluster, TrainSpec(global_batch=b, seq_len=s, precision=prec), plan)
        return {"block_time_s": lc.block_time, "block_time_full_recompute_s": lc.block_time_full_recompute,
                "block_act_bytes": lc.block_act_bytes,
                "block_act_bytes_full_recompute": lc.block_act_bytes_full_recompute,
                "note": "cost model with this profile's default factors; for tp > 1 its block time includes "
                        "the TP all-reduces, the measurement does not"}
    except Exception as exc:  # the comparison is informative only; never lose a profile over it
        return {"error": f"{type(exc).__name__}: {exc}"}


def write(path: str | Path, data: dict[str, Any]) -> None:
    """Write atomically: an interrupted run never leaves a half-written profile."""
    atomic_write_json(path, data)
