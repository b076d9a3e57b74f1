"""The runtime a plan runs on, as data: profiles/runtimes/<name>.json.

A runtime is a description, not a fudge factor (shared DESIGN.md "Runtimes as data"): which
ZeRO-like stages, pipeline and TP it offers, whether it interleaves, which attention kernel it
runs, and the few structural terms that differ between them:

- tp_comm_overlap (Megatron-Core --tp-comm-overlap): the sequence-parallel all-gathers and
  reduce-scatters are chunked and pipelined with the GEMMs beside them, so only what the GEMMs
  cannot cover is exposed (planner.cost.tp.tp_block_comm's callers);
- p2p_overlap (Megatron-Core --overlap-p2p-communication): steady-state pipeline sends run
  behind the next micro-batch's compute; fill and drain stay exposed;
- flat_parameters (FSDP's FlatParameter, Megatron's contiguous buffers): one collective per
  unit, no per-tensor host-side fetch cost;
- its own factors: the deepspeed runtime takes the GPU profile's (fitted on DeepSpeed's runs by
  benchmarks/ds_reference.py); the others start from planner.cost.factors.DEFAULTS updated by
  their file's physics values and trims (benchmarks/fidelity.py fits a trim only where two
  sources determine it, and writes where it came from into the file's "sources").

Pure data and stdlib: importable without torch.
"""
from __future__ import annotations

import dataclasses
import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

from planner.errors import SpecError
from planner.specs.hardware import PROFILES_DIR
from planner.specs.plan import RUNTIMES as NAMES
from planner.specs.problems import Problem

RUNTIMES_DIR = PROFILES_DIR / "runtimes"
DEFAULT = NAMES[0]


@dataclass(frozen=True, slots=True, kw_only=True)
class Runtime:
    name: str
    executable: bool
    """`planner run` can execute it here (only DeepSpeed)."""
    zero_stages: tuple[int, ...]
    """The plan's ZeRO stages the runtime offers (Megatron-Core: 0 DDP, 1 distributed optimizer;
    FSDP: 2 SHARD_GRAD_OP, 3 FULL_SHARD)."""
    zero_names: Mapping[str, str] = field(default_factory=dict)
    pipeline: bool
    tensor_parallel: bool
    interleaved: bool
    attention: str
    """"plan": the kernel TrainSpec.attention names; else the kernel the runtime always runs."""
    precisions: tuple[str, ...]
    """Training precisions it offers (fp8: Transformer Engine)."""
    attention_kernels: tuple[str, ...] = ("fa2",)
    """The measured attention kernel families (profiles' kernels.attention) its flash attention
    runs, in its order of preference: the first one the GPU's profile has times the core."""
    causal_attention: bool = True
    """Whether its flash kernel skips the blocks above the diagonal (a causal mask flag) or, given
    an explicit mask, computes every block."""
    fused_cross_entropy: bool = False
    """Whether its loss is a fused cross-entropy kernel that keeps the logits in the activation
    dtype and a log-sum-exp per token instead of an fp32 softmax (planner.cost.memory.head_bytes)."""

    @property
    def materialises_mask(self) -> bool:
        """Whether the attention is given an s x s mask tensor (the executor's explicit causal,
        within-document mask) rather than a causal flag, so a stage keeps it for backward."""
        return not self.causal_attention
    tp_comm_overlap: bool
    p2p_overlap: bool
    flat_parameters: bool
    grad_reduce_fp32: bool = False
    """Whether a bf16 (or fp8, whose master gradients are bf16's) plan's data-parallel gradient
    reduction runs in fp32 whatever the weights' dtype (Megatron-LM: bf16 forces
    accumulate_allreduce_grads_in_fp32, the DDP's grad_reduce_in_fp32): 4 bytes per element."""
    param_gather_overlap: bool = False
    """Whether the distributed optimizer's post-step parameter all-gather runs bucket by bucket
    in the next step's forward (Megatron-Core --overlap-param-gather: each bucket's gather is
    waited on in the forward pre-hook of its first module), hidden behind that forward."""
    fp8_param_gather: bool = False
    """Whether its fp8 recipes keep the weights in FP8 with no bf16 copy (Megatron-Core
    --fp8-param-gather, set by Megatron-Bridge's fp8 mixed-precision recipes): with the
    distributed optimizer, planner.cost.memory.fp8_param_gather / fp8_bytes."""
    device_factors: bool
    """Use the GPU profile's fitted factors (DeepSpeed's) rather than this file's."""
    factors: Mapping[str, float] = field(default_factory=dict)
    by_device: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    """Per GPU profile name: trims fitted for this runtime on that generation."""
    sources: Mapping[str, str] = field(default_factory=dict)
    path: str = ""

    def zero_label(self, zero: int) -> str:
        return self.zero_names.get(str(zero), f"ZeRO-{zero}")


