"""AutoGLM's serving question, answered with the serving cost model: for ChatGLM3-6B and
GLM-4-9B on one A100, what each technique buys in latency, memory and QPS, and which workload
could show 620 -> 210 ms average latency and 85 -> 290 QPS.

Rungs (each adds one technique to the one before, vLLM V1 on 1xA100-80GB):
  0 one request at a time      bf16, --max-num-seqs 1
  1 continuous batching        --max-num-seqs 256, whole prompts (--max-num-batched-tokens 8192)
  2 chunked prefill            --max-num-batched-tokens 512: prompts cut beside the decodes
  3 int8 weights (GPTQ-Marlin) weight-only, 1 byte per weight
  4 int4 weights (AWQ-Marlin)  weight-only, 0.5 byte per weight
  + KV fp8 and TP 2: not on one A100 (no FP8; one GPU): printed as such, TP 2 on 2xA100 beside.
For each rung: latency alone (one request, no load), mean end-to-end latency at a fixed offered
rate (--rate), the most requests/s it sustains (saturation, all requests queued), the QPS at
which its median end-to-end latency stays under --target-ms, and the memory per GPU its
requests use at the fixed rate (weights, activations, runtime and the KV blocks in use; vLLM
preallocates 90% of the GPU whatever the load).

Then a workload search over prompt x output lengths: the pair whose rung-0 (and rung-1) -> rung-4 change
comes closest (in log ratio) to the article's 620 -> 210 ms and 85 -> 290 QPS. A what-if: the
article does not state its workload, model or engine (docs/serving-reference.md rows A1-A3).

    .venv/bin/python benchmarks/serve_ladder.py [--model chatglm3-6b] [--rate 4] [--target-ms 1000]
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.serve.estimate import estimate_serving  # noqa: E402
from planner.serve.spec import Deployment, Target, Workload  # noqa: E402
from planner.specs import parse_cluster, preset  # noqa: E402

RUNGS = [("one request at a time", dict(max_batch=1, prefill_chunk=8192)),
         ("+ continuous batching (256 seqs)", dict(max_batch=256, prefill_chunk=8192)),
         ("+ chunked prefill (512 tokens/step)", dict(max_batch=256, prefill_chunk=512)),
         ("+ int8 weights (GPTQ-Marlin)", dict(max_batch=256, prefill_chunk=512, weight_precision="int8")),
         ("+ int4 weights (AWQ-Marlin)", dict(max_batch=256, prefill_chunk=512, weight_precision="int4"))]


def rung(model, cluster, dep: Deployment, w: Workload, rate: float, target_s: float, requests: int) -> dict:
    at = estimate_serving(model, cluster, dep, w, rate_qps=rate, requests=requests)
    tgt = estimate_serving(model, cluster, dep, w, target=Target(kind="p50", value=target_s), requests=requests)
    return {"alone_s": at.ttft_alone_s + (w.output_len - 1) * at.tpot_alone_s, "e2e_mean_s": at.e2e_mean_s,
            "e2e_p50_s": at.e2e_p50_s, "max_qps": at.max_qps, "qps_at_target": tgt.qps_at_target or 0.0,
            "memory_gib": at.memory_in_use_gb, "weights_gib": at.memory_gb["weights"], "overloaded": at.overloaded}


def ladder(model_name: str, prompt: int, output: int, rate: float, target_ms: float, requests: int) -> list[dict]:
    model, cluster = preset(model_name), parse_cluster("1xA100")
    w = Workload(prompt_len=prompt, output_len=output)
    rows = []
    for name, kw in RUNGS:
        rows.append({"rung": name, **rung(model, cluster, Deployment(**kw), w, rate, target_ms / 1e3, requests)})
    two = parse_cluster("2xA100")
    rows.append({"rung": "(TP 2 on 2xA100, for reference)",
                 **rung(model, two, Deployment(tp=2, max_batch=256, prefill_chunk=512, weight_precision="int4"), w,
                        rate, target_ms / 1e3, requests)})
    return rows


def print_ladder(model_name: str, prompt: int, output: int, rows: list[dict], rate: float, target_ms: float) -> None:
    print(f"\n{model_name} on 1xA100-80GB, vLLM V1, prompt {prompt} / output {output} tokens; latency at {rate:g} "
          f"requests/s, QPS at e2e p50 <= {target_ms:g} ms")
    print(f"{'rung':<38} {'alone ms':>9} {'mean e2e ms':>12} {'max QPS':>8} {'QPS@tgt':>8} {'mem GiB':>8} "
          f"{'weights':>8}")
    for r in rows:
        e2e = f"{r['e2e_mean_s'] * 1e3:,.0f}" + ("*" if r["overloaded"] else "")
        print(f"{r['rung']:<38} {r['alone_s'] * 1e3:>9,.0f} {e2e:>12} {r['max_qps']:>8.2f} {r['qps_at_target']:>8.2f} "
              f"{r['memory_gib']:>8.1f} {r['weights_gib']:>8.1f}")
    print("KV fp8: not on A100 (no FP8; vLLM has no int8 KV cache). * overloaded: the queue grows at that rate.")


def search(model_name: str, requests: int, frm: int = 0) -> dict:
    """The (prompt, output) of the grid whose rung `frm` -> rung 4 comes closest to 620 -> 210 ms
    (mean e2e at 80% of rung frm's saturation) and 85 -> 290 QPS (saturation), in summed squared
    log error."""
    model, cluster = preset(model_name), parse_cluster("1xA100")
    best = None
    for prompt in (16, 32, 64, 128, 256, 512):
        for output in (4, 8, 16, 32, 64):
            w = Workload(prompt_len=prompt, output_len=output)
            d0 = Deployment(**RUNGS[frm][1])
            d4 = Deployment(**RUNGS[-1][1])
            sat0 = estimate_serving(model, cluster, d0, w, requests=requests).max_qps
            a = estimate_serving(model, cluster, d0, w, rate_qps=0.8 * sat0, requests=requests)
            sat4 = estimate_serving(model, cluster, d4, w, requests=requests).max_qps
            b = estimate_serving(model, cluster, d4, w, rate_qps=0.8 * sat0, requests=requests)
            lat0, lat4 = a.e2e_mean_s, b.e2e_mean_s
            err = (math.log(lat0 / 0.62) ** 2 + math.log(lat4 / 0.21) ** 2 + math.log(sat0 / 85) ** 2
                   + math.log(sat4 / 290) ** 2)
            if best is None or err < best["err"]:
                best = {"err": err, "prompt": prompt, "output": output, "lat0": lat0, "lat4": lat4, "qps0": sat0,
                        "qps4": sat4, "rate": 0.8 * sat0}
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", default=None, help="preset (repeatable; default both)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--rate", type=float, default=4.0, help="offered requests/s for the latency column")
    ap.add_argument("--target-ms", type=float, default=10000.0, help="e2e p50 target for the QPS column")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--no-search", action="store_true", help="skip the workload search")
    args = ap.parse_args(argv)
    for m in args.model or ["chatglm3-6b", "glm-4-9b"]:
        rows = ladder(m, args.prompt, args.output, args.rate, args.target_ms, args.requests)
        print_ladder(m, args.prompt, args.output, rows, args.rate, args.target_ms)
        for frm in ([] if args.no_search else [0, 1]):
            b = search(m, args.requests, frm)
            print(f"closest workload to 620 -> 210 ms and 85 -> 290 QPS from rung {frm}: prompt {b['prompt']}, output "
                  f"{b['output']}: mean latency {b['lat0'] * 1e3:.0f} -> {b['lat4'] * 1e3:.0f} ms at {b['rate']:.0f} "
                  f"requests/s, saturation {b['qps0']:.0f} -> {b['qps4']:.0f} QPS (rung {frm} -> rung 4)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
