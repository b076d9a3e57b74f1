"""The serving cost model against published serving figures (issue 11, point 4).

The rows are benchmarks/serve_published_rows.json: TensorRT-LLM's performance tables (A100 FP16,
H100 FP8), lmdeploy's A100 static-batch table, NeMo's Llama-2 inference table, two vLLM runs
(A100 40GB, H100) and the AutoGLM article's figures, each with its settings, its source and what
had to be assumed. For each row the script builds the model (the public config.json through
planner.specs.hf.spec_from_hf, or a preset), the cluster (parse_cluster "NxGPU"), a Deployment and
a Workload, and predicts the row's metric the way the source measured it:

    ttft_s        prefill_time_s(prompt)                          (batch 1, first token)
    e2e_s         prefill + one decode step per further token     (static batch; static_prefill_s)
    output_tok_s  batch x output / (prefill + decode steps)       (static batch throughput)
    decode_tok_s  batch / decode_step_time_s at the mean context  (decode phase alone)
    tpot_s        decode_step_time_s at the mean context
    max_qps       estimate_serving(...).max_qps                   (queueing simulation)
    memory_gb     estimate_serving(...).memory_gb['total']        (per GPU)

A decode step's context is the KV tokens the batch holds: batch x (prompt + tokens so far).
estimate_serving is also called for every row: an infeasible deployment is flagged. Error =
predicted / published - 1; MAPE per metric kind over the rows marked in_mape.

    .venv/bin/python benchmarks/serve_published.py           # table + MAPE
                                     # (writes reports/bench-serve-published/comparison.json)
    .venv/bin/python benchmarks/serve_published.py --json    # the same as JSON on stdout
    .venv/bin/python benchmarks/serve_published.py --rows T1,N1
    .venv/bin/python benchmarks/serve_published.py --factor decode_bw_efficiency=0.7   # a what-if
    .venv/bin/python benchmarks/serve_published.py --factor serve_request_overhead_s=0 # no HTTP overhead

Nothing is fitted to these rows: they are the validation set (the rows file's calibration_rows
is empty). Closed-loop rows (`concurrency` N) are predicted by the queueing simulation of N users.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.calibrate.fit import with_factors  # noqa: E402
from planner.calibrate.accuracy import mape, rel_error  # noqa: E402
from planner.errors import SpecError  # noqa: E402
from planner.rundir import atomic_write_json  # noqa: E402
from planner.specs import ModelSpec, find_device, parse_cluster  # noqa: E402
from planner.specs.cluster import ClusterSpec  # noqa: E402
from planner.specs.hf import spec_from_hf  # noqa: E402
from planner.specs.presets import preset

DATA = Path(__file__).with_name("serve_published_rows.json")
OUT = ROOT / "reports" / "bench-serve-published" / "comparison.json"
METRICS = ("ttft_s", "e2e_s", "tpot_s", "output_tok_s", "decode_tok_s", "max_qps", "memory_gb", "req_s", "ttft_p50_s",
           "ttft_p99_s")
GROUPS = {"TTFT": ("ttft_s", "ttft_p50_s", "ttft_p99_s"), "TPOT": ("tpot_s", "decode_tok_s"),
          "throughput": ("output_tok_s", "req_s", "max_qps"), "end-to-end": ("e2e_s",)}
"""The issue's three targets (TTFT, TPOT, throughput MAPE <= 20% each) and end-to-end latency."""
WEIGHT_PRECISIONS = ("bf16", "int8", "int4", "fp8")
KV_PRECISIONS = ("bf16", "fp8", "int8")
TIME_METRICS = ("ttft_s", "e2e_s", "tpot_s", "ttft_p50_s", "ttft_p99_s")
DECODE_ALONE = ("decode_tok_s", "tpot_s")
"""Metrics of a batch-1 decode step alone: memory-bound, so published / predicted x the
profile's decode_bw_efficiency is the bandwidth share the engine reached (step overhead 0)."""
SCHEDULERS = ("vllm", "vllm-v0")
V0_MIN_BUDGET = 2048


def v0_budget(model: ModelSpec) -> int:
    """vLLM V0 without chunked prefill (off by default for max_model_len <= 32768,
    vllm/engine/arg_utils.py): max_num_batched_tokens = max(max_model_len, 2048) (vllm/config.py
    SchedulerConfig); max_model_len defaults to the model's context (ModelSpec.max_seq)."""
    return max(model.max_seq, V0_MIN_BUDGET)


