"""The report of `planner calibrate --reference` (benchmarks/ds_reference.py prints it): every
row before / after the per-generation fit / left out of it, MAPE by section and generation, the
fitted factors with how well the rows determine them, which profile borrows what, and `apply`,
which writes the fit into profiles/ with a source line per factor.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from planner.calibrate.accuracy import mape, rel_error
from planner.calibrate.fit import with_factors
from planner.calibrate.reference.fit import LAM, STARTS, default_factor_names, factor_value, fit_generations
from planner.calibrate.reference.rows import (DATA, load_rows, memory_of, phases_of, run_estimate, source_flops,
                                              value_of)
from planner.cost.factors import DEFAULTS
from planner.rundir import atomic_write_json
from planner.specs.hardware import PROFILES_DIR

OUT = Path("reports") / "bench-ds-reference" / "calibration.json"


def run(*, factor_names: Mapping[str, Sequence[str]] | None = None, lam: float = LAM,
        inter_gbps: Mapping[str, float] | None = None, loo: bool = True, jobs: int = 2, starts: int = STARTS,
        data: Path = DATA) -> dict[str, Any]:
    t0 = time.perf_counter()
    meta = json.loads(Path(data).read_text())
    rows = load_rows(data, inter_gbps)
    report: dict[str, Any] = {"lam": lam, "starts": starts, "generations": {}, "rows": [], "sections": {},
                              "clusters": meta["clusters"], "defaults": meta["defaults"],
                              "families": meta["families"]}
    by_id: dict[str, dict[str, Any]] = {}
    state, fits, loo_out = fit_generations(meta, rows, factor_names=factor_names, lam=lam, loo=loo, jobs=jobs,
                                           starts=starts)
    for gen, ginfo in meta["generations"].items():
        st = state[gen]
        device, grows, missing, fitted, names, fit = (st[k] for k in ("device", "rows", "missing", "fitted", "names",
                                                                      "fit"))
        fitted_ids = {r.id for r in fitted}
        after_dev = with_factors(device, fit.factors)
        loo_by_id: dict[str, float] = {}
        loo_factors: dict[str, dict[str, float]] = {}
        for i, r in enumerate(fitted):
            if ("loo", gen, i) in loo_out:
                loo_by_id[r.id], loo_factors[r.id] = loo_out[("loo", gen, i)]
        before_f = {n: factor_value(device, n) for n in names}
        report["generations"][gen] = {
            "profile": ginfo["profile"], "applies_to": ginfo["applies_to"], "why": ginfo["why"],
            "fitted_names": list(names), "before": before_f, "after": fit.factors,
            "sensitivity": fit.sensitivity,
            "determination": fit.determination,
            "undetermined": [n for n, d in fit.determination.items() if d < 0.5 and n not in fit.at_bound],
            "at_bound": fit.at_bound,
            "msle_fitted": fit.msle, "iterations": sum(f.iterations for f in fits[gen]),
            "fitted_rows": [r.id for r in fitted],
            "loo_factor_range": {n: [min(f[n] for f in loo_factors.values()), max(f[n] for f in loo_factors.values())]
                                 for n in names} if loo_factors else {},
        }
        for r in grows:
            eb, ea = run_estimate(r, device), run_estimate(r, after_dev)
            before, after = value_of(r, eb), value_of(r, ea)
            in_fit = r.id in fitted_ids
            loo_v = loo_by_id.get(r.id, after if loo and not in_fit else None)
            notes = []
            if missing[r.id]:
                notes.append("cost model does not represent " + ", ".join(missing[r.id])
                             + (" yet: out of the fit" if r.needs_variant else " yet"))
            if not eb.feasible:
                notes.append("estimate infeasible: " + "; ".join(eb.reasons))
            rec = {
                "id": r.id, "section": r.section, "gen": gen, "tag": r.tag, "note": r.note,
                "role": "fit" if in_fit else "held out" if not r.fit else "excluded",
                "metric": r.metric, "measured": r.measured,
                "before": before, "after": after, "loo": loo_v,
                "err_before": rel_error(before, r.measured), "err_after": rel_error(after, r.measured),
                "err_loo": rel_error(loo_v, r.measured), "notes": notes,
                "plan": r.plan.describe(), "cluster": r.cluster_name, "gpus": r.gpus,
                "global_batch": r.train.global_batch, "seq": r.train.seq_len,
                "source_tflops_convention": r.flops, "source": r.source, "assumed": list(r.assumed),
                "estimate_after": {"step_time_s": ea.step_time_s, "time_breakdown_s": ea.time.to_dict(),
                                   "peak_memory_gb": ea.peak_memory_gb, "feasible": ea.feasible},
            }
            if r.metric == "step_s" and r.flops:
                rec["published_tflops"] = r.published_tflops
                rec["formula_tflops_at_measured_step"] = source_flops(r) / r.measured / r.world / 1e12
            if r.memory_gb is not None:
                rec["memory"] = {"kind": r.memory_kind, "measured_gb": r.memory_gb,
                                 "predicted_gb": memory_of(r, ea), "err": rel_error(memory_of(r, ea), r.memory_gb)}
            if r.phases_s:
                rec["phases_s"] = {"measured": dict(r.phases_s), "predicted_after": phases_of(ea)}
            by_id[r.id] = rec
    report["rows"] = [by_id[r.id] for r in rows]
    report["profiles"] = profile_provenance(report["generations"], meta.get("borrow", "A100"))
    groups: dict[str, list[dict]] = {}
    for rec in report["rows"]:
        groups.setdefault(f"section {rec['section']}" + (f" ({rec['gen']})" if rec["section"] == "A" else ""),
                          []).append(rec)
        groups.setdefault(rec["gen"], []).append(rec)
    groups["all"] = report["rows"]
    for k, recs in groups.items():
        report["sections"][k] = {
            "rows": len(recs),
            "mape_before": mape([x["err_before"] for x in recs]),
            "mape_after": mape([x["err_after"] for x in recs]),
            "mape_after_fitted": mape([x["err_after"] for x in recs if x["role"] == "fit"]),
            "mape_after_held_out": mape([x["err_after"] for x in recs if x["role"] == "held out"]),
            "mape_loo": mape([x["err_loo"] for x in recs]),
            "memory_mape": mape([x["memory"]["err"] for x in recs if "memory" in x]),
        }
    report["runtime_s"] = time.perf_counter() - t0
    return report


def profile_provenance(gens: Mapping[str, Mapping[str, Any]], borrow: str) -> dict[str, dict[str, Any]]:
    """For every built-in GPU profile, per factor: fitted on its own generation's rows; or, for
    a profile with no rows of its own, borrowed (from `borrow`'s rows, else another
    generation's, where they determine it); or kept at the profile's value (its own rows do not
    determine it, or push it to a bound: another generation's value is noted, not imposed)."""
    def determined(g: str, n: str) -> bool:
        v = gens[g]
        return n in v["fitted_names"] and n not in set(v["undetermined"]) | set(v["at_bound"])

    out = {}
    for f in sorted(PROFILES_DIR.glob("*.json")):
        data = json.loads(f.read_text())
        if data.get("kind") != "gpu":
            continue
        name = data["name"]
        own = next((g for g, v in gens.items() if name in v["applies_to"]), None)
        names = list(dict.fromkeys(n for v in gens.values() for n in v["fitted_names"]))
        mine, borrowed, kept = [], {}, {}
        for n in names:
            if own is not None and determined(own, n):
                mine.append(n)
                continue
            donor = next((g for g in [borrow, *gens] if g != own and determined(g, n)), None)
            alt = {"from": donor, "value": gens[donor]["after"][n]} if donor else {"from": None, "value": None}
            if own is None and donor:
                borrowed[n] = alt
            else:
                why = ("pushed to its bound by" if own and n in gens[own]["at_bound"] else "not determined by") + \
                    (f" {own}'s rows" if own else " any generation's rows")
                kept[n] = {"why": why, "alternative": alt}
        out[name] = {"generation": own, "fitted_on_own_generation": mine, "borrowed": borrowed, "kept": kept,
                     "note": (f"rows of {own}" + ("" if name == gens[own]["profile"] else
                                                  f" (fitted on {gens[own]['profile']}, the same chip)"))
                     if own else f"no DeepSpeed rows of its own in the reference: borrows {borrow}'s (the nearest "
                                 f"generation with rows: NVLink nodes, InfiniBand)"}
    return out


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def render(rep: dict[str, Any]) -> str:
    lines = [f"{'row':<4} {'gen':<4} {'role':<8} {'metric':<6} {'measured':>9} {'before':>9} {'err':>7} "
             f"{'after':>9} {'err':>7} {'LOO':>9} {'err':>7}  plan / note"]
    for x in rep["rows"]:
        unit = "s/step" if x["metric"] == "step_s" else "TFLOP/s"
        lines.append(f"{x['id']:<4} {x['gen']:<4} {x['role']:<8} {unit:<6} {x['measured']:>9.2f} "
                     f"{x['before']:>9.2f} {_fmt(x['err_before'], '+7.1%')} {x['after']:>9.2f} "
                     f"{_fmt(x['err_after'], '+7.1%')} {_fmt(x['loo'], '9.2f')} {_fmt(x['err_loo'], '+7.1%')}  "
                     f"{x['note']}: {x['plan']}")
        for n in x["notes"]:
            lines.append(f"{'':<27}! {n}")
    lines.append("")
    lines.append(f"{'MAPE':<16} {'rows':>4} {'before':>8} {'after':>8} {'fitted':>8} {'held out':>9} {'LOO':>8} "
                 f"{'memory':>8}")
    for k, s in rep["sections"].items():
        lines.append(f"{k:<16} {s['rows']:>4} {_fmt(s['mape_before'], '8.1%')} {_fmt(s['mape_after'], '8.1%')} "
                     f"{_fmt(s['mape_after_fitted'], '8.1%')} {_fmt(s['mape_after_held_out'], '9.1%')} "
                     f"{_fmt(s['mape_loo'], '8.1%')} {_fmt(s['memory_mape'], '8.1%')}")
    lines.append("")
    mem = [x for x in rep["rows"] if "memory" in x]
    if mem:
        lines.append("memory per GPU (after fit; memory factors not fitted):")
        for x in mem:
            m = x["memory"]
            lines.append(f"  {x['id']:<4} {m['kind']:<9} measured {m['measured_gb']:6.2f} GB  predicted "
                         f"{m['predicted_gb']:6.2f} GB  {m['err']:+.1%}")
    ph = [x for x in rep["rows"] if "phases_s" in x]
    if ph:
        lines.append("phases, seconds (measured / predicted after fit; predicted backward = everything but "
                     "forward compute and the optimizer step):")
        for x in ph:
            m, p = x["phases_s"]["measured"], x["phases_s"]["predicted_after"]
            lines.append("  " + f"{x['id']:<4} " + "  ".join(f"{k} {m[k]:.2f} / {p[k]:.2f}" for k in m))
    lines.append("")
    for gen, g in rep["generations"].items():
        lines.append(f"{gen} ({g['profile']}; fitted on {len(g['fitted_rows'])} rows, MSLE {g['msle_fitted']:.4f}, "
                     f"{g['iterations']} iterations):")
        for n in g["fitted_names"]:
            rng = g["loo_factor_range"].get(n)
            lines.append(f"  {n:<24} {g['before'][n]:>10.4g} -> {g['after'][n]:>10.4g}   determined "
                         f"{g['determination'][n]:4.2f}" + (" (by the ridge, not the rows: stays near the profile's)"
                                                            if n in g["undetermined"] else "")
                         + (" (at its bound)" if n in g["at_bound"] else "")
                         + (f"   LOO range {rng[0]:.4g}..{rng[1]:.4g}" if rng else ""))
    lines.append("profiles: factors fitted on their own generation / borrowed / kept (another generation's value):")
    for name, p in rep["profiles"].items():
        b = ", ".join(f"{n} from {v['from']}" for n, v in p["borrowed"].items())
        k = ", ".join(n + (f" ({v['alternative']['from']}: {v['alternative']['value']:.4g})"
                           if v["alternative"]["from"] else "") for n, v in p["kept"].items())
        lines.append(f"  {name:<10} own: {', '.join(p['fitted_on_own_generation']) or '-'}; borrowed: {b or '-'}; "
                     f"kept at the profile's value: {k or '-'}")
    lines.append(f"lam {rep['lam']:g}, {rep['starts']} starts; runtime {rep['runtime_s']:.1f} s")
    return "\n".join(lines)


def apply(rep: dict[str, Any], profiles_dir: Path = PROFILES_DIR) -> list[str]:
    """Write the fit into the built-in profiles: each factor fitted on the profile's own
    generation, or borrowed from another generation's fit, with a source line saying which
    (the issue's rule: never one factor per row, and every profile states where its factors
    came from). Returns one line per profile changed."""
    out = []
    sections = {"A100": "A (BigScience, Jean Zay) and B (Azure NDm A100 v4 ZeRO-3)",
                "V100": "A13 (Megatron-DeepSpeed 13B), C (ZeRO-3 vs ZeRO++), D (ZeRO-Offload), E (ZeRO paper)"}
    for name, p in rep["profiles"].items():
        path = profiles_dir / f"{name}.json"
        data = json.loads(path.read_text())
        factors, sources = dict(data.get("factors", {})), dict(data.get("sources", {}))
        gen = p.get("generation")
        if gen:
            g = rep["generations"][gen]
            loo = rep["sections"].get(gen, {}).get("mape_loo")
            for n in p["fitted_on_own_generation"]:
                factors[n] = round(g["after"][n], 6)
                sources[f"factors.{n}"] = (
                    f"fitted on DeepSpeed's published {gen} runs, sections {sections.get(gen, '?')} of "
                    f"reference/deepspeed-at-scale.md ({len(g['fitted_rows'])} rows, one set for the generation; "
                    f"MSLE {g['msle_fitted']:.4f}" + (f", leave-one-out MAPE {100 * loo:.1f}%" if loo else "")
                    + "): planner calibrate --reference")
        for n, b in p["borrowed"].items():
            factors[n] = round(b["value"], 6)
            sources[f"factors.{n}"] = (f"borrowed from the {b['from']} fit on DeepSpeed's published runs (no published "
                                       f"DeepSpeed runs on {name}): planner calibrate --reference")
        for n in p["kept"]:
            sources[f"factors.{n}"] = (f"kept at planner/cost/factors.py's default: {p['kept'][n]['why']} "
                                       "(planner calibrate --reference)")
        sources["factors"] = ("DeepSpeed runtime factors fitted per GPU generation on DeepSpeed's own published runs "
                              "(planner calibrate --reference); each factors.<name> line says fitted, borrowed or "
                              "kept; Megatron-LM Table 1 is the separate check (benchmarks/fidelity.py)")
        data["factors"], data["sources"] = dict(sorted(factors.items())), sources
        atomic_write_json(path, data)
        out.append(f"{name}: " + ", ".join(f"{k}={v:.4g}" for k, v in data["factors"].items()))
    return out


def _pairs(items: Sequence[str], what: str) -> dict[str, str]:
    out = {}
    for it in items:
        if "=" not in it:
            raise SystemExit(f"{what}: expected NAME=VALUE, got {it!r}")
        k, v = it.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from planner.calibrate import reference
    ap = argparse.ArgumentParser(description=reference.__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--factors", action="append", default=[], metavar="GEN=a,b,c",
                    help=f"factors to fit for a generation (default: {','.join(default_factor_names())})")
    ap.add_argument("--inter-gbps", action="append", default=[], metavar="CLUSTER=GBPS",
                    help="override a cluster's assumed inter-node bus bandwidth (clusters in the data file)")
    ap.add_argument("--lam", type=float, default=LAM, help=f"ridge weight toward the generation's anchor in the rows file ({LAM:g})")
    ap.add_argument("--starts", type=int, default=STARTS, help=f"fit starting points per generation ({STARTS})")
    ap.add_argument("--no-loo", action="store_true", help="skip the leave-one-out refits")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                    help="processes for the fits' starting points and the leave-one-out refits")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--apply", action="store_true",
                    help="write the fitted (and borrowed) factors into profiles/*.json with their sources")
    a = ap.parse_args(argv)
    names = {g: [n for n in v.split(",") if n] for g, v in _pairs(a.factors, "--factors").items()}
    for g, ns in names.items():
        bad = [n for n in ns if n not in DEFAULTS]
        if bad:
            raise SystemExit(f"--factors {g}: unknown factor(s) {bad}; known: {', '.join(DEFAULTS)}")
    gbps = {k: float(v) for k, v in _pairs(a.inter_gbps, "--inter-gbps").items()}
    rep = run(factor_names=names, lam=a.lam, inter_gbps=gbps, loo=not a.no_loo, jobs=a.jobs, starts=a.starts)
    rep["command"] = " ".join(["planner calibrate --reference" if a.apply else "benchmarks/ds_reference.py",
                               *(argv if argv is not None else sys.argv[1:])])
    atomic_write_json(a.out, rep)
    print(json.dumps(rep, indent=2) if a.json else render(rep) + f"\nwritten: {a.out}")
    if a.apply:
        print("applied to profiles/:\n  " + "\n  ".join(apply(rep)))
    return rep
