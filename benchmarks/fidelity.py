"""The cost model against every published run in shared reference/, source by source.

Rows (benchmarks/reference_rows.py): Megatron-LM Table 1 (calibration.md), DeepSpeed's own runs
(deepspeed-at-scale.md A-E) and the modern runs (modern-runs.md S1, S5-S8), each on its
runtime (planner.cost.runtime). A row whose source leaves micro-batch or interleaving unstated
is predicted by the fastest plan that fits among those the source allows (its authors tuned
them). Every row is compared as a step time: error = predicted / measured - 1.

For each source and overall it prints
- MAPE before: the model as it was before runtimes (every row costed as DeepSpeed with the GPU
  profile's DeepSpeed-fitted factors, interleaving allowed);
- MAPE after: on the row's runtime with the factors shipped in profiles/ (and --fit's);
- leave-one-source-out MAPE: the source predicted from factors fitted without it;
and every fitted factor with the sources that determine it. A factor is fitted only where two
or more independent sources determine it (megatron-core's compute_scale per GPU: H100 from S1,
S5, S6, S7; B200 from S6, S7; A100 has one source, T1, and keeps the physics value); FSDP has
one source (S8): nothing is fitted for it, its rows check physics alone. DeepSpeed's factors
are the GPU profiles' (benchmarks/ds_reference.py fits them per generation); their
leave-one-source-out refits that fit without the source (--no-loso-deepspeed skips it).

    .venv/bin/python benchmarks/fidelity.py                 # table + targets; exit 1 if one is missed
    .venv/bin/python benchmarks/fidelity.py --json          # the same as JSON
    .venv/bin/python benchmarks/fidelity.py --rows          # every row
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import reference_rows as rr  # noqa: E402

from planner.cost import estimate  # noqa: E402
from planner.calibrate.accuracy import mape, rel_error  # noqa: E402
from planner.calibrate.solver import golden_section  # noqa: E402
from planner.cost.runtime import get_runtime, trial_factors  # noqa: E402

TARGETS = {"loso_per_source": 0.10, "loso_overall": 0.10, "t1_after": 0.05, "compute_scale": (0.9, 1.1)}
"""Issue 19's targets: LOSO <= 10% on every source with >= 5 scored rows and overall; Megatron-LM
Table 1 <= 5% under megatron-core; every run predicted to fit; compute_scale in [0.9, 1.1]."""
MIN_ROWS = 5
FITTED = {"megatron-core": ("compute_scale",)}
"""Factors fitted per runtime by this benchmark, each per GPU generation (the runtime file's
"by_device" trims) where two or more sources ran that runtime on that GPU: compute_scale is what
the GEMM and attention kernels' measured ceilings leave unexplained on that GPU (clocks under a
training run's sustained power, an fp8 ceiling derived rather than measured). A GPU with one
source keeps the physics value, the runtime's file factor (1.0)."""
MIN_SOURCES = 2
BORROWED = {"fsdp": "megatron-core"}
"""A runtime with one source (FSDP: S8) fits nothing; it takes the per-GPU compute_scale of the
runtime whose sources determine it (the factor is what the kernels' ceilings miss on cuBLAS's
GEMMs and the flash kernels, which FSDP runs as Megatron-Core does); S8 stays held out of every
fit, so its error is out of sample."""
BOUNDS = (0.5, 2.0)


def predict(row: rr.RefRow, before: bool = False) -> tuple[float, bool, str]:
    """(step seconds, predicted to fit, plan) of the fastest case that fits (else the fastest)."""
    best = None
    for c in row.cases:
        plan = dataclasses.replace(c.plan, runtime="deepspeed") if before else c.plan
        est = estimate(c.model, c.cluster, c.train, plan)
        key = (not est.feasible, est.step_time_s)
        if best is None or key < best[0]:
            best = (key, est, plan)
    _, est, plan = best
    return est.step_time_s, est.feasible, plan.describe()


