"""The model-variant what-ifs measured on this machine, beside the cost model's predicted effect.

For each variant of ChatGLM3 small (--variant: linear-attention, ffn-sparsity=0.5,
share-layers=2) and the base model, on this CPU:

- training: the executor trains the same plan (DP 2, ZeRO-0, bf16, micro-batch 2 x 2, seq
  SEQ; planner.runtime.train.launch.run_plan, STEPS steps after a warm-up) and reports its step
  time, peak memory and counted model states per rank; beside each, planner.cost.estimate for
  `2xcpu`. Printed: each figure's ratio to the base run, measured and predicted.
- serving: the generation loop (planner.runtime.serve.run.run_serving: KV cache, or linear
  attention's fixed state; TP 1, max batch 4, Poisson arrivals) serves the same requests for
  each model; the serving cost model predicts TTFT and TPOT at the same rate (queue.simulate)
  with its factors fitted (planner/serve/calibrate.py) on the BASE model's runs only (this one,
  one with short prompts and one of the tiny base model: see calibration_runs), so each
  variant's prediction is held out and what is compared is the variant's effect. Printed: the
  measured and predicted times and their ratios to the base.

    flock /tmp/planner-cpu.lock .venv/bin/python benchmarks/variants_measure.py [--out reports/variants_measure]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner import dsconfig  # noqa: E402
from planner.cli.common import apply_variants  # noqa: E402
from planner.rundir import atomic_write_json, plan_document  # noqa: E402
from planner.specs import Plan, TrainSpec, parse_cluster, preset, scale  # noqa: E402

VARIANTS = {"base": (), "linear-attention": ("linear-attention",), "ffn-sparsity=0.5": ("ffn-sparsity=0.5",),
            "share-layers=2": ("share-layers=2",)}
SIZE = "small"
SEQ, STEPS = 256, 6
PLAN = Plan(dp=2, zero=0, micro_batch=2, grad_accum=2, precision="bf16", bucket_elements=50_000_000)
# serving: prompts long enough that reading the KV cache shows beside the weights
WORKLOAD = dict(prompt_len=384, output_len=32, prompt_sigma=0.2, output_sigma=0.2, seed=0)
RATE, REQUESTS, MAX_BATCH = 2.0, 16, 4
TINY_WORKLOAD = dict(prompt_len=160, output_len=32, prompt_sigma=0.2, output_sigma=0.2, seed=0)
SHORT_WORKLOAD = dict(prompt_len=48, output_len=32, prompt_sigma=0.2, output_sigma=0.2, seed=0)
GB = 1e9


def train_row(root: Path, name: str) -> dict:
    from planner.cost import estimate
    from planner.runtime.train.launch import run_plan
    model = apply_variants(scale(preset("chatglm3-6b"), SIZE), VARIANTS[name])
    cluster = parse_cluster("2xcpu")
    train = TrainSpec(global_batch=PLAN.global_batch, seq_len=SEQ, precision="bf16")
    d = root / "train" / name
    atomic_write_json(d / "plan.json", plan_document(PLAN, model, cluster, train, scale=SIZE,
                                                      model_arg="chatglm3-6b"))
    atomic_write_json(d / "ds_config.json", dsconfig.ds_config(PLAN, model, train, cluster))
    t0 = time.perf_counter()
    m = run_plan(d, steps=STEPS, warmup=2, timeout=600)
    if m.get("status") != "ok":
        raise SystemExit(f"{name}: training failed: {m.get('error')}")
    est = estimate(model, cluster, train, PLAN)
    sm = est.stage_memory[est.peak_stage]
    print(f"trained {name}: {time.perf_counter() - t0:.0f} s, loss {m['loss'][0]:.3f} -> {m['loss'][-1]:.3f}",
          flush=True)
    return {"params": model.params,
            "measured": {"step_s": m["step_time_s"], "peak_gb": m["peak_memory_gb"],
                         "states_gb": max(m["model_state_gb_per_rank"])},
            "predicted": {"step_s": est.step_time_s, "peak_gb": est.peak_memory_gb,
                          "states_gb": (sm.params + sm.grads + sm.optimizer) / GB}}


def serve_run(root: Path, name: str) -> dict:
    from planner.runtime.serve.run import run_serving
    model = apply_variants(scale(preset("chatglm3-6b"), SIZE), VARIANTS[name])
    t0 = time.perf_counter()
    m = run_serving(model, tp=1, max_batch=MAX_BATCH, workload=WORKLOAD, rate_qps=RATE, requests=REQUESTS, seed=0,
                    timeout_s=300, precision="bf16", out_dir=root / "serve" / name, threads=1)
    print(f"served {name}: {time.perf_counter() - t0:.0f} s, TTFT {1e3 * m['ttft_s']['mean']:.1f} ms, "
          f"TPOT {1e3 * m['tpot_s']['mean']:.2f} ms", flush=True)
    return m


def calibration_runs(root: Path) -> list[dict]:
    """Two more runs of the base model, for the fit only: the small model with short prompts
    (with only long prompts a decode step's context grows with its batch, so the attention's
    cost per context token and the GEMMs' per row are one direction to the fit) and the tiny
    model (with one model size the weight read cannot be told from the fixed seconds per step,
    and decode_attention_scale stays unfitted: planner/serve/calibrate.py)."""
    from planner.runtime.serve.run import run_serving
    short = run_serving(scale(preset("chatglm3-6b"), SIZE), tp=1, max_batch=MAX_BATCH, workload=SHORT_WORKLOAD,
                        rate_qps=4 * RATE, requests=REQUESTS, seed=0, timeout_s=300, precision="bf16",
                        out_dir=root / "serve" / "base-short", threads=1)
    tiny = run_serving(scale(preset("chatglm3-6b"), "tiny"), tp=1, max_batch=MAX_BATCH, workload=TINY_WORKLOAD,
                       rate_qps=4 * RATE, requests=2 * REQUESTS, seed=0, timeout_s=300, precision="bf16",
                       out_dir=root / "serve" / "base-tiny", threads=1)
    return [short, tiny]


def serve_predict(m: dict, device) -> dict:
    from planner.serve import queue
    from planner.serve.cost import step_fns
    from planner.serve.factors import serve_factor
    from planner.serve.spec import Deployment, Workload
    from planner.specs.model import ModelSpec
    model = ModelSpec.from_dict(m["model"])
    dep = Deployment(tp=1, max_batch=MAX_BATCH)
    cluster = parse_cluster(f"1x{device.name}", device)
    prefill, decode = step_fns(model, cluster, dep)
    return queue.simulate(prefill, decode, Workload(**WORKLOAD), RATE, requests=REQUESTS, seed=0,
                          max_batch=MAX_BATCH, max_total=model.max_seq, wake_s=serve_factor(cluster, "serve_wake_s"),
                          engine="executor")


def _r(x: float, base: float) -> str:
    return f"{x / base:5.2f}x" if base else "  n/a"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="reports/variants_measure")
    p.add_argument("--no-train", action="store_true", help="serving only")
    args = p.parse_args(argv)
    out = Path(args.out)
    summary: dict = {"size": SIZE, "train": {}, "serve": {}}
    if not args.no_train:
        rows = {name: train_row(out, name) for name in VARIANTS}
        b = rows["base"]
        print(f"\ntraining chatglm3-6b-{SIZE}, {PLAN.describe()}, seq {SEQ}, 2 CPU processes: each figure and its "
              "ratio to the base, measured | predicted")
        print(f"{'variant':18} {'params':>11} {'step s':>22} {'peak GB':>22} {'model states GB':>24}")
        for name, r in rows.items():
            cells = []
            for k in ("step_s", "peak_gb", "states_gb"):
                me, pr = r["measured"][k], r["predicted"][k]
                cells.append(f"{me:6.3f} {_r(me, b['measured'][k])} | {_r(pr, b['predicted'][k])}")
            print(f"{name:18} {r['params']:11,} " + "  ".join(cells), flush=True)
        summary["train"] = rows
    import dataclasses as _dc

    from planner.serve.calibrate import fit_serving
    from planner.specs.hardware import find_device
    runs = {name: serve_run(out, name) for name in VARIANTS}
    fit_runs = [runs["base"], *calibration_runs(out)]
    device = find_device("cpu")[0]
    factors = fit_serving(fit_runs, device)
    device = _dc.replace(device, factors={**device.factors, **factors})
    print(f"\nserving chatglm3-6b-{SIZE}, TP 1, max batch {MAX_BATCH}, {REQUESTS} requests at {RATE:g}/s, prompt "
          f"{WORKLOAD['prompt_len']} / output {WORKLOAD['output_len']} tokens; serving factors fitted on the base "
          "model's runs only (small long and short prompts, tiny): measured / predicted, and each one's ratio to "
          "the base")
    print("factors: " + ", ".join(f"{k} {v:.4g}" for k, v in factors.items()))
    print(f"{'variant':18} {'TTFT ms':>34} {'TPOT ms':>34}")
    pred = {name: serve_predict(m, device) for name, m in runs.items()}
    mb, pb = runs["base"], pred["base"]
    for name, m in runs.items():
        cells = []
        for k in ("ttft_s", "tpot_s"):
            me, pr = m[k]["mean"], pred[name][k]["mean"]
            cells.append(f"{1e3 * me:7.2f} / {1e3 * pr:7.2f}  ({_r(me, mb[k]['mean'])} | {_r(pr, pb[k]['mean'])})")
        print(f"{name:18} " + "  ".join(cells), flush=True)
        summary["serve"][name] = {"measured": {k: m[k]["mean"] for k in ("ttft_s", "tpot_s")},
                                  "predicted": {k: pred[name][k]["mean"] for k in ("ttft_s", "tpot_s")}}
    summary["serve_factors"] = factors
    atomic_write_json(out / "summary.json", summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
