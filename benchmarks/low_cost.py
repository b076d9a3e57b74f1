"""The low-cost questions of the source article, answered by the search (issue 9, point 4).

For each scenario: the plan the exhaustive search picks (over every layout, ZeRO stage and
DeepSpeed variant: offload, ZeRO++, MiCS, bucket sizes), its predicted throughput, the days
400 billion tokens would take at that rate, and its memory per GPU, per host (offloaded
states of the node's ranks) and on NVMe. When nothing fits, one line says what is missing:
the host memory (or NVMe) the least demanding offload plan would need. Figures are the cost
model's predictions with the profiles' factors (fitted on DeepSpeed's published runs where
the generation has them: benchmarks/ds_reference.py); nothing is asserted.

    .venv/bin/python benchmarks/low_cost.py [--json]

Assumptions (the article states none of these): global batch 1024 sequences of 2048 tokens
(1024 for GLM-10B, its maximum), bf16 (fp16 on GPUs without bf16), the profiles' host side
(profiles/*.json "host"; a 4-GPU node is the profile's 8-GPU server scaled by half).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.errors import SpecError  # noqa: E402
from planner.search import Evaluator, Space, rank  # noqa: E402
from planner.search.exhaustive import exhaustive  # noqa: E402
from planner.specs import TrainSpec, parse_cluster, preset  # noqa: E402
from planner.specs.estimate import GB  # noqa: E402

TOKENS = 400e9
"""GLM-130B's training run: 400 billion tokens (Zeng et al. 2022, sec. 1)."""


