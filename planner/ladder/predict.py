"""The predicted ladder: from the conventional baseline to the chosen plan, one technique a rung.

Throughput is real (non-padding) tokens per second: the cost model's all-token tokens/s times
the real share of the rung's batching mode, measured on the document stream the executor
would read (planner.data.batching.padding_stats, the same as `planner verify`). Each rung's
gain is its real tokens/s over the previous legal rung's, so the gains multiply exactly to the
baseline-to-plan ratio (the ratio `planner verify` predicts); memory ratios multiply the same way.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from planner.cost import estimate
from planner.ladder import claims
from planner.ladder.techniques import LABELS, TECHNIQUES, Rung, compose, inert
from planner.search.baseline import TARGETS_SOURCE, baseline_train, conventional_baseline
from planner.specs.cluster import ClusterSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import Plan
from planner.specs.train import TrainSpec
from planner.specs.validate import plan_problems, runtime_problems

PADDING_ROWS = 4096
"""Rows (sequences) the padding share of each batching mode is counted over, at most."""


def padding_shares(model: ModelSpec, train: TrainSpec, rows: int, *, seed: int = 1234, data: str = "",
                   tokenizer: str = "") -> dict[str, float]:
    """Real-token share of each batching mode over the first `rows` rows of the document
    stream (synthetic corpus of `seed`, or the --data corpus): static pads one document chunk
    per row; dynamic packs chunks into rows."""
    from planner.data.batching import BATCHING, Layout, Rows, padding_stats  # numpy only, no torch
    from planner.data.corpus import DataSpec
    spec = DataSpec(seq_len=train.seq_len, vocab=model.vocab, seed=seed, token_file=data, tokenizer=tokenizer)
    out = {}
    for mode in BATCHING:
        real, pad = padding_stats(Rows(spec, mode), Layout(1, 1, rows), 1)
        out[mode] = real / (real + pad)
    return out


def _record(index: int, rung: Rung, technique: str, model: ModelSpec, cluster: ClusterSpec, train: TrainSpec,
            shares: dict[str, float]) -> dict[str, Any]:
    rec: dict[str, Any] = {"index": index, "technique": technique, "label": LABELS.get(technique, "baseline"),
                           "batching": rung.batching, "global_batch": rung.global_batch,
                           "applied": [t for t in TECHNIQUES if t in rung.applied]}
    if rung.plan is None:
        rec["illegal"] = rung.illegal
        return rec
    plan = rung.plan
    problems = plan_problems(model, cluster, _train(train, rung), plan)
    if problems:
        rec["illegal"] = problems[0].line
        return rec
    est = estimate(model, cluster, _train(train, rung), plan)
    rec.update(plan=plan.to_dict(), description=plan.describe(), **claims.summary(est))
    rec["runtime_note"] = "; ".join(p.line for p in runtime_problems(plan))
    rec["tokens_per_step"] = rung.global_batch * train.seq_len
    rec["tokens_per_s_all"] = est.tokens_per_s
    rec["real_share"] = shares[rung.batching]
    rec["padding_share"] = 1.0 - shares[rung.batching]
    rec["tokens_per_s"] = est.tokens_per_s * shares[rung.batching]
    return rec


def _train(train: TrainSpec, rung: Rung) -> TrainSpec:
    assert rung.plan is not None
    return dataclasses.replace(train, global_batch=rung.global_batch, precision=rung.plan.precision)


def build(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, plan: Plan, *,
          order: tuple[str, ...] = TECHNIQUES, each_alone: bool = False, shares: dict[str, float] | None = None,
          seed: int = 1234, data: str = "", tokenizer: str = "") -> dict[str, Any]:
    """The ladder of `plan` as a JSON-ready dict: rungs (legal ones with their estimate and
    gain over the previous legal rung; illegal ones with the reason, skipped), the techniques
    the plan does not use, the baseline-to-plan ratios and, with `each_alone`, every
    technique applied alone to the baseline."""
    base, _ = conventional_baseline(model, cluster, train, precision="fp32")
    btrain = baseline_train(cluster, train)
    world = cluster.world_size
    if shares is None:
        shares = padding_shares(model, train, min(PADDING_ROWS, btrain.global_batch * 12), seed=seed, data=data,
                                tokenizer=tokenizer)

    def rung_of(applied: frozenset[str]) -> Rung:
        return compose(plan, base, applied, world=world, base_batch=btrain.global_batch,
                       user_batch=train.global_batch)

    applied: frozenset[str] = frozenset()
    rungs = [_record(0, rung_of(applied), "baseline", model, cluster, train, shares)]
    unchanged = []
    for t in order:
        nxt = applied | {t}
        if rung_of(nxt).same(rung_of(applied)):
            unchanged.append({"technique": t, "label": LABELS[t], "why": _why_unchanged(t, plan)})
            continue
        applied = nxt
        rungs.append(_record(len(rungs), rung_of(applied), t, model, cluster, train, shares))
    _chain(rungs, plan)
    legal = [r for r in rungs if "illegal" not in r]
    first, last = legal[0], legal[-1]
    out: dict[str, Any] = {
        "version": 1, "order": list(order), "plan": plan.to_dict(), "description": plan.describe(),
        "baseline_source": TARGETS_SOURCE, "claims_source": claims.SOURCE,
        "padding": {"real_share": shares, "rows": min(PADDING_ROWS, btrain.global_batch * 12), "seed": seed,
                    "corpus": data or "synthetic"},
        "rungs": rungs, "unchanged": unchanged,
        "ratio": {"throughput": last["tokens_per_s"] / first["tokens_per_s"],
                  "memory": last["peak_memory_gb"] / first["peak_memory_gb"]},
        "reaches_plan": last.get("plan") == plan.to_dict(),
    }
    if each_alone:
        out["alone"] = _alone(plan, order, rung_of, model, cluster, train, shares, first)
    return out


def _why_unchanged(t: str, plan: Plan) -> str:
    return {"precision": f"the plan trains in {plan.precision}, as the baseline",
            "overlap": "the plan keeps overlap_comm off and the default buckets",
            "batching": "(never: the plan always runs packed batches)",
            "zero": "the plan uses ZeRO-0, as the baseline",
            "recompute": "the plan checkpoints nothing and keeps the baseline's micro-batch",
            "layout": "the plan is plain DP over every device, as the baseline"}[t]


def _chain(rungs: list[dict[str, Any]], plan: Plan) -> None:
    """Gain of each legal rung over the previous legal one; `adds` names the techniques it
    brings (an illegal rung's technique arrives with the next legal rung); the article's
    figure beside ours."""
    prev = None
    pending: list[str] = []
    for r in rungs:
        if r["technique"] != "baseline":
            pending.append(r["technique"])
        if "illegal" in r:
            continue
        if prev is not None:
            r["adds"] = list(pending)
            r["gain"] = r["tokens_per_s"] / prev["tokens_per_s"]
            r["memory_ratio"] = r["peak_memory_gb"] / prev["peak_memory_gb"]
            r["claim"] = claims.ours(r["technique"], prev, r)
            r["inert"] = inert(r["technique"], Plan.from_dict(r["plan"])) if len(pending) == 1 else ""
        pending = []
        prev = r


def _alone(plan: Plan, order, rung_of, model, cluster, train, shares, first) -> list[dict[str, Any]]:
    out = []
    empty = rung_of(frozenset())
    for t in order:
        r = rung_of(frozenset({t}))
        if r.same(empty):
            continue
        rec = _record(0, r, t, model, cluster, train, shares)
        if "illegal" not in rec:
            rec["gain"] = rec["tokens_per_s"] / first["tokens_per_s"]
            rec["memory_ratio"] = rec["peak_memory_gb"] / first["peak_memory_gb"]
            rec["claim"] = claims.ours(t, first, rec)
        out.append(rec)
    return out
