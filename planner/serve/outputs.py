"""What `planner serve` writes: serve_plan.json, serve_top.json, vllm_serve.sh, serve_report.html.

Everything is rendered in memory first and each file is written atomically (planner.rundir),
so a failure never leaves a half-written run directory.
"""
from __future__ import annotations

import base64
import io
import math
from pathlib import Path
from typing import Any

from planner.rundir import atomic_write_json, atomic_write_text
from planner.serve.spec import Deployment, ServeEstimate, Target, Workload
from planner.specs.cluster import ClusterSpec
from planner.specs.model import ModelSpec

def latency_curve(model: ModelSpec, cluster: ClusterSpec, est: ServeEstimate, workload: Workload, *,
                  requests: int, seed: int | None, points: int = 8) -> list[dict[str, float]]:
    """e2e, TTFT and TPOT p50/p99 at `points` arrival rates up to 95% of the saturation rate; for
    a closed-loop workload at `points` user counts up to its own (each point's qps: the rate
    those users reach)."""
    import dataclasses

    from planner.serve import queue
    from planner.serve.memory import serve_memory
    mem = serve_memory(model, cluster, est.deployment, workload)
    run = None if workload.concurrency else \
        queue.replica_runner(model, cluster, est.deployment, workload, mem, requests=requests, seed=seed)
    out = []
    for i in range(1, points + 1):
        if run is None:
            w = dataclasses.replace(workload, concurrency=max(1, round(workload.concurrency * i / points)))
            s = queue.replica_runner(model, cluster, est.deployment, w, mem, requests=requests, seed=seed)(1.0)
            rate = s["achieved_qps"]
        else:
            rate = est.max_qps * 0.95 * i / points
            s = run(rate)
        out.append({"qps": rate, **{f"{m}_{q}_s": s[f"{m}_s"][q] for m in ("e2e", "ttft", "tpot") for q in ("p50", "p99")}})
    return out


PANELS = (("e2e", "end-to-end latency, ms"), ("ttft", "time to first token, ms"), ("tpot", "time per output token, ms"))