REQUIRED = ("id", "source", "where", "engine", "model", "gpu", "gpus", "tp", "weight_precision", "kv_precision",
            "prompt_len", "output_len", "batch", "metric", "value", "in_mape", "assumptions")


@dataclass(frozen=True, slots=True)
class Row:
    id: str
    source: str
    where: str
    engine: str
    model_name: str
    model: ModelSpec
    cluster: ClusterSpec
    tp: int
    weight_precision: str
    kv_precision: str
    prompt_len: int
    output_len: int
    batch: int
    metric: str
    value: float
    in_mape: bool
    assumptions: tuple[str, ...]
    concurrency: int = 0
    """Closed loop: N requests in flight (0: a static batch or batch-1 figure)."""
    requests: int = 300
    mean_output_len: float = 0.0
    """Requests stopping at end-of-sequence before output_len: their mean generated tokens (0: none)."""
    scheduler: str = "vllm"
    """The engine's scheduler for the queueing simulation: "vllm" (V1) or "vllm-v0" (V0 without
    chunked prefill, budget V0_BUDGET)."""


def _check(raw: dict[str, Any], data: dict[str, Any]) -> None:
    rid = raw.get("id", "?")
    missing = [k for k in REQUIRED if k not in raw]
    if missing:
        raise SpecError(f"rows[{rid}]", f"missing {', '.join(missing)}", "give every field (see the other rows)")
    if raw["source"] not in data.get("sources", {}):
        raise SpecError(f"rows[{rid}].source", f"unknown source {raw['source']!r}", "add it under 'sources'")
    if raw["model"] not in data.get("families", {}):
        raise SpecError(f"rows[{rid}].model", f"unknown model {raw['model']!r}", "add it under 'families'")
    if raw["metric"] not in METRICS:
        raise SpecError(f"rows[{rid}].metric", f"unknown metric {raw['metric']!r}", f"use one of {', '.join(METRICS)}")
    if raw["weight_precision"] not in WEIGHT_PRECISIONS or raw["kv_precision"] not in KV_PRECISIONS:
        raise SpecError(f"rows[{rid}]", "unknown precision", f"weights: {WEIGHT_PRECISIONS}, KV: {KV_PRECISIONS}")
    for key in ("gpus", "tp", "prompt_len", "output_len", "batch"):
        if not isinstance(raw[key], int) or isinstance(raw[key], bool) or raw[key] < 1:
            raise SpecError(f"rows[{rid}].{key}", f"must be a positive integer, not {raw[key]!r}", "fix the row")
    if not isinstance(raw["value"], (int, float)) or not raw["value"] > 0:
        raise SpecError(f"rows[{rid}].value", f"must be positive, not {raw['value']!r}", "copy the source's figure")
    for key in ("concurrency", "requests"):
        v = raw.get(key, 1)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise SpecError(f"rows[{rid}].{key}", f"must be a positive integer, not {v!r}", "fix the row")
    mean = raw.get("mean_output_len", 0)
    if isinstance(mean, bool) or not isinstance(mean, (int, float)) or not 0 <= mean <= raw["output_len"]:
        raise SpecError(f"rows[{rid}].mean_output_len", f"must lie in [0, output_len], not {mean!r}", "fix the row")
    if raw.get("scheduler", "vllm") not in SCHEDULERS:
        raise SpecError(f"rows[{rid}].scheduler", f"unknown {raw['scheduler']!r}", f"use one of {', '.join(SCHEDULERS)}")
    if raw["gpus"] % raw["tp"]:
        raise SpecError(f"rows[{rid}].tp", f"{raw['tp']} does not divide {raw['gpus']} GPUs", "fix the row")


def build_model(name: str, family: dict[str, Any]) -> ModelSpec:
    if "preset" in family:
        return preset(family["preset"])
    return spec_from_hf(family["hf_config"], name=name, where=f"families.{name}.hf_config")


def load_rows(path: Path = DATA, only: Sequence[str] | None = None) -> list[Row]:
    data = json.loads(Path(path).read_text())
    models = {name: build_model(name, fam) for name, fam in data["families"].items()}
    rows = []
    for raw in data["rows"]:
        _check(raw, data)
        if only and raw["id"] not in only:
            continue
        find_device(raw["gpu"])  # a GPU the profiles know, or SpecError
        rows.append(Row(
            id=raw["id"], source=raw["source"], where=raw["where"], engine=raw["engine"], model_name=raw["model"],
            model=models[raw["model"]], cluster=parse_cluster(f"{raw['gpus']}x{raw['gpu']}"), tp=raw["tp"],
            weight_precision=raw["weight_precision"], kv_precision=raw["kv_precision"],
            prompt_len=raw["prompt_len"], output_len=raw["output_len"], batch=raw["batch"], metric=raw["metric"],
            value=float(raw["value"]), in_mape=bool(raw["in_mape"]), assumptions=tuple(raw["assumptions"]),
            concurrency=int(raw.get("concurrency", 0)), requests=int(raw.get("requests", 300)),
            mean_output_len=float(raw.get("mean_output_len", 0)), scheduler=raw.get("scheduler", "vllm")))
    return rows


