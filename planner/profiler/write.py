"""Raw measurements -> a profile in the schema of planner/specs/hardware.py, written atomically.

Measured profiles carry `"builtin": false` so the built-in lookup by name ignores them; they
are used through `--profile PATH`. Every number's source is in "sources"; raw figures with
sample counts and spreads are in "measured".
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

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
                                        "(planner.profiler.write.parallel_section)")
    data["measured"] = measured_section(raw, env, opts, best, data)
    profile_from_dict(data, name)  # the schema check the loader applies
    return data


def _cluster(prof: Any, tp: int) -> Any:
    from planner.specs.cluster import ClusterSpec
    per_node = max(tp, prof.gpus_per_node)
    per_node += (-per_node) % tp
    return ClusterSpec(nodes=1, gpus_per_node=per_node, device=prof, intra_node=prof.intra_node,
                       inter_node=prof.inter_node)


def step_section(raw: dict[str, Any], opts: ProfileOptions, data: dict[str, Any]) -> dict[str, Any]:
    """The "step" section (planner/specs/step.py) from the block points and the in-step
    all-reduces: per precision, the line measured block time = scale x the cost model's block
    compute + overhead_s over the points; per group size, the in-step all-reduce's fit."""
    from planner.cost.block import block_compute_parts, block_compute_time
    from planner.specs.plan import Plan
    from planner.specs.train import TrainSpec
    prof = profile_from_dict({k: v for k, v in data.items() if k != "step"}, data["name"])
    block: dict[str, Any] = {}
    for prec in dict.fromkeys(p.precision or opts.precision for p in raw["layers"]):
        rows = [p for p in raw["layers"] if (p.precision or opts.precision) == prec]
        if len(rows) < 2 or not prof.supports(prec):
            continue
        pred = [block_compute_time(p.model_spec or opts.model, _cluster(prof, p.tp),
                                   TrainSpec(global_batch=p.micro_batch, seq_len=p.seq, precision=prec),
                                   Plan(tp=p.tp, micro_batch=p.micro_batch, precision=prec)) for p in rows]
        meas = [p.forward.median + p.backward.median for p in rows]
        scale, overhead = fit_line(pred, meas)
        block[prec] = {"scale": scale, "overhead_s": overhead, "points": len(rows),
                       "max_rel_error": max(abs(scale * x + overhead - y) / y for x, y in zip(pred, meas))}
        parts = [block_compute_parts(p.model_spec or opts.model, _cluster(prof, p.tp),
                                     TrainSpec(global_batch=p.micro_batch, seq_len=p.seq, precision=prec),
                                     Plan(tp=p.tp, micro_batch=p.micro_batch, precision=prec)) for p in rows]
        cls = fit_classes(parts, meas)
        if cls is not None:
            (gs, cs, es, over), worst = cls
            block[prec].update(gemm_scale=gs, core_scale=cs, elementwise_scale=es, overhead_s=over,
                               line_overhead_s=overhead, line_max_rel_error=block[prec]["max_rel_error"],
                               max_rel_error=worst)
    from planner.profiler.optimizer import fit as optimizer_fit
    opt = optimizer_fit(raw.get("optimizer") or [])
    framework = framework_section(raw.get("engine") or [], opts, data, block, opt) if block else {}
    parallel = parallel_section(raw.get("engine") or [], opts, data, block, framework, opt) if framework else {}
    links = {}
    for n, summary in raw["comm"].items():
        fit = (summary.get("in_step") or {}).get("fit")
        if fit and fit["busbw_gbps"] > 0:
            links[str(n)] = fit
    return {"block": block, "tp_allreduce": links, "framework": framework, "parallel": parallel, "optimizer": opt}


def fit_line(predicted: list[float], measured: list[float]) -> tuple[float, float]:
    """(scale, overhead) of measured = scale x predicted + overhead, least squares on relative
    residuals ((fit - measured) / measured; planner/calibrate/solver.py line_relative); overhead
    is kept >= 0, and a line that needs a negative overhead or a scale <= 0 (or whose points
    cannot tell them apart) is refitted through the origin, overhead 0."""
    from planner.calibrate.solver import line_relative
    if not predicted or len(predicted) != len(measured):
        raise ValueError("fit_line needs matching, non-empty lists")
    scale, overhead = line_relative(predicted, measured)
    return (scale, overhead) if scale > 0 else line_relative(predicted, measured, through_origin=True)


