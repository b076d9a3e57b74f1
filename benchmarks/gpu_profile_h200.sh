#!/usr/bin/env bash
# Profile an H200 (or any CUDA GPU) and compare with the built-in profile (issue 4).
#   benchmarks/gpu_profile_h200.sh [OUT=profiles/h200-measured.json]
# GEMM curve over GLM-4-9B's layer shapes, per-layer forward/backward time, recompute cost and
# saved-activation bytes (hooks + CUDA allocator) of a GLM-4-9B block at TP 1, HBM copy
# bandwidth, and NCCL collectives when there are 2+ GPUs. Skips (exit 0) without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PLANNER=${PLANNER:-.venv/bin/planner}
OUT=${1:-profiles/h200-measured.json}
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "skipped: no CUDA device visible to torch ($("$PY" -c 'import torch; print(torch.__version__)'))"
  exit 0
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
start=$(date +%s)
"$PLANNER" profile --model glm-4-9b --scale full --max-tp 1 --precision bf16 --name h200-measured --out "$OUT"
echo "wall: $(( $(date +%s) - start )) s"
"$PY" - "$OUT" <<'PYEOF'
import json, sys
from planner.specs import find_device, load_profile
m = load_profile(sys.argv[1]); b = find_device("H200")[0]
print(f"{'figure':<28} {'measured':>12} {'built-in H200':>14}")
for p in ("bf16", "fp16", "fp32"):
    print(f"{'peak TFLOP/s ' + p:<28} {m.peak_tflops[p]:>12.1f} {b.peak_tflops[p]:>14.1f}")
print(f"{'HBM bandwidth GB/s':<28} {m.hbm_bandwidth_gbps:>12.0f} {b.hbm_bandwidth_gbps:>14.0f}")
print(f"{'memory GB':<28} {m.memory_gb:>12.1f} {b.memory_gb:>14.1f}")
for f, e in m.gemm_efficiency:
    print(f"{'GEMM eff @ %.2g FLOP' % f:<28} {e:>12.3f} {b.gemm_eff(f):>14.3f}")
for r in m.measured["layers"]:
    cm = r["cost_model"]
    print(f"block b={r['micro_batch']} s={r['seq']}: fwd {1e3*r['forward_s']['median']:.2f} ms bwd "
          f"{1e3*r['backward_s']['median']:.2f} ms recompute {1e3*r['recompute_s']:.2f} ms; saved "
          f"{r['saved_activation_bytes']/1e9:.3f} GB hooks, {(r['allocator_forward_growth_bytes'] or 0)/1e9:.3f} GB allocator, "
          f"cost model {cm.get('block_act_bytes', 0)/1e9:.3f} GB, block time cost model {1e3*cm.get('block_time_s', 0):.2f} ms")
for n in m.measured["notes"]:
    print("note:", n)
PYEOF