# --- predictions ---------------------------------------------------------------------------

def _serve():
    try:
        from planner.serve import cost, spec
    except ImportError as exc:
        raise SystemExit(f"planner.serve is not importable ({exc}): the serving cost model (issue 11, "
                         "helper A) is not in this checkout yet; nothing to compare") from None
    return cost, spec


def deployment(row: Row):
    _, spec = _serve()
    v0 = row.scheduler == "vllm-v0"
    return spec.Deployment(tp=row.tp, replicas=row.cluster.world_size // row.tp, max_batch=row.batch,
                           weight_precision=row.weight_precision, kv_precision=row.kv_precision,
                           engine=row.scheduler, prefill_chunk=v0_budget(row.model) if v0 else 0)


def workload(row: Row):
    _, spec = _serve()
    return spec.Workload(prompt_len=row.prompt_len, output_len=row.output_len, concurrency=row.concurrency,
                         mean_output_len=row.mean_output_len)


def static_prefill_s(row: Row) -> float:
    """Seconds of one prefill step of `batch` prompts together, as the static-batch engines the
    sources measured run it (TensorRT-LLM's gptSessionBenchmark, lmdeploy's static benchmark):
    terms.step_terms of `batch` chunks of the whole prompt in one step (the GEMMs over every
    row, each sequence's own causal attention, the logits of one row each), combined with the
    serving factors."""
    _serve()
    from planner.serve.factors import combine, serve_factors
    from planner.serve.terms import step_terms
    dep = deployment(row)
    terms = step_terms(row.model, row.cluster, dep, [(row.prompt_len, 0)] * row.batch)
    return combine(terms, serve_factors(row.cluster))


def static_batch(row: Row) -> tuple[float, float]:
    """(prefill seconds, decode seconds) of one static batch: the batch's prompts in one prefill
    step, then output_len - 1 decode steps, step k holding batch x (prompt + k) KV tokens (each
    sequence's cached tokens plus its new one, cost.decode_step_time_s's context_tokens)."""
    cost, _ = _serve()
    dep = deployment(row)
    decode = sum(cost.decode_step_time_s(row.model, row.cluster, dep, row.batch, row.batch * (row.prompt_len + k))
                 for k in range(1, row.output_len))
    return static_prefill_s(row), decode