def fit_classes(parts: list[tuple[float, float, float]], measured: list[float]) -> tuple[tuple, float] | None:
    """measured = gemm_scale x G + core_scale x C + elementwise_scale x E + overhead over the
    block points, least squares on relative residuals with every coefficient >= 0 (the best
    non-negative solution over the subsets of the four columns: an exact small NNLS); None
    with fewer than 6 points or no GEMMs. Returns ((gs, cs, es, overhead), worst relative error)."""
    import itertools

    import numpy as np
    if len(parts) < 6:
        return None
    X = np.array([[g, c, e, 1.0] for g, c, e in parts])
    y = np.array(measured)
    w = 1.0 / y
    best = None
    for k in range(1, 5):
        for sub in itertools.combinations(range(4), k):
            coef, *_ = np.linalg.lstsq(X[:, sub] * w[:, None], y * w, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(4)
            full[list(sub)] = coef
            r = (X @ full - y) * w
            if best is None or r @ r < best[0]:
                best = (float(r @ r), full)
    if best is None or best[1][0] <= 0:
        return None
    full = best[1]
    return tuple(float(v) for v in full), float(np.max(np.abs((X @ full - y) / y)))


def framework_section(rows: list[dict[str, Any]], opts: ProfileOptions, data: dict[str, Any],
                      block: dict[str, Any], optimizer: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per precision, what the engine probe's per-micro-batch and per-step seconds
    (planner.profiler.engine.split) leave beyond the cost model's terms for the same 1-process
    plan under this profile with its block probe: the micro-batch's forward + backward (blocks,
    embedding, head) and the memory-bound Adam update. Kept >= 0."""
    from planner.cost import estimate
    from planner.profiler.engine import split
    from planner.specs.plan import Plan
    from planner.specs.train import TrainSpec
    if not rows:
        return {}
    prof = profile_from_dict({**{k: v for k, v in data.items() if k != "step"},
                              "step": {"block": block, "optimizer": optimizer or {}}}, data["name"])
    out = {}
    for prec, meas in split(rows).items():
        b, s = next((r["micro_batch"], r["seq"]) for r in rows if r["precision"] == prec)
        plan = Plan(micro_batch=b, grad_accum=1, precision=prec)
        est = estimate(opts.model, _cluster(prof, 1), TrainSpec(global_batch=b, seq_len=s, precision=prec), plan)
        t = est.time
        per_mb = t.forward + t.backward + t.recompute
        out[prec] = {"microbatch_s": max(meas["microbatch_s"] - per_mb, 0.0),
                     "step_s": max(meas["step_s"] - t.optimizer, 0.0),
                     "measured_microbatch_s": meas["microbatch_s"], "measured_step_s": meas["step_s"],
                     "predicted_microbatch_s": per_mb, "predicted_optimizer_s": t.optimizer}
    return out


def parallel_section(rows: list[dict[str, Any]], opts: ProfileOptions, data: dict[str, Any],
                     block: dict[str, Any], framework: dict[str, Any],
                     optimizer: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per precision with the 2-process engine probe (planner.profiler.engine.measure_parallel),
    what its DP2 and PP2 steps leave beyond the cost model's terms for the same plans under this
    profile with its block and framework probes (planner/specs/step.py Parallel), each kept >= 0:

    - concurrency = DP2's per micro-batch / the one-process engine's (same micro-batch and
      sequence; >= 1): how much two ranks computing at once slow each other; the terms below
      are computed with it (every CPU-bound term of a 2-process plan stretches by it);
    - microbatch_s = DP2's per micro-batch - (the micro-batch's compute + framework per micro-batch);
    - dp_step_s = DP2's per step - (framework per step + Adam update + the gradient all-reduce);
    - pipe_microbatch_s = PP2's per micro-batch - the slowest stage's compute per micro-batch;
    - pipe_bubble = (PP2's per step - framework per step - Adam update) / ((p - 1) x PP2's per
      micro-batch): the 1F1B step of m micro-batches lasts (m + p - 1) stage micro-batches
      when the fill and drain are fully exposed (pipe_bubble 1);
    - zero3_microbatch_s, zero3_step_s = DP2 ZeRO-3's per micro-batch and per step minus the
      cost model's for the same plan (steps of 1 and 4 micro-batches) with the terms above."""
    from planner.cost import estimate
    from planner.profiler.engine import split
    from planner.specs.plan import Plan
    from planner.specs.train import TrainSpec
    dp_rows, pp_rows = split(rows, "dp"), split(rows, "pp")
    if not dp_rows or not pp_rows:
        return {}
    fw_step = {p: {"microbatch_s": f["microbatch_s"], "step_s": f["step_s"]} for p, f in framework.items()}
    out = {}
    for prec in dp_rows:
        if prec not in pp_rows or prec not in framework:
            continue
        b, s = next((r["micro_batch"], r["seq"]) for r in rows if r["precision"] == prec and r.get("layout") == "dp")
        fw = framework[prec]
        dp, pp = dp_rows[prec], pp_rows[prec]
        # the same micro-batch on one process (framework's measured) and on each of two at once
        c = max(dp["microbatch_s"] / fw["measured_microbatch_s"], 1.0) if fw.get("measured_microbatch_s", 0) > 0 \
            else 1.0
        prof = profile_from_dict({**{k: v for k, v in data.items() if k != "step"}, "step": {
            "block": block, "optimizer": optimizer or {}, "framework": fw_step,
            "parallel": {prec: {"microbatch_s": 0.0, "dp_step_s": 0.0, "pipe_microbatch_s": 0.0, "pipe_bubble": 1.0,
                                "concurrency": c}}}}, data["name"])
        train = TrainSpec(global_batch=2 * b, seq_len=s, precision=prec)
        t = estimate(opts.model, _cluster(prof, 2), train, Plan(dp=2, micro_batch=b, precision=prec)).time
        t_pp = estimate(opts.model, _cluster(prof, 2), dataclass_replace(train, global_batch=b),
                        Plan(pp=2, micro_batch=b, precision=prec)).time
        stage = t_pp.forward + t_pp.backward + t_pp.recompute + t_pp.tp_comm
        out[prec] = {
            "microbatch_s": max(dp["microbatch_s"] - (t.forward + t.backward + t.recompute) - c * fw["microbatch_s"],
                                0.0),
            "dp_step_s": max(dp["step_s"] - c * fw["step_s"] - t.optimizer - t.dp_sync, 0.0),
            "pipe_microbatch_s": max(pp["microbatch_s"] - stage, 0.0),
            "pipe_bubble": max((pp["step_s"] - c * fw["step_s"] - t_pp.optimizer) / pp["microbatch_s"], 0.0),
            "concurrency": c,
            "measured_dp": dp, "measured_pp": pp, "predicted_dp_microbatch_s": t.forward + t.backward + t.recompute,
            "predicted_dp_sync_s": t.dp_sync, "predicted_stage_microbatch_s": stage}
    z3_rows = split(rows, "z3")
    for prec, z3 in z3_rows.items():
        if prec not in out:
            continue
        par = {k: out[prec][k] for k in ("microbatch_s", "dp_step_s", "pipe_microbatch_s", "pipe_bubble",
                                         "concurrency")}
        with_par = profile_from_dict({**{k: v for k, v in data.items() if k != "step"}, "step": {
            "block": block, "optimizer": optimizer or {}, "framework": {p: {"microbatch_s": f["microbatch_s"], "step_s": f["step_s"]}
                                          for p, f in framework.items()}, "parallel": {prec: par}}}, data["name"])
        b, s = next((r["micro_batch"], r["seq"]) for r in rows if r["precision"] == prec and r.get("layout") == "z3")
        t1, t4 = (estimate(opts.model, _cluster(with_par, 2), TrainSpec(global_batch=2 * b * m, seq_len=s,
                                                                         precision=prec),
                           Plan(dp=2, zero=3, micro_batch=b, grad_accum=m, precision=prec)).step_time_s for m in (1, 4))
        per_mb = (t4 - t1) / 3.0
        out[prec].update(zero3_microbatch_s=max(z3["microbatch_s"] - per_mb, 0.0),
                         zero3_step_s=max(z3["step_s"] - (t1 - per_mb), 0.0), measured_z3=z3,
                         predicted_z3={"microbatch_s": per_mb, "step_s": t1 - per_mb})
    zero2_section(rows, opts, data, block, framework, optimizer, out)
    return out


PARALLEL_KEYS = ("microbatch_s", "dp_step_s", "pipe_microbatch_s", "pipe_bubble", "zero3_microbatch_s",
                 "zero3_step_s", "concurrency")


def zero2_section(rows: list[dict[str, Any]], opts: ProfileOptions, data: dict[str, Any], block: dict[str, Any],
                  framework: dict[str, Any], optimizer: dict[str, Any] | None, parallel: dict[str, Any]) -> None:
    """ZeRO-2's cost per micro-batch beyond the first, beyond the cost model's terms, from the
    DP2 ZeRO-0 / DP2 ZeRO-2 rows of each measured model (the profiled one's from
    measure_parallel, the further block model's from the same probe, micro-batch 1): per model,

        residual = (ZeRO-2's measured per micro-batch - ZeRO-0's)
                   - (the same difference the cost model predicts with the terms above),

    and over the models' parameter counts psi (each rank reduces the whole gradient) the line
    residual = zero2_fixed_s + zero2_param_s x psi (line_through; one model: through the
    origin). Written into parallel[precision] in place."""
    from planner.cost import estimate
    from planner.cost.params import stage_params
    from planner.profiler.engine import split
    from planner.specs.plan import Plan
    from planner.specs.train import TrainSpec
    models = {None: opts.model, **{m.name: m for m in opts.block_models}}
    fw_step = {p: {"microbatch_s": f["microbatch_s"], "step_s": f["step_s"]} for p, f in framework.items()}
    points: dict[str, list[dict[str, Any]]] = {}
    for name, model in models.items():
        dp_rows, z2_rows = split(rows, "dp", name), split(rows, "z2", name)
        for prec, z2 in z2_rows.items():
            if prec not in dp_rows or prec not in parallel:
                continue
            b, s = next((r["micro_batch"], r["seq"]) for r in rows
                        if r.get("layout") == "z2" and r.get("model") == name and r["precision"] == prec)
            prof = profile_from_dict({**{k: v for k, v in data.items() if k != "step"}, "step": {
                "block": block, "optimizer": optimizer or {}, "framework": fw_step,
                "parallel": {prec: {k: parallel[prec][k] for k in PARALLEL_KEYS}}}}, data["name"])

            def per_mb(zero: int) -> float:
                t1, t4 = (estimate(model, _cluster(prof, 2), TrainSpec(global_batch=2 * b * m, seq_len=s, precision=prec),
                                   Plan(dp=2, zero=zero, micro_batch=b, grad_accum=m, precision=prec)).step_time_s
                          for m in (1, 4))
                return (t4 - t1) / 3.0
            meas = z2["microbatch_s"] - dp_rows[prec]["microbatch_s"]
            pred = per_mb(2) - per_mb(0)
            psi = max(stage_params(model, Plan(dp=2, zero=2, precision=prec)))
            points.setdefault(prec, []).append({"model": model.name, "psi": psi, "measured_s": meas, "predicted_s": pred,
                                                "residual_s": max(meas - pred, 0.0)})
    for prec, pts in points.items():
        fixed, per_param = line_through([p["psi"] for p in pts], [p["residual_s"] for p in pts])
        parallel[prec].update(zero2_fixed_s=fixed, zero2_param_s=per_param, measured_zero2=pts)


def line_through(x: list[float], y: list[float]) -> tuple[float, float]:
    """(intercept, slope) of y = intercept + slope x over the points with y > 0, least squares
    on relative error (planner/calibrate/solver.py line_relative: the intercept kept >= 0, else
    through the origin); a negative slope, or no point with y > 0, is 0 (nothing measured)."""
    from planner.calibrate.solver import line_relative
    pts = [(a, b) for a, b in zip(x, y) if b > 0]
    if not pts:
        return 0.0, 0.0
    slope, intercept = line_relative([a for a, _ in pts], [b for _, b in pts])
    return (intercept, slope) if slope >= 0 else (0.0, 0.0)


def dataclass_replace(obj: Any, **kw: Any) -> Any:
    import dataclasses
    return dataclasses.replace(obj, **kw)


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
