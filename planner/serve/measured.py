"""Measured kernel curves for the serving cost model (profiles/serving/vidur.json).

The file holds microsoft/vidur's per-operation GPU timings of one Llama-2-7B block (CUDA
events; Agrawal et al. 2024, MLSys; extracted by benchmarks/serve_vidur_extract.py with the
commit): for A100-80GB and H100-SXM at TP 1, 2, 4 and 8, by tokens in the batch (1 ... 4096),
the four linear layers together (QKV, attention output, FFN up+gate, FFN down) and the
elementwise ops (two norms, rotary, activation, residual add). On a GPU the file covers, the
cost model takes from it, instead of assumed fractions:
- linear layers: time per byte of bf16 weights on one rank at that token count (log-log
  between the measured counts; above 4096 tokens in proportion to the tokens, the compute-
  bound regime), times the model's linear weight bytes per rank;
- elementwise ops: seconds per layer at that token count, times hidden / 4096;
- the bandwidth share a memory-bound read reaches (decode_bw_efficiency until a profile fits
  one): the median over 1-16 tokens at TP 1 of the linear weight bytes / their time /
  hbm_bandwidth_gbps (A100-80GB 0.76, H100-SXM 0.79), used for the KV-cache read;
- the TP all-reduce of a step's activations (allreduce_s): vidur's NCCL timings on one DGX node
  at TP 2, 4, 8 by element count (4096 ... 16.8M elements, log-log between them, in proportion
  above), instead of the link's assumed bandwidth and latency.
"""
from __future__ import annotations

import functools
import json
import math
import statistics
from typing import Any

from planner.specs.hardware import PROFILES_DIR, DeviceProfile

VIDUR_FILE = PROFILES_DIR / "serving" / "vidur.json"
REF_HIDDEN = 4096


@functools.lru_cache(maxsize=1)
def _data() -> dict[str, Any]:
    return json.loads(VIDUR_FILE.read_text())


def curve(device: DeviceProfile, tp: int) -> dict[str, Any] | None:
    """The measured block curves of this GPU at this TP degree, or None (not measured)."""
    dev = _data()["devices"].get(device.name)
    if dev is None:
        return None
    c = dev["tp"].get(str(tp))
    if c is None:
        return None
    return {**c, "ref_bytes": 2.0 * _data()["model"]["linear_weights_per_layer"] / tp}


def _interp(xs: list[float], ys: list[float], x: float, proportional_above: bool) -> float:
    x = max(float(xs[0]), x)
    if x >= xs[-1]:
        return ys[-1] * (x / xs[-1] if proportional_above else 1.0)
    k = next(i for i in range(1, len(xs)) if x <= xs[i])
    w = (math.log(x) - math.log(xs[k - 1])) / (math.log(xs[k]) - math.log(xs[k - 1]))
    return math.exp(math.log(ys[k - 1]) + w * (math.log(ys[k]) - math.log(ys[k - 1])))


def linear_s(c: dict[str, Any], rows: int, bf16_bytes_per_rank: float) -> float:
    """Seconds of one layer's linear GEMMs over `rows` tokens, at bf16, for weights of
    bf16_bytes_per_rank bytes on this rank."""
    ms = _interp(c["tokens"], c["linear_ms"], rows, True)
    return ms * 1e-3 * bf16_bytes_per_rank / c["ref_bytes"]


def other_ops_s(c: dict[str, Any], rows: int, hidden: int) -> float:
    """Seconds of one layer's elementwise ops (norms, rotary, activation, add) over `rows` tokens."""
    return _interp(c["tokens"], c["other_ms"], rows, True) * 1e-3 * hidden / REF_HIDDEN


def bandwidth_share(device: DeviceProfile) -> float | None:
    """Share of hbm_bandwidth_gbps the measured memory-bound linear layers reach (1-16 tokens, TP 1)."""
    c = curve(device, 1)
    if c is None or not device.hbm_bandwidth_gbps:
        return None
    shares = [c["ref_bytes"] / (ms * 1e-3) / (device.hbm_bandwidth_gbps * 1e9)
              for n, ms in zip(c["tokens"], c["linear_ms"]) if n <= 16]
    return float(statistics.median(shares))


def allreduce_s(device: DeviceProfile, tp: int, elements: float) -> float | None:
    """Seconds of one all-reduce of `elements` 2-byte elements over tp GPUs of one node, measured
    (vidur's NCCL medians), or None where not measured (this GPU or TP degree)."""
    dev = _data()["devices"].get(device.name)
    c = None if dev is None else dev.get("all_reduce", {}).get(str(tp))
    if c is None or elements <= 0:
        return None
    return _interp(c["elements"], c["ms"], elements, True) * 1e-3
