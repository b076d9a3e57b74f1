"""Context parallelism against the published NeMo long-sequence rows (S7 of
/work/shared/reference/modern-runs.md: LLAMA2-7B on H100, Megatron-Core with ring context
parallelism, 4,096 to 1,048,576 tokens at about 4M tokens per step).

For each row the planner estimates the published layout on the megatron-core runtime in fp8
(TP with sequence parallelism, PP, CP as ring, DP, distributed optimizer, micro-batch 1, the
published global batch; full recompute where nothing else fits) and prints its TFLOP/s per GPU
next to the published one, and the trend over sequence length (each row over the 4k row;
published 768 -> 536 TFLOP/s, 0.70x at 1M tokens). The runtime's compute_scale was fitted on
the S7 rows without context parallelism (S7-1..S7-3, profiles/runtimes/megatron-core.json);
nothing is fitted on the context-parallel rows (S7-4..S7-9).

    .venv/bin/python benchmarks/context_parallel_published.py
"""
from __future__ import annotations

from planner.cost import estimate
from planner.specs import Plan, TrainSpec, parse_cluster
from planner.specs.model import ModelSpec

# Llama-2-7B (Touvron et al. 2023, arXiv 2307.09288, Table 1; the HF config of meta-llama/Llama-2-7b-hf)
LLAMA2_7B = ModelSpec(name="llama2-7b", model_type="llama", hidden=4096, layers=32, heads=32, ffn_hidden=11008,
                      activation="swiglu", vocab=32000, max_seq=1048576, norm="rmsnorm", position="rotary",
                      qkv_bias=False, linear_bias=False, rotary_fraction=1.0, rope_interleaved=False)
# S7-1..S7-9: (id, seq, global batch, TP, PP, CP, DP, published TFLOP/s per GPU with CP)
ROWS = (("S7-1", 4096, 1024, 1, 1, 1, 4, 768), ("S7-2", 8192, 512, 1, 2, 1, 4, 730),
        ("S7-3", 16384, 256, 2, 1, 1, 8, 660), ("S7-4", 32768, 128, 2, 1, 2, 8, 610),
        ("S7-5", 65536, 64, 4, 1, 2, 8, 574), ("S7-6", 131072, 32, 4, 1, 4, 8, 555),
        ("S7-7", 262144, 16, 4, 1, 8, 8, 549), ("S7-8", 524288, 8, 8, 1, 16, 4, 549),
        ("S7-9", 1048576, 4, 8, 1, 32, 4, 536))


def predict(seq: int, batch: int, tp: int, pp: int, cp: int, dp: int):
    """The published layout's estimate: no recompute if it fits, else full recompute."""
    cluster = parse_cluster(f"{max(1, tp * pp * cp * dp // 8)}x{min(8, tp * pp * cp * dp)}xH100")
    train = TrainSpec(global_batch=batch, seq_len=seq, precision="fp8")
    est = None
    for rc in ("none", "full"):
        plan = Plan(dp=dp, tp=tp, pp=pp, cp=cp, cp_kind="ring", zero=1, micro_batch=1, grad_accum=batch // dp,
                    recompute=rc, sequence_parallel=tp > 1, precision="fp8", runtime="megatron-core")
        est = estimate(LLAMA2_7B, cluster, train, plan)
        if est.feasible:
            return rc, est
    return "full", est


def main() -> None:
    print(f"{'row':6s} {'seq':>8s} {'layout':22s} {'pub TFLOP/s':>11s} {'pred':>6s} {'pred/pub':>8s} {'pub/4k':>7s} "
          f"{'pred/4k':>7s}  recompute  fits")
    base = None
    for rid, seq, batch, tp, pp, cp, dp, pub in ROWS:
        rc, est = predict(seq, batch, tp, pp, cp, dp)
        pred = est.tflops_per_gpu
        base = base or (pub, pred)
        print(f"{rid:6s} {seq:8d} {f'TP{tp} PP{pp} CP{cp} DP{dp}':22s} {pub:11.0f} {pred:6.0f} {pred / pub:8.2f} "
              f"{pub / base[0]:7.2f} "
              f"{pred / base[1]:7.2f}  {rc:9s}  {'yes' if est.feasible else '; '.join(est.reasons)[:60]}")


if __name__ == "__main__":
    main()