def fit_runtime(runtime: str, rows: Sequence[rr.RefRow]) -> dict[str, dict[str, float]]:
    """Per GPU with rows from at least MIN_SOURCES sources: the compute_scale of `runtime` on it
    minimising the mean over those sources of each source's MAPE on its rows (every source weighs
    the same, however many rows it has; log-space golden section: planner/calibrate/solver.py
    golden_section, the loss being a MAPE, not a sum of squares). GPUs with fewer sources get
    nothing (the runtime's physics value applies)."""
    out: dict[str, dict[str, float]] = {}
    for gpu in sorted({r.gpu for r in rows}):
        by_source: dict[str, list[rr.RefRow]] = {}
        for r in rows:
            if r.gpu == gpu:
                by_source.setdefault(r.source, []).append(r)
        if len(by_source) < MIN_SOURCES:
            continue

        def loss(log_x: float) -> float:
            with trial_factors(runtime, {}, {gpu: {"compute_scale": math.exp(log_x)}}):
                return sum(sum(abs(predict(r)[0] / r.measured_s - 1) for r in rs) / len(rs)
                           for rs in by_source.values()) / len(by_source)
        out[gpu] = {"compute_scale": math.exp(golden_section(loss, math.log(BOUNDS[0]), math.log(BOUNDS[1])))}
    return out


def gpu_sources(rows: Sequence[rr.RefRow]) -> dict[str, list[str]]:
    out: dict[str, set[str]] = {}
    for r in rows:
        out.setdefault(r.gpu, set()).add(r.source)
    return {g: sorted(s) for g, s in sorted(out.items())}


def with_fit(runtime: str, by_device: dict[str, dict[str, float]] | None, fn: Callable[[], Any]) -> Any:
    if by_device is None:
        return fn()
    with trial_factors(runtime, {}, by_device):
        return fn()


DS_LOSO_FACTORS: dict[str, dict[str, dict[str, float]]] = {}
"""{generation: {held-out source: the factors refitted without it}} of the last deepspeed_loso."""


def deepspeed_loso(rows: Sequence[rr.RefRow]) -> dict[str, float]:
    """Step seconds of every DeepSpeed row predicted from its generation's factors refitted
    (planner/calibrate/reference/'s fitter, one start) on the other sources' rows."""
    import ds_reference as dr  # noqa: PLC0415

    meta = json.loads(dr.DATA.read_text())
    keys = {v: rr.DS_SOURCE_KEYS[k] for k, v in meta["sources"].items()}
    drows = dr.load_rows()
    out: dict[str, float] = {}
    for gen, g in meta["generations"].items():
        device = dr.find_device(g["profile"])[0]
        names = list(dr.default_factor_names(gen))
        mine = [r for r in drows if r.gen == gen]
        for src in sorted({keys[r.source] for r in mine}):
            train = [r for r in mine if keys[r.source] != src and r.fit and not r.needs_variant]
            fitted = dr.fit_factors(train, device, names, anchor=g.get("anchor")).factors if train else {}
            DS_LOSO_FACTORS.setdefault(gen, {})[src] = fitted
            dev = dr.with_factors(device, fitted) if train else device
            for r in mine:
                if keys[r.source] == src:
                    v = dr.predict(r, dev)
                    out[r.id] = v if r.metric == "step_s" else dr.source_flops(r) / (r.world * v * 1e12)
    return out