def mean_step(row: Row) -> float:
    cost, _ = _serve()
    context = row.batch * (row.prompt_len + row.output_len // 2)
    return cost.decode_step_time_s(row.model, row.cluster, deployment(row), row.batch, context)


def primitive_value(row: Row) -> float | None:
    """The row's metric from the cost model's step times alone (None: needs estimate_serving)."""
    m = row.metric
    if row.concurrency:
        return None  # closed loop: the queueing simulation
    if m == "ttft_s":
        return static_prefill_s(row)
    if m == "e2e_s" and row.in_mape:
        return sum(static_batch(row))
    if m == "output_tok_s":
        return row.batch * row.output_len / sum(static_batch(row))
    if m == "decode_tok_s":
        return row.batch / mean_step(row)
    if m == "tpot_s":
        return mean_step(row)
    return None


def predict(row: Row) -> dict[str, Any]:
    """The row's metric as the cost model predicts it, with estimate_serving's verdict."""
    cost, _ = _serve()
    from planner.serve.estimate import estimate_serving
    est = estimate_serving(row.model, row.cluster, deployment(row), workload(row), requests=row.requests)
    value = primitive_value(row)
    if row.concurrency:  # N users: the simulation's own throughput and latencies at their load
        value = {"req_s": est.rate_qps, "output_tok_s": est.rate_qps * workload(row).mean_lengths()[1],
                 "ttft_s": est.ttft_s,
                 "ttft_p50_s": est.ttft_p50_s, "ttft_p99_s": est.ttft_p99_s, "tpot_s": est.tpot_p50_s, "e2e_s": est.e2e_p50_s}.get(row.metric)
    elif value is None and row.metric == "e2e_s":
        value = est.e2e_p50_s
    elif value is None and row.metric == "max_qps":
        value = est.max_qps  # queue.saturation_qps: every request queued at time 0
    elif value is None:  # memory_gb: the estimate's per-GPU total (weights + KV cache + activations + runtime)
        mem = est.memory_gb
        value = float(mem["total"] if "total" in mem else
                      sum(mem.get(k, 0.0) for k in ("weights", "kv_cache", "activations", "runtime")))
    return {"predicted": None if value is None else float(value), "feasible": bool(est.feasible),
            "reasons": list(est.reasons or []), "estimate_ttft_s": est.ttft_s, "estimate_tpot_s": est.tpot_s}


def with_serve_factors(rows: Sequence[Row], factors: dict[str, float]) -> list[Row]:
    """The rows with `factors` set in every row's device profile (the profiles' own values otherwise)."""
    return [dataclasses.replace(r, cluster=dataclasses.replace(
        r.cluster, device=with_factors(r.cluster.device, factors))) for r in rows] if factors else list(rows)


def compare(rows: Sequence[Row]) -> dict[str, Any]:
    out = []
    for r in rows:
        p = predict(r)
        err = rel_error(p["predicted"], r.value)
        out.append({"id": r.id, "source": r.source, "where": r.where, "engine": r.engine, "model": r.model_name,
                    "gpus": r.cluster.spec, "tp": r.tp, "weights": r.weight_precision, "kv": r.kv_precision,
                    "prompt_len": r.prompt_len, "output_len": r.output_len, "batch": r.batch, "concurrency": r.concurrency, "metric": r.metric,
                    "published": r.value, **p, "error": err, "in_mape": r.in_mape})
    by_metric: dict[str, dict[str, float]] = {}
    for m in METRICS:
        errs = [x["error"] for x in out if x["metric"] == m and x["in_mape"] and x["error"] is not None]
        if errs:
            by_metric[m] = {"rows": len(errs), "mape": mape(errs)}
    groups = {}
    for name, members in GROUPS.items():
        errs = [x["error"] for x in out if x["metric"] in members and x["in_mape"] and x["error"] is not None]
        if errs:
            groups[name] = {"rows": len(errs), "mape": mape(errs),
                            "by_row": contributions(out, members)}
    every = [x["error"] for x in out if x["in_mape"] and x["error"] is not None]
    if every:
        by_metric["all"] = {"rows": len(every), "mape": mape(every)}
    _serve()
    from planner.serve.factors import serve_factors
    factors = {r.cluster.device.name: serve_factors(r.cluster) for r in rows}
    implied = {}
    for r, x in zip(rows, out):
        alone = r.batch == 1 and (r.metric in DECODE_ALONE or (r.metric == "output_tok_s" and r.prompt_len == 1))
        if alone and x["predicted"]:
            slower = x["published"] / x["predicted"] if r.metric == "tpot_s" else x["predicted"] / x["published"]
            implied[r.id] = factors[r.cluster.device.name]["decode_bw_efficiency"] / slower
    return {"rows": out, "mape": by_metric, "groups": groups, "serve_factors": factors,
            "implied_decode_bw_efficiency": implied}


def contributions(out: Sequence[dict[str, Any]], members: Sequence[str]) -> list[dict[str, Any]]:
    """Which rows make a target's MAPE: the in-MAPE rows of `members`, largest |error| first, each
    with its share of the group's summed |error| (the MAPE is that sum / rows, so a row's share
    is how much of the MAPE it carries) and the running share."""
    xs = sorted((x for x in out if x["metric"] in members and x["in_mape"] and x["error"] is not None),
                key=lambda x: -abs(x["error"]))
    total = sum(abs(x["error"]) for x in xs)
    rows, run = [], 0.0
    for x in xs:
        share = abs(x["error"]) / total if total else 0.0
        run += share
        rows.append({"id": x["id"], "metric": x["metric"], "error": x["error"], "share": share, "cumulative": run})
    return rows


def _fmt(metric: str, v: float | None) -> str:
    if v is None:
        return "-"
    if metric in TIME_METRICS:
        return f"{v * 1e3:.1f} ms"
    if metric == "memory_gb":
        return f"{v:.1f} GB"
    return f"{v:,.1f}" if v < 100 else f"{v:,.0f}"


def table(result: dict[str, Any]) -> str:
    head = f"{'id':<4} {'model':<13} {'gpus':<12} {'tp':>2} {'w/kv':<9} {'in/out':>10} {'batch':>5} " \
           f"{'metric':<12} {'published':>11} {'predicted':>11} {'error':>8}  note"
    lines = [head, "-" * len(head)]
    for x in result["rows"]:
        err = "-" if x["error"] is None else f"{x['error']:+.0%}"
        note = [] if x["in_mape"] else ["not in MAPE"]
        if not x["feasible"]:
            note.append("infeasible: " + "; ".join(x["reasons"])[:60])
        lines.append(f"{x['id']:<4} {x['model']:<13} {x['gpus']:<12} {x['tp']:>2} {x['weights'] + '/' + x['kv']:<9} "
                     f"{str(x['prompt_len']) + '/' + str(x['output_len']):>10} {('c' + str(x['concurrency'])) if x['concurrency'] else x['batch']:>5} {x['metric']:<12} "
                     f"{_fmt(x['metric'], x['published']):>11} {_fmt(x['metric'], x['predicted']):>11} {err:>8}  "
                     f"{', '.join(note)}")
    lines.append("")
    lines.append("MAPE by metric (rows marked in_mape): " + ", ".join(
        f"{m} {v['mape']:.0%} ({v['rows']})" for m, v in result["mape"].items()))
    lines.append("MAPE by target (issue 24: TTFT, TPOT and throughput <= 20% each): " + ", ".join(
        f"{m} {v['mape']:.0%} ({v['rows']})" for m, v in result["groups"].items()))
    if "TTFT" in result["groups"]:
        g = result["groups"]["TTFT"]
        lines.append(f"TTFT MAPE {g['mape']:.0%} by row (largest |error| first; share of the summed |error|, "
                     f"running): " + ", ".join(f"{x['id']} {x['error']:+.0%} {x['share']:.0%} ({x['cumulative']:.0%})"
                                              for x in g["by_row"]))
    lines.append("every row is a validation row: nothing is fitted to them (the serving model's measured inputs "
                 "are vidur's kernel timings and the Marlin figure)")
    lines.append("serving factors used: " + "; ".join(
        f"{gpu}: " + ", ".join(f"{k}={v:g}" for k, v in f.items()) for gpu, f in result["serve_factors"].items()))
    if result["implied_decode_bw_efficiency"]:
        lines.append("decode_bw_efficiency the batch-1 decode rows imply (no step overhead): " + ", ".join(
            f"{k} {v:.2f}" for k, v in result["implied_decode_bw_efficiency"].items()))
    return "\n".join(lines)


def parse_factors(items: Sequence[str]) -> dict[str, float]:
    _serve()
    from planner.serve.factors import SERVE_DEFAULTS
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        name = name.strip()
        known = (*SERVE_DEFAULTS, "serve_request_overhead_s")
        if name not in known:
            raise SpecError("--factor", f"unknown serving factor {name!r}", f"use one of {', '.join(known)}")
        try:
            v = float(value)
        except ValueError:
            raise SpecError("--factor", f"{item!r} has no number",
                            "write NAME=VALUE, e.g. decode_bw_efficiency=0.7") from None
        if not v >= 0 or v != v or v == float("inf") or (v == 0 and not name.endswith("overhead_s")):
            raise SpecError("--factor", f"{name} must be a positive finite number, got {value!r}", "e.g. 0.7")
        out[name] = v
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the comparison as JSON")
    ap.add_argument("--rows", default="", help="comma-separated row ids (default: all)")
    ap.add_argument("--data", default=str(DATA), help="rows file (default: %(default)s)")
    ap.add_argument("--scheduler", choices=SCHEDULERS, default=None,
                    help="predict every closed-loop row under this vLLM scheduler (a what-if; default: each "
                         "row's own, V1 unless the row says otherwise)")
    ap.add_argument("--factor", action="append", default=[], metavar="NAME=VALUE",
                    help="set a serving factor for every GPU (e.g. decode_bw_efficiency=0.7); repeatable")
    args = ap.parse_args(argv)
    try:
        rows = load_rows(Path(args.data), [s.strip() for s in args.rows.split(",") if s.strip()] or None)
        rows = with_serve_factors(rows, parse_factors(args.factor))
        if args.scheduler:
            rows = [dataclasses.replace(r, scheduler=args.scheduler) if r.concurrency else r for r in rows]
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (OSError, json.JSONDecodeError) as exc:
        print(f"error: --data: cannot read {args.data}: {exc}", file=sys.stderr)
        return 2
    result = compare(rows)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(table(result))
    atomic_write_json(OUT, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
