"""Write each GPU profile's measured kernel curves ("kernels" in profiles/<gpu>.json) from
published measurements, and say for every number where it came from or how it was derived.

- GEMM ceiling and HBM efficiency, A100 and H100: microsoft/vidur's CUDA-event timings of every
  linear layer and element-wise op of eight models' blocks at 1-4,096 tokens and TP 1-8
  (data/profiling/compute/<gpu>/<model>/mlp.csv, MIT; fp16). The tile/wave model
  (planner.cost.compute.shape_time) is applied to every GEMM with M >= 512 tokens; the ceiling
  is the median of measured / (peak x wave_efficiency) over the large ones (M >= 2,048 and
  >= 1e11 FLOPs): a measurement with the tile and wave quantization taken out, no fit. The
  script prints how well the model then reproduces all of vidur's GEMMs. A sample of the points
  is kept in profiles/kernels/vidur-gemm.json for tests/unit/test_kernel_curves.py.
- Attention: profiles/kernels/attention-published.json (FlashAttention-2/-3 papers' figures).
- GPUs without a measurement (A100-40GB, H200, B200, A6000, L40S, RTX-4090, V100): derived from
  the measured generation and the spec sheet, and the profile's sources say "derived".

    .venv/bin/python benchmarks/kernel_curves.py [VIDUR_BARE_REPO]        # prints; --apply writes profiles/
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from serve_vidur_extract import _csv  # noqa: E402  (reads one CSV from the bare clone)

from planner.cost.compute import wave_efficiency  # noqa: E402
from planner.calibrate.accuracy import mape, rel_error  # noqa: E402
from planner.rundir import atomic_write_json, atomic_write_text  # noqa: E402
from planner.specs.hardware import PROFILES_DIR  # noqa: E402

VIDUR = {"a100": "A100-80GB", "h100": "H100-SXM"}
"""vidur's GPUs and the profiles they measure (the 80 GB SXM parts: serve_vidur_extract.py)."""
TILES = [[128, 256], [256, 128], [128, 128]]
"""CUTLASS's default SM80 tensor-op threadblock tile, 128 x 256 x 64, in both orientations
(include/cutlass/gemm/device/default_gemm_configuration.h, DefaultGemmConfiguration<OpClassTensorOp,
Sm80>), and 128 x 128, the tile NVIDIA's "Matrix Multiplication Background User's Guide" works its
quantization examples with; cuBLAS picks per shape. On vidur's A100 GEMMs the three together reproduce
the timings with 8.3% MAPE (a single 128 x 256 tile: 15.7%, no quantization: 7.5% but -32% at the
small end): printed by this script."""
SMS = {"A100-80GB": (108, "NVIDIA A100 Tensor Core GPU Architecture whitepaper: 108 SMs"),
       "A100-40GB": (108, "NVIDIA A100 whitepaper: 108 SMs (the 40 and 80 GB SXM parts are the same GA100 configuration)"),
       "H100-SXM": (132, "NVIDIA H100 Tensor Core GPU Architecture whitepaper: 132 SMs (SXM5)"),
       "H200": (132, "NVIDIA H200 datasheet: the H100 SXM's GH100 (132 SMs, same dense peaks) with 141 GB HBM3e"),
       "B200": (148, "NVIDIA Blackwell architecture technical brief: B200, two dies, 148 SMs"),
       "A6000": (84, "NVIDIA RTX A6000 datasheet: 10,752 CUDA cores = 84 SMs x 128 (GA102)"),
       "L40S": (142, "NVIDIA L40S datasheet: 18,176 CUDA cores = 142 SMs x 128 (AD102)"),
       "RTX-4090": (128, "NVIDIA Ada Lovelace architecture whitepaper: RTX 4090, 128 SMs (16,384 CUDA cores)"),
       "V100": (80, "NVIDIA Tesla V100 whitepaper: 80 SMs (SXM2)")}
DERIVED_FROM = {"A100-40GB": "A100-80GB", "H200": "H100-SXM", "B200": "H100-SXM", "A6000": "A100-80GB",
                "L40S": "A100-80GB", "RTX-4090": "A100-80GB", "V100": "A100-80GB"}
"""Where a GPU without a measurement takes its fractions from: its own generation where there is
one (A100-40GB: the same chip; H200: the same GH100; B200: the newest measured, Hopper), else A100."""
MAMF = {("H100-SXM", "bf16"): 0.803, ("H100-SXM", "fp8"): 0.709, ("H200", "bf16"): 0.803, ("H200", "fp8"): 0.734,
        ("B200", "bf16"): 0.776, ("B200", "fp8"): 0.763}
