"""The profile's "step" section: what the executor's step is made of beyond the GEMM curve.

Per precision, the block line (measured block time against the cost model's), its split by term
class, the in-step TP all-reduce, and from the engine probes the framework costs of one process
(framework_section), of two (parallel_section: DP2, PP2, ZeRO-3) and ZeRO-2's per-micro-batch
reduction (zero2_section). planner/profiler/write.py puts the section into the profile; the cost
model reads it through planner/specs/step.py.
"""
from __future__ import annotations

from typing import Any

from planner.profiler.run import ProfileOptions
from planner.specs.hardware import profile_from_dict

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
