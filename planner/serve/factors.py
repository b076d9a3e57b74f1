"""The eight serving factors and how a step's factor-free terms combine with them.

Every time of the serving cost model is a factor-free term (planner/serve/terms.py `*_terms`)
combined with eight named serving factors of the device profile (SERVE_DEFAULTS), fitted by
planner/serve/calibrate.py from measured runs:
    time = max(compute x compute_scale, memory / decode_bw_efficiency)   (GPU; on CPU: their sum)
           (a decode step's attention parts, cache read and core, x decode_attention_scale)
           + comm x serve_comm_scale + serve_step_overhead_s + tp_steps x serve_tp_step_s
           (+ serve_wake_s on the first step after an idle wait: planner/serve/queue.py simulate)
compute_scale is prefill_compute_scale for a prefill and decode_compute_scale for a decode step
(few-row GEMMs reach a lower share of the efficiency curve than a prompt's); tp_steps is 1 under
TP (the driver sends each step's inputs to the TP workers: vLLM's broadcast of the scheduler
output) and 0 without.
"""
from __future__ import annotations

from planner.serve import measured
from planner.specs.cluster import ClusterSpec

__all__ = ["GPU_STEP_OVERHEAD_S", "SERVE_DEFAULTS", "combine", "serve_factor", "serve_factors"]

SERVE_DEFAULTS: dict[str, float] = {
    "prefill_compute_scale": 1.0,
    # multiplier on GEMM and attention time at the profile's gemm_efficiency curve (prefill and
    # the decode compute floor)
    "decode_bw_efficiency": 0.8,
    # share of hbm_bandwidth_gbps that the weight and KV reads reach (assumed 0.8 until fitted:
    # memory-bound kernels typically reach 70-90% of the datasheet bandwidth)
    "serve_comm_scale": 1.0,
    # multiplier on the TP all-reduce / logits all-gather time at the link's busbw and latency
    "serve_step_overhead_s": 0.0,
    # fixed seconds per engine step: scheduling, sampling, kernel launches, host sync
    "decode_compute_scale": 1.0,
    # multiplier on the decode compute floor (GEMMs of `batch` rows, attention, logits)
    "serve_tp_step_s": 0.0,
    # fixed seconds per engine step under TP: the step's inputs sent from the driver to the
    # TP workers and their start in step (on top of the layers' collectives in comm)
    "decode_attention_scale": 1.0,
    # multiplier on a decode step's attention: the KV cache (or linear attention's state) read
    # and the attention core's compute, the parts that grow with the context. 1: the cache read
    # at the weights' bandwidth share, as vLLM's paged-attention kernel does on a GPU (assumed
    # until fitted). The CPU executor's padded cache (a gather of each running slot's K and V per
    # layer, then a masked SDPA in bf16) measures ~5-15 us per context token on small ChatGLM3
    # against ~1 us of bytes at the fitted bandwidth
    "serve_wake_s": 0.0,
    # fixed seconds added to the first step after the engine sat idle waiting for an arrival:
    # the process woken from its sleep, its core's caches and clock run down by the wait
    # (measured on this CPU: tiny prefills 2.4-3.6 ms after a wait, 1.6-2.1 ms back to back)
}


GPU_STEP_OVERHEAD_S = 160e-6
"""Seconds a GPU sits idle between two engine steps while the engine's CPU side schedules the
next one (serve_step_overhead_s on GPUs until calibrated). vLLM's async scheduling, on by default
since v0.14.0 (release notes: "Async scheduling is now enabled by default"; --async-scheduling,
vLLM PR #19970), schedules step n+1 while step n runs: the gap left between two decode steps
measured 150-170 us with CUDA graphs at batch 256 (vLLM PR #11133, the V1 async-scheduling
prototype, against 5-6 ms for the synchronous V1 loop of the time, issue #10634, Llama-2-7B;
4.6 ms between execute_model calls at batch 10, PR #24174). SGLang's overlap scheduler shows no
idle gap in its Nsight profile (SGLang v0.4 blog, 2024-12-04); the vLLM figure is used for both.
An engine run without async scheduling (vLLM < 0.14, --no-async-scheduling) pays the synchronous
gap: set serve_step_overhead_s in the profile's factors."""


def serve_factor(cluster: ClusterSpec, name: str) -> float:
    """The profile's fitted value of a serving factor, or its default: decode_bw_efficiency
    defaults to the share of the bandwidth measured memory-bound kernels reach on this GPU
    (planner/serve/measured.py bandwidth_share) where it was measured, else 0.8 (assumed);
    serve_step_overhead_s on a GPU to GPU_STEP_OVERHEAD_S (measured), on a CPU to 0 (fitted by
    planner calibrate)."""
    if name in cluster.device.factors:
        return float(cluster.device.factors[name])
    if name == "serve_step_overhead_s" and cluster.device.kind != "cpu":
        return GPU_STEP_OVERHEAD_S
    if name == "decode_bw_efficiency":
        share = measured.bandwidth_share(cluster.device)
        if share is not None:
            return share
    return float(SERVE_DEFAULTS[name])


def serve_factors(cluster: ClusterSpec) -> dict[str, float]:
    return {k: serve_factor(cluster, k) for k in SERVE_DEFAULTS}


def combine(terms: dict[str, float], f: dict[str, float], decode: bool = False) -> float:
    """Step seconds from factor-free terms and the serving factors (module docstring); `decode`:
    the terms are a decode step's (decode_compute_scale on compute), else a prefill's."""
    scale = f.get("decode_compute_scale", SERVE_DEFAULTS["decode_compute_scale"]) if decode \
        else f["prefill_compute_scale"]
    # on the decodes' attention parts only (a mixed step's decodes too)
    extra = f.get("decode_attention_scale", 1.0) - 1.0 if decode or terms.get("mixed") else 0.0
    comp = (terms["compute_s"] + extra * terms.get("attn_compute_s", 0.0)) * scale
    mem = (terms["memory_s"] + extra * terms.get("attn_memory_s", 0.0)) / f["decode_bw_efficiency"]
    return ((comp + mem if terms.get("serial", 0.0) else max(comp, mem)) + terms.get("fixed_s", 0.0)
            + terms["comm_s"] * f["serve_comm_scale"] + f["serve_step_overhead_s"]
            + terms.get("tp_steps", 0.0) * f.get("serve_tp_step_s", 0.0)
            + terms.get("wake", 0.0) * f.get("serve_wake_s", 0.0))
