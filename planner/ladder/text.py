"""The ladder as the CLI prints it: one row per rung, then the article's figure beside ours."""
from __future__ import annotations

from typing import Any

from planner.calibrate.accuracy import rel_error
from planner.ladder.claims import ours_text


def _mem(r: dict[str, Any]) -> str:
    s = f"{r['peak_memory_gb']:.1f}" if r["peak_memory_gb"] >= 1 else f"{r['peak_memory_gb']:.3f}"
    return s + ("" if r["feasible"] else "!")


def _tps(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


GAIN_TARGET = 0.15
"""Issue 20: each rung's predicted gain within 15% of its measured gain."""


def _err(predicted: float | None, measured: float | None) -> str:
    """rel_error as a signed percentage, "-" without both."""
    e = rel_error(predicted, measured) if predicted else None
    return "-" if e is None else f"{e:+.0%}"


def _name(r: dict[str, Any]) -> str:
    if r["technique"] == "baseline":
        return "baseline"
    adds = r.get("adds") or [r["technique"]]
    return " + ".join(adds)


def rung_lines(rungs: list[dict[str, Any]], measured: bool) -> list[str]:
    head = f"{'#':>2}  {'technique':<28} {'tokens/s':>10} {'gain':>7} {'step s':>9} {'comm':>5} {'pad':>4} " \
           f"{'peak GB':>8} {'mem':>6}"
    if measured:
        head += f" | {'measured':>9} {'gain':>6} {'err':>6} {'alloc GB':>8} {'peak GB':>8}"
    out = [head]
    for r in rungs:
        if "illegal" in r:
            out.append(f"{r['index']:>2}  {r['technique']:<28} not a legal plan, skipped: {r['illegal']}")
            continue
        gain = f"{r['gain']:.2f}x" if "gain" in r else "-"
        mem = f"{r['memory_ratio']:.2f}x" if "memory_ratio" in r else "-"
        line = (f"{r['index']:>2}  {_name(r):<28} {_tps(r['tokens_per_s']):>10} {gain:>7} {r['step_time_s']:>9.4g} "
                f"{r['comm_share']:>5.0%} {r['padding_share']:>4.0%} {_mem(r):>8} {mem:>6}")
        if measured:
            m = r.get("measured")
            if m and m.get("tokens_per_s"):
                mg = f"{m['gain']:.2f}x" if m.get("gain") else "-"
                err = _err(r.get("gain"), m.get("gain"))
                alloc = m.get("allocated_peak_gb")
                line += (f" | {_tps(m['tokens_per_s']):>9} {mg:>6} {err:>6} "
                         f"{'-' if alloc is None else f'{alloc:.3f}':>8} {m['peak_memory_gb']:>8.3f}")
            else:
                line += " | not run: " + (m or {}).get("not_run", "?")
        out.append(line)
    return out


def claim_lines(rungs: list[dict[str, Any]], measured: bool) -> list[str]:
    out = [f"{'#':>2}  {'technique':<28} {'article':<32} {'ours (predicted)':<26}" + (" measured" if measured else "")]
    for r in rungs:
        c = r.get("claim")
        if not c:
            continue
        ours = ours_text(c)
        line = f"{r['index']:>2}  {_name(r):<28} {c['article']:<32} {ours:<26}"
        if measured:
            m = r.get("measured") or {}
            mc = m.get("claim")
            line += f" {mc}" if mc else (" -" if m.get("tokens_per_s") else "")
        if c.get("note"):
            line += f"  ({c['note']})"
        if r.get("inert"):
            line += f"  (inert: {r['inert']})"
        out.append(line)
    return out


def lines(ladder: dict[str, Any]) -> list[str]:
    measured = any("measured" in r for r in ladder["rungs"])
    out = [f"ladder to: {ladder['description']}",
           f"order: {', '.join(ladder['order'])}; throughput in real (non-padding) tokens/s; gain and mem: over the "
           "rung before; ! = does not fit"]
    out += rung_lines(ladder["rungs"], measured)
    for u in ladder["unchanged"]:
        out.append(f"    {u['technique']}: no rung ({u['why']})")
    ratio = ladder["ratio"]
    out.append(f"baseline -> plan (predicted): {ratio['throughput']:.2f}x tokens/s, {ratio['memory']:.2f}x peak memory "
               "per GPU (the product of the gains)")
    if ladder.get("measured_ratio"):
        mr = ladder["measured_ratio"]
        out.append(f"baseline -> plan (measured): {mr['throughput']:.2f}x tokens/s (prediction "
                   f"{_err(ratio['throughput'], mr['throughput'])}), {mr['memory']:.2f}x peak memory"
                   + (f", {mr['allocated']:.2f}x allocated" if mr.get("allocated") else "")
                   + f"; err = (predicted - measured) / measured, target within {GAIN_TARGET:.0%}")
    out.append("")
    out.append("the article's figure beside ours:")
    out += claim_lines(ladder["rungs"], measured)
    if ladder.get("alone"):
        out.append("")
        out.append("each technique alone on the baseline:")
        for r in ladder["alone"]:
            if "illegal" in r:
                out.append(f"    {r['technique']:<28} not a legal plan: {r['illegal']}")
            else:
                out.append(f"    {r['technique']:<28} {r['gain']:>7.2f}x tokens/s {r['memory_ratio']:>6.2f}x memory "
                           f"({_tps(r['tokens_per_s'])} tokens/s, {_mem(r)} GB)")
    return out
