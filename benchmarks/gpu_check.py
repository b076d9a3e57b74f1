"""The GPU check (issue 20, point 5): on one H200/H100, within 8 minutes, profile the GPU, plan a
1-3B GLM for it, run the conventional baseline and the plan for real, and print what was
measured beside what was predicted.

    .venv/bin/python benchmarks/gpu_check.py                 # one GPU (H200 or H100)
    .venv/bin/python benchmarks/gpu_check.py --dry-run       # every part on this CPU, tiny model

1. `planner profile --quick --procs 1` on the GPU: GEMMs of the model's shapes (bf16 and fp32),
   square GEMMs, the block (attention included) at a few points, HBM bandwidth (tensor copy);
   one GPU, so no collectives. The Adam step is timed by the executor's runs themselves
   (step time minus nothing: it is inside the measured step) -- the profile has no probe of it.
2. `planner search` of MODEL (a ChatGLM3-family config of ~1.5B parameters: hidden 2048, 24
   layers, GQA 16/2, SwiGLU 5632, vocab 65024) on 1x<GPU> with that profile, global batch 16,
   sequence 2048;
3. `planner verify` of the run directory: the fp32 baseline (plain, padded static batches, the
   largest micro-batch that fits) and the plan (bf16, packed batches, recompute where the search
   says it pays), back to back;
4. prints measured vs predicted step time of each run, torch.cuda.max_memory_allocated vs the
   predicted allocated peak, the throughput and memory ratios, and the 3x / one-third verdict,
   plus the wall time of each phase against the 8-minute budget.

--dry-run runs the same four phases on this CPU with chatglm3-6b --scale tiny on 1xcpu, so that
everything but the GPU itself is exercised (tests/integration/test_gpu_check.py).
No GPU was lent to the session that wrote this script: it has been dry-run only.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PLANNER = [sys.executable, "-c", "from planner.cli import entry; entry()"]
BUDGET_S = 480.0
MODEL = {  # a ~1.5B ChatGLM3-family model (planner/specs/hf.py _chatglm reads these keys)
    "model_type": "chatglm", "hidden_size": 2048, "num_layers": 24, "num_attention_heads": 16,
    "multi_query_attention": True, "multi_query_group_num": 2, "ffn_hidden_size": 5632,
    "padded_vocab_size": 65024, "seq_length": 4096, "add_qkv_bias": True, "add_bias_linear": False,
    "rmsnorm": True, "kv_channels": 128, "layernorm_epsilon": 1e-5,
}


def _run(args: list[str], log: Path) -> str:
    p = subprocess.run(PLANNER + args, capture_output=True, text=True)
    log.write_text((p.stdout or "") + (p.stderr or ""))
    if p.returncode:
        tail = ((p.stderr or "") + (p.stdout or "")).strip().splitlines()[-3:]
        raise SystemExit(f"planner {args[0]} failed ({p.returncode}), see {log}: {' | '.join(tail)}")
    return p.stdout or ""


def gpu_name() -> str:
    """H200 or H100-SXM from torch.cuda's device name (the built-in profiles' names)."""
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run on a CPU machine")
    name = torch.cuda.get_device_name(0)
    if "H200" in name:
        return "H200"
    if "H100" in name:
        return "H100-SXM"
    raise SystemExit(f"{name}: this check is sized for one H200 or H100 (the built-in profiles H200, H100-SXM)")


def verdict_lines(v: dict) -> list[str]:
    """What the check prints from verify.json: per run measured vs predicted, then the ratios."""
    out = []
    for key in ("baseline", "planned"):
        m = v[key]
        pr = m.get("predicted") or {}
        desc = m["plan"]
        out.append(f"{key:<8}: {desc['precision']} ZeRO-{desc['zero']} micro-batch {desc['micro_batch']} x "
                   f"{desc['grad_accum']} recompute {desc['recompute']}: step {m['step_time_s']:.3f} s measured, "
                   f"{pr.get('step_time_s') or float('nan'):.3f} s predicted; allocated peak "
                   f"{m.get('allocated_peak_gb') or float('nan'):.2f} GB measured "
                   f"({m.get('allocated_method') or 'n/a'}), {pr.get('allocated_peak_gb') or float('nan'):.2f} GB "
                   "predicted")
    me, pr = v["measured"], v["predicted"]
    out.append(f"throughput ratio {me['throughput_ratio']:.2f}x measured, {pr['throughput_ratio']:.2f}x predicted: "
               f"3x {'MET' if v['met']['throughput_ratio'] else 'NOT MET'}")
    mr, pm = me.get("memory_ratio"), pr.get("memory_ratio")
    out.append(f"allocated-memory ratio {mr if mr is not None else float('nan'):.2f}x measured, "
               f"{pm if pm is not None else float('nan'):.2f}x predicted: one-third less "
               f"{'MET' if v['met']['memory_reduction'] else 'NOT MET'}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="every phase on this CPU, tiny model, 1xcpu")
    ap.add_argument("--out-dir", type=Path, default=Path("reports/gpu-check"))
    ap.add_argument("--steps", type=int, default=None, help="verify's baseline steps (default 8; dry run 4)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    out = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    phases: list[tuple[str, float]] = []

    def phase(name: str, start: float) -> None:
        phases.append((name, time.perf_counter() - start))
        print(f"[{time.perf_counter() - t0:6.1f} s] {name} done in {phases[-1][1]:.1f} s", flush=True)

    if args.dry_run:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        gpus, model_args, steps = "1xcpu", ["--model", "chatglm3-6b", "--scale", "tiny"], args.steps or 4
        prof_args = ["--cpu", "--model", "chatglm3-6b", "--scale", "tiny"]
        train_args = ["--global-batch", "4", "--seq-len", "128"]
    else:
        kind = gpu_name()
        cfg = out / "glm-1.5b.json"
        cfg.write_text(json.dumps(MODEL, indent=1))
        gpus, model_args, steps = f"1x{kind}", ["--model", str(cfg)], args.steps or 8
        prof_args = ["--model", str(cfg)]
        train_args = ["--global-batch", "16", "--seq-len", "2048"]
    profile = out / "profile.json"
    s = time.perf_counter()
    _run(["profile", "--quick", "--procs", "1", "--out", str(profile)] + prof_args, out / "profile.log")
    phase("profile (GEMMs, block with attention, memory bandwidth)", s)
    s = time.perf_counter()
    _run(["search"] + model_args + ["--gpus", gpus, "--profile", str(profile), "--out-dir", str(out),
                                    "--name", "plan"] + train_args, out / "search.log")
    phase("search", s)
    s = time.perf_counter()
    _run(["verify", str(out / "plan"), "--steps", str(steps), "--warmup", "2"], out / "verify.log")
    phase("verify (baseline and plan, for real)", s)
    v = json.loads((out / "plan" / "verify.json").read_text())
    print()
    for line in verdict_lines(v):
        print(line)
    total = time.perf_counter() - t0
    print(f"total {total:.0f} s of the {BUDGET_S:.0f} s budget: "
          + ("within" if total <= BUDGET_S else "OVER") + "; " + ", ".join(f"{n.split(' ')[0]} {t:.0f} s"
                                                                            for n, t in phases))
    print(f"files: {out} (profile.json, plan/verify.json, *.log)" + (" -- dry run on CPU" if args.dry_run else ""))
    return 0 if total <= BUDGET_S or args.dry_run else 1


if __name__ == "__main__":
    sys.exit(main())