def run(loso_deepspeed: bool = True) -> dict[str, Any]:
    rows = rr.all_rows()
    scored = [r for r in rows if not r.unsupported]
    fits: dict[str, dict[str, Any]] = {}
    for runtime in FITTED:
        mine = [r for r in scored if r.runtime == runtime]
        sources = sorted({r.source for r in mine})
        fits[runtime] = {"by_device": fit_runtime(runtime, mine), "sources": gpu_sources(mine), "rows": len(mine),
                         "loso": {s: fit_runtime(runtime, [r for r in mine if r.source != s]) for s in sources}}
    for runtime, donor in BORROWED.items():
        own = sorted({r.source for r in scored if r.runtime == runtime})
        fits[runtime] = {**fits[donor], "borrowed_from": donor, "loso": {s: fits[donor]["by_device"] for s in own}}
    ds_loso = deepspeed_loso(scored) if loso_deepspeed else {}
    out_rows = []
    for r in rows:
        rec: dict[str, Any] = {"id": r.id, "source": r.source, "runtime": r.runtime, "gpu": r.gpu,
                               "measured_s": r.measured_s, "note": r.note, "unsupported": r.unsupported}
        if not r.unsupported:
            # before runtimes the model had no fp8: those rows had no prediction
            before = None if r.cases[0].plan.precision == "fp8" else predict(r, before=True)[0]
            fit = fits.get(r.runtime, {})
            after, fits_after, plan = with_fit(r.runtime, fit.get("by_device"), lambda: predict(r))
            if r.runtime in fits:
                loso = with_fit(r.runtime, fit["loso"][r.source], lambda: predict(r))[0]
            elif r.runtime == "deepspeed":
                loso = ds_loso.get(r.id)
            else:
                loso = after  # nothing fitted for this runtime: every source is already held out
            rec.update(before_s=before, after_s=after, loso_s=loso, fits=fits_after, plan=plan,
                       err_before=rel_error(before, r.measured_s), err_after=rel_error(after, r.measured_s),
                       err_loso=rel_error(loso, r.measured_s))
        out_rows.append(rec)
    sources: dict[str, dict[str, Any]] = {}
    for key in list(rr.SOURCE_NAMES) + ["all"]:
        recs = [x for x in out_rows if key in (x["source"], "all")]
        sc = [x for x in recs if not x["unsupported"]]
        sources[key] = {"name": rr.SOURCE_NAMES.get(key, "every scored row"), "rows": len(recs), "scored": len(sc),
                        "mape_before": mape([x["err_before"] for x in sc if x["err_before"] is not None]),
                        "mape_after": mape([x["err_after"] for x in sc]),
                        "mape_loso": mape([x["err_loso"] for x in sc if x["err_loso"] is not None])
                        if all(x["err_loso"] is not None for x in sc) else None,
                        "not_fitting": [x["id"] for x in sc if not x["fits"]],
                        "unsupported": sorted({w for x in recs if x["unsupported"] for w in x["unsupported"].split("; ")})}
    return {"rows": out_rows, "sources": sources, "fits": fits, "profiles": profile_factors(),
            "deepspeed_loso_factors": DS_LOSO_FACTORS if loso_deepspeed else {},
            "targets": check_targets(sources, fits)}


def profile_factors() -> dict[str, dict[str, Any]]:
    """The DeepSpeed factors each GPU profile ships (fitted by planner calibrate --reference) with
    the source line the profile gives for each."""
    from planner.specs.hardware import PROFILES_DIR  # noqa: PLC0415
    out = {}
    for p in sorted(PROFILES_DIR.glob("*.json")):
        d = json.loads(p.read_text())
        if d.get("kind") == "gpu":
            out[d["name"]] = {k: {"value": v, "source": d.get("sources", {}).get(f"factors.{k}", "")}
                              for k, v in d.get("factors", {}).items()}
    return out


