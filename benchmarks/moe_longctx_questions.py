"""The two questions users ask most (issue 22), answered by the exhaustive search:

1. How many nodes for GLM-4.5-Air (and GLM-4.5), with which expert-parallel size?
   GLM-4.5-Air on 4x8xH100 and on 8x8xA100-80GB; GLM-4.5 on 32x8xH100.
2. How do I fine-tune GLM-4-9B on 64k- and 128k-token sequences on one 8xA100-80GB node
   (a batch of 16 sequences)?

For each: the chosen plan with tokens/s, peak memory per GPU and days for a stated number of
tokens, and the runner-up that differs on a parallel axis (TP, PP, EP, CP degree or kind),
with the time or memory term it lost on. The inputs not given by the question are stated in
CASES (global batch and sequence of the MoE runs, the token budgets). DeepSpeed plans only
(ring attention and interleaving are evaluated but need --megatron-features). Everything
printed is the cost model's prediction, uncalibrated for these GPUs beyond the profiles.

    .venv/bin/python benchmarks/moe_longctx_questions.py
"""
from __future__ import annotations

import time

from planner.search import Evaluator, Space, rank
from planner.search.exhaustive import exhaustive
from planner.specs import TrainSpec, parse_cluster, preset
from planner.specs.validate import runtime_problems

AXES = ("tp", "pp", "ep", "cp", "cp_kind")
CASES = (
    # (question, model, cluster, global batch, sequence, tokens for "days")
    ("GLM-4.5-Air pre-training, 4 nodes", "glm-4.5-air", "4x8xH100", 1024, 4096, 100e9),
    ("GLM-4.5-Air pre-training, 8 A100 nodes", "glm-4.5-air", "8x8xA100-80GB", 1024, 4096, 100e9),
    ("GLM-4.5 pre-training, 32 nodes", "glm-4.5", "32x8xH100", 1024, 4096, 100e9),
    ("GLM-4-9B fine-tuning at 64k", "glm-4-9b", "8xA100-80GB", 16, 65536, 1e9),
    ("GLM-4-9B fine-tuning at 128k", "glm-4-9b", "8xA100-80GB", 16, 131072, 1e9),
)


def why_lost(best, other) -> str:
    """The time part where `other` loses most to `best` (or its memory, if that is all)."""
    a, b = best.estimate.time.to_dict(), other.estimate.time.to_dict()
    part = max(a, key=lambda k: b[k] - a[k])
    return (f"{part} {b[part]:.2f} s vs {a[part]:.2f} s per step "
            f"(step {other.estimate.step_time_s:.2f} s vs {best.estimate.step_time_s:.2f} s)")


def show(label: str, t, tokens: float) -> None:
    e = t.estimate
    days = tokens / e.tokens_per_s / 86400
    print(f"  {label}: {t.plan.describe()}")
    print(f"    {e.tokens_per_s:,.0f} tokens/s, MFU {e.mfu:.1%}, peak {e.peak_memory_gb:.1f} GB per GPU, "
          f"{days:.1f} days for {tokens / 1e9:g}B tokens")


def main() -> None:
    for question, name, gpus, batch, seq, tokens in CASES:
        model, cluster = preset(name), parse_cluster(gpus)
        train = TrainSpec(global_batch=batch, seq_len=seq)
        t0 = time.perf_counter()
        trials = exhaustive(Space(model=model, cluster=cluster, train=train), Evaluator(model, cluster, train))
        ranked = rank(trials)
        print(f"{question}: {name} on {gpus}, batch {batch} x {seq} tokens "
              f"({len(trials)} plans, {time.perf_counter() - t0:.1f} s)")
        if not ranked:
            mega = rank(exhaustive(Space(model=model, cluster=cluster, train=train, megatron_features=True),
                                   Evaluator(model, cluster, train, megatron_features=True)))
            least = min((t for t in trials if not runtime_problems(t.plan)), key=lambda t: t.needs_bytes)
            print(f"  no plan DeepSpeed runs fits: the leanest needs {least.needs_gb:.1f} GB per GPU "
                  f"({least.plan.describe()})")
            if mega:
                show("with --megatron-features (Megatron-Core only)", mega[0], tokens)
            continue
        best = ranked[0]
        show("chosen", best, tokens)
        key = tuple(getattr(best.plan, a) for a in AXES)
        other = next((t for t in ranked[1:] if tuple(getattr(t.plan, a) for a in AXES) != key), None)
        if other is None:
            print("  no feasible plan on a different parallel axis")
            continue
        diff = ", ".join(f"{a} {getattr(best.plan, a)} -> {getattr(other.plan, a)}" for a in AXES
                         if getattr(best.plan, a) != getattr(other.plan, a))
        show(f"runner-up ({diff})", other, tokens)
        print(f"    lost on {why_lost(best, other)}")


if __name__ == "__main__":
    main()