"""Maximum achievable matmul FLOPS as a fraction of the dense peak, measured per GPU and input type:
stas00/ml-engineering compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison
table" (mamf-finder.py: the best shape's mean of 100 matmuls after 50 warm-ups; BF16 and FP8 e4m3
inputs): H100 SXM 794.5 / 989 bf16 and 1402.6 / 1979 fp8; H200 SXM 1453.4 / 1979 fp8 (bf16: "H200 is
the same" as H100); B200 SXM 1745.0 / 2250 bf16 and 3432.5 / 4500 fp8. A ceiling derived for a GPU or
an input type vidur did not measure is the reference's measured bf16 ceiling x this GPU's MAMF
fraction for that type / the reference's bf16 MAMF fraction (fp16 takes bf16's): the measured shape
of the ceiling, moved by what each GPU's best matmul reaches, instead of assuming the same fraction
of every peak. A GPU or type with no MAMF row keeps the reference's fraction."""


def mamf_ceiling(ceiling: float, name: str, ref: str, prec: str) -> float:
    """The GEMM ceiling of `name` at `prec` from `ref`'s measured bf16 `ceiling` (MAMF)."""
    mine, base = MAMF.get((name, "bf16" if prec == "fp16" else prec)), MAMF.get((ref, "bf16"))
    return round(ceiling * mine / base, 3) if mine and base else ceiling
ATTENTION_GPU = {"A100-80GB": "A100", "H100-SXM": "H100"}