def one_trillion():
    """A 1T-parameter GLM: GLM-130B's architecture at the width and depth of DeepSpeed's 1T
    configuration (128 layers, hidden 25600, 160 heads; reference/deepspeed-at-scale.md B)."""
    base = preset("glm-130b")
    return dataclasses.replace(base, name="glm-1t", hidden=25600, layers=128, heads=160,
                               ffn_hidden=base.ffn_hidden * 25600 // base.hidden)


SCENARIOS = (
    ("GLM-130B on 4xA6000 (the article's small team)", lambda: preset("glm-130b"), "4xA6000", 1024, 2048),
    ("GLM-130B on 4x8xA100 (the article's 32 A100s)", lambda: preset("glm-130b"), "4x8xA100", 1024, 2048),
    ("1T parameters on 8xA100 (the article's claim)", one_trillion, "8xA100", 1024, 2048),
    ("GLM-10B on 16x8xA100-40GB (ZeRO-3 vs PP/TP across nodes)", lambda: preset("glm-10b"), "16x8xA100-40GB", 1024,
     1024),
)


def search(model, gpus: str, batch: int, seq: int):
    """(cluster, every trial, the feasible ones fastest first) of the exhaustive search for one
    scenario (also benchmarks/cost_questions.py's)."""
    cluster = parse_cluster(gpus)
    prec = "bf16" if cluster.device.supports("bf16") else "fp16"
    train = TrainSpec(global_batch=batch, seq_len=seq, precision=prec)
    trials = exhaustive(Space(model=model, cluster=cluster, train=train), Evaluator(model, cluster, train))
    return cluster, trials, rank(trials)


def scenario(title: str, model, gpus: str, batch: int, seq: int) -> dict:
    t0 = time.perf_counter()
    cluster, trials, ranked = search(model, gpus, batch, seq)
    out = {"scenario": title, "gpus": gpus, "model": model.name, "params_b": model.params / 1e9,
           "global_batch": batch, "seq_len": seq, "plans": len(trials), "seconds": time.perf_counter() - t0,
           "host": dataclasses.asdict(cluster.host)}
    if ranked:
        best = ranked[0]
        e = best.estimate
        out.update(plan=best.plan.describe(), tokens_per_s=e.tokens_per_s, days_400b=TOKENS / e.tokens_per_s / 86400,
                   mfu=e.mfu, step_s=e.step_time_s, gpu_gb=e.peak_memory_gb, capacity_gb=e.capacity_bytes / GB,
                   host_gb_per_node=e.host_memory_bytes * cluster.gpus_per_node / GB,
                   nvme_gb_per_node=e.nvme_bytes * cluster.gpus_per_node / GB, near_limit=e.near_limit,
                   breakdown={k: round(v, 4) for k, v in e.time.to_dict().items()})
        # the best plan without any offload, for comparison
        plain = [t for t in ranked if t.plan.offload_optimizer == "none" and t.plan.offload_params == "none"]
        if plain and plain[0] is not best:
            out["best_without_offload"] = {"plan": plain[0].plan.describe(), "tokens_per_s": plain[0].tokens_per_s}
        return out
    out["missing"] = missing(cluster, trials)
    return out


def missing(cluster, trials) -> str:
    """One line when nothing fits: the host memory (or NVMe) the least demanding offload plan
    would need, else the least memory any plan needs per GPU."""
    def short_only(t, what: str) -> bool:
        return bool(t.estimate and t.reason) and all(what in r for r in t.reason.split("; "))
    parts = []
    host_short = [t for t in trials if short_only(t, "host memory")]
    if host_short:
        need = min(t.estimate.host_memory_bytes * cluster.gpus_per_node for t in host_short)
        parts.append(f"the least host memory an offload plan needs is {need / GB:,.0f} GB per node (this node has "
                     f"{cluster.host.cpu_memory_gb:,.0f} GB): pass --cpu-mem-gb")
    nvme_short = [t for t in trials if short_only(t, "of NVMe per node")]
    if nvme_short:
        need = min(t.estimate.nvme_bytes * cluster.gpus_per_node for t in nvme_short)
        parts.append(f"the least NVMe an NVMe-offload plan needs is {need / GB:,.0f} GB per node (this node has "
                     f"{cluster.host.nvme_gb:,.0f} GB, host.nvme_gb of profiles/{cluster.device.name}.json): pass "
                     "--nvme-gb")
    elif host_short and not cluster.host.nvme_gbps:
        parts[-1] += ", or --nvme-gbps for a node with NVMe"
    if parts:
        return "does not fit: " + "; ".join(parts)
    least = min(trials, key=lambda t: t.needs_bytes)
    return (f"does not fit: the least memory any plan needs is {least.needs_bytes / GB:.1f} GB per GPU "
            f"> {least.capacity_bytes / GB:.0f} GB ({least.plan.describe()})")


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    for title, model, gpus, batch, seq in SCENARIOS:
        try:
            rows.append(scenario(title, model(), gpus, batch, seq))
        except SpecError as exc:
            rows.append({"scenario": title, "gpus": gpus, "missing": exc.line()})
    if args.json:
        print(json.dumps(rows, indent=1))
        return rows
    for r in rows:
        print(f"\n{r['scenario']}  [{r.get('model', '')}, {r.get('params_b', 0):.0f}B parameters, "
              f"global batch {r.get('global_batch')} x {r.get('seq_len')} tokens; {r.get('plans', 0)} plans in "
              f"{r.get('seconds', 0):.1f} s]")
        if "missing" in r:
            print(f"  {r['missing']}")
            continue
        print(f"  plan: {r['plan']}")
        print(f"  {r['tokens_per_s']:,.0f} tokens/s ({r['step_s']:.2f} s/step, MFU {r['mfu']:.1%}); "
              f"400B tokens in {r['days_400b']:,.1f} days")
        flag = "  NEAR THE LIMIT" if r["near_limit"] else ""
        print(f"  memory: {r['gpu_gb']:.1f} of {r['capacity_gb']:.0f} GB per GPU{flag}; host "
              f"{r['host_gb_per_node']:,.0f} of {r['host']['cpu_memory_gb']:,.0f} GB per node; NVMe "
              f"{r['nvme_gb_per_node']:,.0f} GB per node")
        print("  step: " + ", ".join(f"{k} {v:.3g} s" for k, v in r["breakdown"].items() if v))
        if "best_without_offload" in r:
            b = r["best_without_offload"]
            print(f"  best without offload: {b['tokens_per_s']:,.0f} tokens/s, {b['plan']}")
    return rows


if __name__ == "__main__":
    main()