def check_targets(sources: dict[str, Any], fits: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for key, s in sources.items():
        if key != "all" and s["scored"] >= MIN_ROWS:
            v = s["mape_loso"]
            out.append({"target": f"{key} leave-one-source-out <= 10%", "value": v,
                        "met": v is not None and v <= TARGETS["loso_per_source"]})
    v = sources["all"]["mape_loso"]
    out.append({"target": "overall leave-one-source-out <= 10%", "value": v,
                "met": v is not None and v <= TARGETS["loso_overall"]})
    v = sources["T1"]["mape_after"]
    out.append({"target": "Megatron-LM Table 1 <= 5% under megatron-core", "value": v,
                "met": v is not None and v <= TARGETS["t1_after"]})
    nf = sources["all"]["not_fitting"]
    out.append({"target": "every run in the reference data predicted to fit", "value": len(nf), "met": not nf,
                "detail": nf})
    lo, hi = TARGETS["compute_scale"]
    scales = {f"{rt} on {gpu} (fsdp borrows it)": fs["compute_scale"] for rt, f in fits.items()
              if not f.get("borrowed_from") for gpu, fs in f["by_device"].items() if "compute_scale" in fs}
    for rt in fits:
        v = get_runtime(rt).factors.get("compute_scale")
        if v is not None:
            scales[f"{rt} elsewhere (its file's physics value)"] = v
    for name, fs in profile_factors().items():
        if "compute_scale" in fs and "fitted" in fs["compute_scale"]["source"]:
            scales[f"deepspeed on {name}"] = fs["compute_scale"]["value"]
    for name, v in scales.items():
        out.append({"target": f"compute_scale of {name} in [0.9, 1.1]", "value": v, "met": lo <= v <= hi})
    uns = sum(s["rows"] - s["scored"] for k, s in sources.items() if k == "all")
    out.append({"target": "every reference row scored", "value": uns, "met": uns == 0,
                "detail": sources["all"]["unsupported"]})
    return out


def _p(v: float | None) -> str:
    return "     -" if v is None else f"{v:6.1%}"


def render(rep: dict[str, Any], rows: bool = False) -> str:
    lines = []
    if rows:
        lines.append(f"{'row':<12} {'runtime':<13} {'gpu':<10} {'measured':>9} {'before':>8} {'after':>8} "
                     f"{'LOSO':>8}  plan")
        for x in rep["rows"]:
            if x["unsupported"]:
                lines.append(f"{x['id']:<12} {x['runtime']:<13} {x['gpu']:<10} {x['measured_s']:9.3f}  "
                             f"not scored: {x['unsupported']}")
                continue
            lines.append(f"{x['id']:<12} {x['runtime']:<13} {x['gpu']:<10} {x['measured_s']:9.3f} "
                         + (f"{x['err_before']:+8.1%}" if x["err_before"] is not None else "       -")
                         + f" {x['err_after']:+8.1%} "
                         + (f"{x['err_loso']:+8.1%}" if x["err_loso"] is not None else "       -")
                         + ("" if x["fits"] else "  PREDICTED NOT TO FIT") + f"  {x['plan']}")
        lines.append("")
    lines.append(f"{'source':<7} {'rows':>4} {'scored':>6} {'before':>7} {'after':>7} {'LOSO':>7}  name")
    for k, s in rep["sources"].items():
        lines.append(f"{k:<7} {s['rows']:>4} {s['scored']:>6} {_p(s['mape_before']):>7} {_p(s['mape_after']):>7} "
                     f"{_p(s['mape_loso']):>7}  {s['name']}"
                     + (f"; predicted not to fit: {len(s['not_fitting'])}" if s["not_fitting"] else "")
                     + (f"; not scored: {', '.join(s['unsupported'])}" if s["unsupported"] and k != "all" else ""))
    lines.append("")
    lines.append("factors fitted here (per GPU, from the sources named; LOSO: refitted without each):")
    for rt, f in rep["fits"].items():
        if f.get("borrowed_from"):
            lines.append(f"  {rt:<14} borrows {f['borrowed_from']}'s per-GPU factors (one source of its own, "
                         f"{', '.join(f['loso'])}, which no fit sees)")
            continue
        for gpu, srcs in f["sources"].items():
            fs = f["by_device"].get(gpu)
            if fs is None:
                lines.append(f"  {rt:<14} {gpu:<10} not fitted: one source ({', '.join(srcs)}); the file's physics values")
                continue
            for n, v in fs.items():
                loso = ", ".join(f"without {s}: " + (f"{b[gpu][n]:.3f}" if gpu in b else "not fitted")
                                 for s, b in f["loso"].items() if s in srcs)
                lines.append(f"  {rt:<14} {gpu:<10} {n:<14} {v:7.3f}  from {', '.join(srcs)}; {loso}")
    lines.append("factors the GPU profiles ship for deepspeed (planner calibrate --reference), each with the source "
                 "the profile states:")
    for name, fs in rep["profiles"].items():
        lines.append(f"  {name:<10} " + ", ".join(f"{k}={v['value']:.4g}" for k, v in fs.items()))
        for k, v in fs.items():
            lines.append(f"      {k}: {v['source'] or '-'}")
    for gen, by_src in rep.get("deepspeed_loso_factors", {}).items():
        lines.append(f"  deepspeed {gen} refitted without each source (leave-one-source-out):")
        for src, fs in by_src.items():
            lines.append(f"      without {src}: " + (", ".join(f"{k}={v:.4g}" for k, v in fs.items()) or "no rows left"))
    lines.append("")
    lines.append("targets:")
    for t in rep["targets"]:
        v = t["value"]
        val = "-" if v is None else (f"{v:.1%}" if isinstance(v, float) and "compute_scale" not in t["target"]
                                     else (f"{v:.3f}" if isinstance(v, float) else str(v)))
        lines.append(f"  {'met   ' if t['met'] else 'MISSED'} {t['target']}: {val}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rows", action="store_true", help="print every row")
    ap.add_argument("--no-loso-deepspeed", action="store_true",
                    help="skip the DeepSpeed refits (their LOSO column stays empty)")
    a = ap.parse_args(argv)
    rep = run(loso_deepspeed=not a.no_loso_deepspeed)
    print(json.dumps(rep, indent=1) if a.json else render(rep, a.rows))
    return 0 if all(t["met"] for t in rep["targets"]) else 1


if __name__ == "__main__":
    sys.exit(main())