def _plot(curves: list[tuple[str, list[dict[str, float]]]], target: Target | None) -> str:
    """Three panels against the arrival rate: e2e, TTFT and TPOT (p50 solid, p99 dashed), the
    latency target drawn on the panel of its metric, a QPS target on every panel."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(13.5, 3.6), dpi=80)
    for ax, (metric, label) in zip(axes, PANELS):
        for name, pts in curves:
            qps = [p["qps"] for p in pts]
            line, = ax.plot(qps, [p[f"{metric}_p50_s"] * 1e3 for p in pts], marker="o", label=f"{name} p50")
            ax.plot(qps, [p[f"{metric}_p99_s"] * 1e3 for p in pts], linestyle="--", color=line.get_color(),
                    label=f"{name} p99")
        if target is not None and target.kind != "qps" and target.metric == metric:
            ax.axhline(target.value * 1e3, color="red", linewidth=0.8, label=f"target {target.kind}")
        if target is not None and target.kind == "qps":
            ax.axvline(target.value, color="red", linewidth=0.8, label="target")
        ax.set_xlabel("requests/s (arrival rate; closed loop: the users' throughput)")
        ax.set_ylabel(label)
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def calibration_badge(cluster: ClusterSpec) -> str:
    """What the serving estimates rest on: fitted factors, measured kernel curves, or neither."""
    from planner.serve import measured
    from planner.serve.factors import SERVE_DEFAULTS
    fitted = sorted(k for k in SERVE_DEFAULTS if k in cluster.device.factors)
    curves = measured.curve(cluster.device, 1) is not None
    if fitted:
        return f"serving factors calibrated ({', '.join(fitted)})"
    if curves:
        return "uncalibrated: serving factors at their defaults; kernel times measured (vidur, " \
               f"{cluster.device.name})"
    return f"uncalibrated: serving factors at their defaults, no measured kernel curves for {cluster.device.name}"


_TEMPLATE = """<!doctype html><html><head><meta charset="utf-8"><title>planner serve: {{ title }}</title>
<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #ccc;
padding:3px 8px;text-align:right}th{background:#eee}td.l{text-align:left}
pre{white-space:pre-wrap;word-break:break-all}.badge{display:inline-block;padding:2px 8px;border-radius:4px;
background:{{ badge_color }};color:#000}</style></head><body>
<h1>Serving {{ title }}</h1><p><span class="badge">{{ badge|e }}</span></p>
<p>Workload: prompt {{ w.prompt_len }} tokens, output {{ w.output_len }} tokens (log-normal sigma
{{ w.prompt_sigma }} / {{ w.output_sigma }}), Poisson arrivals. Target: {{ target }}.
{{ evaluated }} deployments evaluated, {{ infeasible }} infeasible.</p>
<table><tr><th>#</th><th>deployment</th><th>TTFT ms</th><th>TTFT p99 ms</th><th>TPOT ms</th><th>TPOT p99 ms</th>
<th>e2e p50 ms</th><th>e2e p99 ms</th>
<th>at QPS</th><th>QPS at target</th><th>max QPS</th><th>weights GiB</th><th>KV GiB</th><th>act. GiB</th>
<th>runtime GiB</th></tr>
{% for r in rows %}<tr><td>{{ loop.index }}</td><td class="l">{{ r.desc|e }}</td><td>{{ r.ttft }}</td><td>{{ r.ttft99 }}</td>
<td>{{ r.tpot }}</td><td>{{ r.tpot99 }}</td>
<td>{{ r.p50 }}</td><td>{{ r.p99 }}</td><td>{{ r.rate }}</td><td>{{ r.qat }}</td><td>{{ r.max }}</td>
<td>{{ r.w }}</td><td>{{ r.kv }}</td><td>{{ r.act }}</td><td>{{ r.rt }}</td></tr>
{% endfor %}</table>
{% if variant %}<h2 id="variant">Variant against base</h2>
<p>The best deployment ({{ variant.deployment|e }}) for the base model and for the variant
({{ variant.variant|e }}), same workload and rate (docs/variants.md).</p>
<table><tr><th>figure</th><th>base {{ variant.base|e }}</th><th>variant {{ variant.variant|e }}</th><th>variant/base</th></tr>
{% for r in variant.rows %}<tr><td class="l">{{ r.figure|e }}</td><td>{{ r.base|e }}</td><td>{{ r.variant|e }}</td><td>{{ r.ratio|e }}</td></tr>
{% endfor %}</table>{% endif %}
<h2>Latency against load</h2><p>End-to-end, time to first token and time per output token of the
top deployments (p50 solid, p99 dashed){% if target %}; the target in red{% endif %}.</p>
<img alt="latency vs QPS" src="data:image/png;base64,{{ png }}">
<h2>Launch</h2><pre>{{ script|e }}</pre>
<p>Model: planner/serve/cost.py, terms.py, factors.py, memory.py (PagedAttention memory, Pope et al. 2022 decode/prefill), simulation:
planner/serve/queue.py. See docs/serving.md.</p></body></html>
"""


def _row(e: ServeEstimate) -> dict[str, str]:
    def ms(x: float) -> str:
        return "-" if x is None or not math.isfinite(x) else f"{x * 1e3:.1f}"
    m = e.memory_gb
    return {"desc": e.deployment.describe(), "ttft": ms(e.ttft_s), "tpot": ms(e.tpot_s), "p50": ms(e.e2e_p50_s),
            "ttft99": ms(e.ttft_p99_s), "tpot99": ms(e.tpot_p99_s),
            "p99": ms(e.e2e_p99_s), "rate": f"{e.rate_qps:.2f}",
            "qat": "-" if e.qps_at_target is None else f"{e.qps_at_target:.2f}", "max": f"{e.max_qps:.2f}",
            "w": f"{m['weights']:.2f}", "kv": f"{m['kv_cache']:.2f}", "act": f"{m['activations']:.2f}",
            "rt": f"{m['runtime']:.2f}"}


def render_report(title: str, workload: Workload, target: Target | None, ranked: list[ServeEstimate],
                  curves: list[tuple[str, list[dict[str, float]]]], script: str, evaluated: int,
                  infeasible: int, variant: dict[str, Any] | None = None, badge: str = "") -> str:
    """The report page; `variant`: serve_plan.json's variant_comparison (base beside variant)."""
    import jinja2
    env = jinja2.Environment(autoescape=True)
    return env.from_string(_TEMPLATE).render(
        title=title, w=workload, target=target.describe() if target else (
            f"none (ranked by the requests/s {workload.concurrency} closed-loop users get)"
            if workload.concurrency else "none (ranked by max QPS)"),
        rows=[_row(e) for e in ranked], png=_plot(curves, target), script=script, evaluated=evaluated,
        infeasible=infeasible, variant=variant, badge=badge,
        badge_color="#cfc" if badge.startswith("serving factors calibrated") else "#fd8")


def write_serve_run(run_dir: Path, files: dict[str, Any]) -> list[str]:
    """Write the rendered files (name -> dict for JSON, str for text) atomically, in order."""
    for name, content in files.items():
        if isinstance(content, str):
            atomic_write_text(run_dir / name, content, 0o755 if name.endswith(".sh") else None)
        else:
            atomic_write_json(run_dir / name, content)
    return list(files)