def _load(path: Path) -> Runtime:
    data: dict[str, Any] = json.loads(path.read_text())
    keys = ("executable", "zero_stages", "pipeline", "tensor_parallel", "interleaved", "attention",
            "tp_comm_overlap", "p2p_overlap", "flat_parameters", "device_factors")
    missing = [k for k in keys if k not in data]
    if missing:
        raise SpecError(f"runtime {path.name}", f"missing field(s) {missing}", "fix the runtime data file")
    return Runtime(name=data["name"], zero_stages=tuple(data["zero_stages"]), zero_names=data.get("zero_names", {}),
                   precisions=tuple(data.get("precisions", ("bf16", "fp16", "fp32"))),
                   attention_kernels=tuple(data.get("attention_kernels", ("fa2",))),
                   causal_attention=bool(data.get("causal_attention", True)),
                   fused_cross_entropy=bool(data.get("fused_cross_entropy", False)),
                   grad_reduce_fp32=bool(data.get("grad_reduce_fp32", False)),
                   param_gather_overlap=bool(data.get("param_gather_overlap", False)),
                   fp8_param_gather=bool(data.get("fp8_param_gather", False)),
                   factors={k: float(v) for k, v in data.get("factors", {}).items()},
                   by_device={d: {k: float(v) for k, v in fs.items()} for d, fs in data.get("by_device", {}).items()},
                   sources=data.get("sources", {}), path=str(path),
                   **{k: data[k] for k in keys if k != "zero_stages"})


_TRIAL: dict[str, Runtime] = {}
"""Runtimes with trial factors, set only by `trial_factors` (a fit evaluating candidates)."""


def get_runtime(name: str) -> Runtime:
    """The runtime called `name`; SpecError naming --runtime and the choices if there is none."""
    return _TRIAL.get(name) or _file_runtime(name)


@contextmanager
def trial_factors(name: str, factors: Mapping[str, float], by_device: Mapping[str, Mapping[str, float]] | None = None):
    """Cost plans on runtime `name` with these factors (and per-device trims) instead of its
    file's, inside the block: how benchmarks/fidelity.py evaluates a fit's candidates."""
    rt = _file_runtime(name)
    _TRIAL[name] = dataclasses.replace(rt, factors={**rt.factors, **factors},
                                       by_device=by_device if by_device is not None else rt.by_device)
    try:
        yield _TRIAL[name]
    finally:
        _TRIAL.pop(name, None)


@lru_cache(maxsize=16)
def _file_runtime(name: str) -> Runtime:
    path = RUNTIMES_DIR / f"{name}.json"
    if name not in NAMES or not path.is_file():
        raise SpecError("--runtime", f"unknown runtime {name!r}", f"use one of {', '.join(NAMES)} (or all with search)")
    return _load(path)


def runtime_factors(rt: Runtime, device_name: str, device_factors: Mapping[str, float],
                    defaults: Mapping[str, float]) -> dict[str, float]:
    """The factor set a plan on `rt` is costed with: the device's (DeepSpeed) or the defaults
    updated by the runtime's physics values and its per-device trims."""
    if rt.device_factors:
        return {k: float(device_factors.get(k, v)) for k, v in defaults.items()}
    out = dict(defaults)
    # memory allowances describe the device, not the runtime: keep the profile's
    for k in ("memory_overhead_gb", "memory_fragmentation"):
        if k in device_factors:
            out[k] = float(device_factors[k])
    out.update(rt.factors)
    out.update(rt.by_device.get(device_name, {}))
    return out


def problems(rt: Runtime, plan: Any) -> list[Problem]:
    """What `rt` does not offer for this plan, each naming the field and the fix.
    DeepSpeed's own rules (no interleaving, no MiCS in 0.19.8) stay where the search applies
    them (planner.specs.validate.runtime_problems): the estimate of such a plan is still wanted
    for comparison."""
    out: list[Problem] = []
    if plan.precision not in rt.precisions:
        if plan.precision == "fp8":
            out.append(Problem("--runtime", "runtime-precision", f"runtime {rt.name} does not offer fp8",
                               "use bf16, or --runtime megatron-core / fsdp", detail="no Transformer Engine"))
        else:
            out.append(Problem("--runtime", "runtime-precision", f"runtime {rt.name} does not offer {plan.precision}",
                               f"use one of {', '.join(rt.precisions)}"))
    if rt.name == DEFAULT:
        return out
    if plan.zero not in rt.zero_stages:
        out.append(Problem("--zero", "runtime-zero", f"runtime {rt.name} has no ZeRO-{plan.zero}", "choose another --zero",
                           detail="offers " + ", ".join(f"{z} ({rt.zero_label(z)})" for z in rt.zero_stages)))
    if plan.pp > 1 and not rt.pipeline:
        out.append(Problem("--pp", "runtime-pp", f"runtime {rt.name} has no pipeline parallelism",
                           "use pp=1 or another --runtime"))
    if plan.tp > 1 and not rt.tensor_parallel:
        out.append(Problem("--tp", "runtime-tp", f"runtime {rt.name} has no tensor parallelism",
                           "use tp=1 or another --runtime"))
    if plan.schedule == "interleaved" and not rt.interleaved:
        out.append(Problem("--interleave", "runtime-interleaved", f"runtime {rt.name} has no interleaved schedule",
                           "use 1f1b or --runtime megatron-core"))
    if plan.variants:
        out.append(Problem("--runtime", "runtime-variants", f"runtime {rt.name} has none of DeepSpeed's ZeRO variants",
                           "drop them or use --runtime deepspeed", detail=", ".join(plan.variants)))
    return out