def vidur_points(repo: str) -> tuple[str, list[dict]]:
    commit = subprocess.run(["git", "--git-dir", repo, "rev-parse", "HEAD"], check=True, capture_output=True,
                            text=True).stdout.strip()
    files = subprocess.run(["git", "--git-dir", repo, "ls-tree", "-r", "--name-only", "HEAD", "data/profiling/compute"],
                           check=True, capture_output=True, text=True).stdout.split()
    pts = []
    for path in files:
        gpu = path.split("/")[3]
        if gpu not in VIDUR or not path.endswith("mlp.csv"):
            continue
        for r in _csv(repo, path):
            a, kv, h, f = (int(r[k]) for k in ("n_head", "n_kv_head", "n_embd", "n_expanded_embd"))
            tp, t, d = int(r["num_tensor_parallel_workers"]), int(r["num_tokens"]), h // a
            glu = r["use_gated_mlp"] == "True"
            shapes = {"attn_pre_proj": (t, (a + 2 * kv) * d // tp, h), "attn_post_proj": (t, h, a * d // tp),
                      "mlp_up_proj": (t, (2 if glu else 1) * f // tp, h), "mlp_down_proj": (t, h, f // tp)}
            for op, (m, n, k) in shapes.items():
                pts.append({"gpu": VIDUR[gpu], "model": "/".join(path.split("/")[4:6]), "op": op, "m": m, "n": n,
                            "k": k, "tp": tp, "s": float(r[f"time_stats.{op}.median"]) * 1e-3,
                            "add_s": float(r["time_stats.add.median"]) * 1e-3, "h": h})
    return commit, pts


def best_q(m: int, n: int, sms: int) -> float:
    return max(wave_efficiency(m, n, tuple(t), sms) for t in TILES)


def measure(pts: list[dict], name: str, peak: float, hbm: float) -> dict:
    """Ceiling, HBM efficiency and the tile model's error on one GPU's vidur points."""
    sms = SMS[name][0]
    mine = [p for p in pts if p["gpu"] == name and p["m"] >= 512]
    for p in mine:
        p["flops"] = 2.0 * p["m"] * p["n"] * p["k"]
        p["q"] = best_q(p["m"], p["n"], sms)
    big = [p["flops"] / p["s"] / (peak * p["q"]) for p in mine if p["m"] >= 2048 and p["flops"] >= 1e11]
    ceiling = statistics.median(big)
    # the residual add (reads two [T, h] fp16 tensors, writes one) on tensors of >= 64 MB, beyond the L2
    adds = {(p["model"], p["m"], p["tp"]): 3 * p["m"] * p["h"] * 2 / p["add_s"] for p in pts
            if p["gpu"] == name and p["m"] * p["h"] * 2 >= 64e6}
    achievable = statistics.median(adds.values())
    errs = []
    for p in mine:  # planner.cost.compute.shape_time, fp16
        model = max(p["flops"] / (peak * ceiling * p["q"]),
                    2.0 * (p["m"] * p["k"] + p["k"] * p["n"] + p["m"] * p["n"]) / achievable)
        errs.append(rel_error(model, p["s"]))
    return {"ceiling": round(ceiling, 3), "gemms": len(mine), "large": len(big),
            "ceiling_p10_p90": [round(sorted(big)[len(big) // 10], 3), round(sorted(big)[9 * len(big) // 10], 3)],
            "mape": mape(errs), "bias": statistics.fmean(errs),
            "hbm_efficiency": round(achievable / hbm, 3), "hbm_samples": len(adds)}


def sample(pts: list[dict]) -> list[list]:
    """The points tests/unit/test_kernel_curves.py checks the model against: every model, op and TP
    at 512 and 2,048 tokens."""
    return [[p["gpu"], p["model"], p["op"], p["tp"], p["m"], p["n"], p["k"], round(p["s"], 9)] for p in pts
            if p["m"] in (512, 2048)]


def attention_for(name: str, published: list[dict], peak: float, ref_peak: dict[str, float]) -> tuple[dict, dict]:
    """(kernels.attention, sources) of one GPU: its own published curves (H100's backward under a
    causal mask derived from the non-causal backward and the forward's causal / non-causal ratio), or
    a measured generation's scaled by the ratio of dense bf16 peaks (derived)."""
    src_gpu = ATTENTION_GPU.get(name) or ATTENTION_GPU.get(DERIVED_FROM.get(name, ""), "")
    if name == "V100" or not src_gpu:
        return {}, {}
    mine = [c for c in published if c["gpu"] == src_gpu]
    scale = 1.0 if name in ATTENTION_GPU else peak / ref_peak[src_gpu]
    out: dict[str, list] = {}
    srcs: dict[str, str] = {}
    for c in mine:
        out.setdefault(c["kernel"], []).append({k: c[k] for k in ("pass", "head_dim", "causal", "seq")}
                                               | {"tflops": [round(v * scale, 1) for v in c["tflops"]]})
        srcs.setdefault(c["kernel"], set()).add(c["source"])
    for kernel, curves in list(out.items()):  # causal backward where only the non-causal one is published
        for c in [c for c in curves if c["pass"] == "bwd" and not c["causal"]]:
            fwd = {x["causal"]: x["tflops"] for x in curves if x["pass"] == "fwd" and x["head_dim"] == c["head_dim"]}
            if True in fwd and False in fwd and not any(x["pass"] == "bwd" and x["causal"] and x["head_dim"] == c["head_dim"]
                                                        for x in curves):
                curves.append({"pass": "bwd", "head_dim": c["head_dim"], "causal": True, "seq": c["seq"],
                               "tflops": [round(b * fc / fn, 1) for b, fc, fn in zip(c["tflops"], fwd[True], fwd[False])]})
                srcs[kernel].add("derived: the causal backward = the non-causal backward x (causal / non-causal "
                                 "forward) at the same head dim and sequence (the paper gives the backward without mask)")
    sources = {}
    for kernel, ss in srcs.items():
        text = "; ".join(sorted(ss))
        if scale != 1.0:
            text = (f"derived: {src_gpu}'s curves x {scale:.3f}, the ratio of dense bf16 peaks ({peak:g} / "
                    f"{ref_peak[src_gpu]:g} TFLOP/s): the kernel at the same fraction of peak on this GPU, "
                    f"not measured here. {src_gpu}'s: " + text)
        elif name != {"A100": "A100-80GB", "H100": "H100-SXM"}[src_gpu]:
            text = f"derived: as {src_gpu} (same compute), not measured on this part. " + text
        sources[f"kernels.attention.{kernel}"] = text
    return out, sources


def build(repo: str) -> tuple[dict[str, dict], dict]:
    commit, pts = vidur_points(repo)
    profiles = {p.stem: json.loads(p.read_text()) for p in sorted(PROFILES_DIR.glob("*.json"))
                if json.loads(p.read_text()).get("kind") == "gpu"}
    stats = {name: measure(pts, name, profiles[name]["peak_tflops"]["bf16"] * 1e12,
                           profiles[name]["hbm_bandwidth_gbps"] * 1e9) for name in VIDUR.values()}
    published = json.loads((PROFILES_DIR / "kernels" / "attention-published.json").read_text())["curves"]
    ref_peak = {"A100": 312.0, "H100": 989.0}
    vsrc = (f"microsoft/vidur at {commit[:10]}, data/profiling/compute/<gpu>/*/mlp.csv (fp16 CUDA-event medians of "
            "8 models' linear layers, 512-4,096 tokens, TP 1-8)")
    out = {}
    for name, data in profiles.items():
        ref = name if name in stats else DERIVED_FROM[name]
        st = stats[ref]
        precs = [p for p in ("bf16", "fp16", "fp8") if data["peak_tflops"].get(p)]
        att, att_src = attention_for(name, published, data["peak_tflops"].get("bf16") or data["peak_tflops"]["fp16"],
                                     ref_peak)
        kernels = {"sms": SMS[name][0], "gemm_tiles": TILES,
                   "gemm_ceiling": {p: mamf_ceiling(st["ceiling"], name, ref, p) for p in precs},
                   "hbm_efficiency": st["hbm_efficiency"], **({"attention": att} if att else {})}
        src = {"kernels.sms": SMS[name][1],
               "kernels.gemm_tiles": "CUTLASS's SM80 default 128x256 tile in both orientations and 128x128; the one that "
                                     "fills its waves best (benchmarks/kernel_curves.py TILES)"}
        measured = (f"measured: median over {st['large']} large GEMMs of time / (2 m n k / (peak x wave efficiency)), "
                    f"p10-p90 {st['ceiling_p10_p90'][0]}-{st['ceiling_p10_p90'][1]}; the tile/wave model then reproduces "
                    f"vidur's {st['gemms']} GEMMs with M >= 512 within {st['mape']:.1%} MAPE (bias {st['bias']:+.1%}); {vsrc}")
        hbm = (f"measured: vidur's residual add (2 reads + 1 write of [tokens, hidden] fp16) on {st['hbm_samples']} tensors "
               f">= 64 MB, median achieved / datasheet bandwidth; {vsrc}")
        mamf = [f"{p} {kernels['gemm_ceiling'][p]} = {st['ceiling']} x {MAMF[(name, 'bf16' if p == 'fp16' else p)]} / "
                f"{MAMF[(ref, 'bf16')]}" for p in precs if kernels["gemm_ceiling"][p] != st["ceiling"]]
        moved = ("; " + ", ".join(mamf) + ": the MAMF fractions (maximum achievable matmul FLOPS / dense peak) of this "
                 "GPU and input type over the reference's bf16 one (benchmarks/kernel_curves.py MAMF: stas00/ml-engineering "
                 "compute/accelerator/README.md, 'Maximum Achievable Matmul FLOPS comparison table')") if mamf else ""
        if name == ref:
            src["kernels.gemm_ceiling"] = measured + (moved or ("; fp8: derived, the bf16 fraction of the fp8 peak (no "
                                                                "FP8 measurement)" if "fp8" in precs else ""))
            src["kernels.hbm_efficiency"] = hbm
        else:
            src["kernels.gemm_ceiling"] = (f"derived: {ref}'s measured fraction of peak, not measured on this GPU ({ref}: "
                                           f"{measured})" + moved)
            src["kernels.hbm_efficiency"] = f"derived: {ref}'s measured fraction, not measured on this GPU ({ref}: {hbm})"
        src.update(att_src)
        if name == "V100":
            src["kernels.attention"] = ("none: FlashAttention needs SM 8.0+ (flash-attention README); V100 runs "
                                        "eager attention, timed from its GEMMs and softmax traffic")
        out[name] = {"kernels": kernels, "sources": src}
    return out, {"commit": commit, "stats": stats, "sample": sample(pts)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("repo", nargs="?", default="/work/.mirror/microsoft+vidur/repo")
    ap.add_argument("--apply", action="store_true", help="write the kernels sections into profiles/")
    a = ap.parse_args(argv)
    out, meta = build(a.repo)
    for name, st in meta["stats"].items():
        print(f"{name}: ceiling {st['ceiling']} (p10-p90 {st['ceiling_p10_p90']}, {st['large']} large GEMMs); tile/wave "
              f"model on {st['gemms']} GEMMs: MAPE {st['mape']:.1%}, bias {st['bias']:+.1%}; HBM efficiency "
              f"{st['hbm_efficiency']} ({st['hbm_samples']} adds)")
    if a.apply:
        for name, sec in out.items():
            path = PROFILES_DIR / f"{name}.json"
            data = json.loads(path.read_text())
            data["kernels"] = sec["kernels"]
            data["sources"] = {k: v for k, v in data.get("sources", {}).items() if not k.startswith("kernels")}
            data["sources"].update(sec["sources"])
            atomic_write_json(path, data)
        head = json.dumps({"source": f"microsoft/vidur at commit {meta['commit']}: data/profiling/compute/<gpu>/"
                                     "<model>/mlp.csv, median seconds of each linear layer (fp16); columns gpu, model, "
                                     "op, tp, m (tokens), n, k, seconds (benchmarks/kernel_curves.py)"})[:-1]
        rows = ",\n".join(json.dumps(r) for r in meta["sample"])  # one point per line
        atomic_write_text(PROFILES_DIR / "kernels" / "vidur-gemm.json", f'{head}, "points": [\n{rows}\n]}}\n')
        print(f"wrote the kernels sections of {len(out)} profiles and profiles/kernels/vidur-gemm.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
