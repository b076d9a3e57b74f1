"""DeepSpeed's optimizer engines: which buffers each one holds, and what it sends over DP.

DeepSpeed 0.19.8 picks the optimizer wrapper in runtime/engine.py
`_do_optimizer_sanity_check` / `_configure_optimizer`, from the ZeRO stage, the model dtype
(bf16/fp16/fp32), the gradient-accumulation dtype (our configs leave it unset: the model
dtype) and whether the module is a PipelineModule:

| ZeRO | precision | pipeline | wrapper                                   | engine here  |
|------|-----------|----------|-------------------------------------------|--------------|
| 0    | fp32      | any      | none: the basic optimizer (torch AdamW on CPU, FusedAdam on GPU) | torch_adam |
| 0    | bf16      | no       | DDP_BFLOAT16 -> FP16_Optimizer (fused) / FP16_UnfusedOptimizer (client optimizer) | fp16_optimizer |
| 0    | fp16      | any      | FP16 -> FP16_Optimizer / FP16_UnfusedOptimizer | fp16_optimizer |
| 0    | bf16      | yes      | BFLOAT16 -> BF16_Optimizer                 | bf16_optimizer |
| 1, 2 | any       | (1 only) | DeepSpeedZeroOptimizer (stage_1_and_2.py)  | zero1 / zero2 |
| 3    | any       | no       | DeepSpeedZeroOptimizer_Stage3 (stage3.py)  | zero3        |

Each engine is a list of buffers. A buffer's size is bytes x a basis (the device's
parameters, its small parameters, the reduce bucket, ...), divided by the DP degree when
DeepSpeed partitions it, and lives for one phase of the step:

- "always": allocated at start-up (weights, master copies, Adam moments, flat buffers);
- "grads": created by backward and freed by the optimizer step (p.grad, a ZeRO partition of
  the reduced gradients) -- held at the step;
- "backward": only while backward runs (ZeRO-1's full p.grad before its epilogue moves the
  owned partition out, the reduce buckets, ZeRO-3's gathered parameters);
- "step": only inside optimizer.step (fp32 copies of the gradients).

The executor counts the same buffers tensor by tensor (planner/runtime/observe/measure.py): those
reached through the module (`held_by="module"`: p.data, p.grad, ZeRO-3's ds_tensor) and those
reached through the optimizer (`held_by="optimizer"`). Measured on tiny runs (README "The cost
model"): every "always" and "grads" buffer below appears with the predicted size.
"""
from __future__ import annotations

from functools import lru_cache

from planner.cost.buffers import (BASES, FALLBACK_BUCKET, LOCATIONS, PHASES, ROLES, Buffer, Collective, Engine,
                                  Kind, Sizes)
from planner.cost.deepspeed_buffers import (_bf16_optimizer, _fp16_optimizer, _torch_adam, _with_variants, _zero12,
                                            _zero3)
from planner.specs.dtypes import activation_bytes
from planner.specs.plan import Plan

__all__ = ["BASES", "FALLBACK_BUCKET", "LOCATIONS", "PHASES", "ROLES", "Buffer", "Collective", "Engine", "Footprint",
           "Kind", "Sizes", "engine_for", "footprint", "host_bytes", "sizes", "state_bytes"]


@lru_cache(maxsize=256)
def _engine(zero: int, precision: str, pipeline: bool, overlap_comm: bool, offload_optimizer: str = "none",
            offload_params: str = "none", hpz: bool = False, qwz: bool = False, accumulates: bool = False) -> Engine:
    return _with_variants(_base_engine(zero, precision, pipeline, overlap_comm), zero, activation_bytes(precision),
                          offload_optimizer, offload_params, hpz, qwz, accumulates)


def _base_engine(zero: int, precision: str, pipeline: bool, overlap_comm: bool) -> Engine:
    e = activation_bytes(precision)
    if zero == 0:
        if precision == "fp32":
            return _torch_adam(e)
        if precision == "bf16" and pipeline:
            return _bf16_optimizer(e)
        return _fp16_optimizer(e)
    if zero in (1, 2):
        # the pipeline engine turns overlap_comm off (runtime/engine.py _configure_zero_optimizer)
        return _zero12(zero, e, overlap=overlap_comm and not pipeline, pipeline=pipeline)
    return _zero3(e)


def engine_for(plan: Plan) -> Engine:
    """The optimizer engine DeepSpeed 0.19.8 builds for this plan's ds_config."""
    # fp8 (Transformer Engine) keeps bf16 weights and gradients: the bf16 engine
    precision = "bf16" if plan.precision == "fp8" else plan.precision
    return _engine(plan.zero, precision, plan.pp > 1, plan.overlap_comm, plan.offload_optimizer, plan.offload_params,
                   plan.hpz > 1, plan.quantized_weights, plan.zero == 2 and plan.offload_optimizer != "none" and plan.grad_accum > 1)


def sizes(plan: Plan, psi: float, small: float, owned: float | None = None, resident: bool = False,
          largest: float = 0.0) -> Sizes:
    """A device's bases. ZeRO partitions over plan.zero_shard ranks (the DP group, or MiCS's shard group)."""
    return Sizes(psi=psi, small=small, dp=plan.zero_shard, bucket_elements=float(plan.bucket_elements), owned=owned,
                 live=float(plan.live), hpz=plan.hpz, largest=largest, resident=resident)


class Footprint:
    """An engine's buffers for one plan, precompiled into coefficients so that the search can
    evaluate them hundreds of thousands of times: the same numbers as Engine.bytes_by_role.

    A buffer is either linear, a * psi + b * small + c bytes, capped, k * min(psi / div, cap),
    or k * owned (ZeRO-1's owned gradients, planner.cost.params.zero1_owned)."""

    __slots__ = ("linear_terms", "capped_terms", "owned_terms", "linear", "mins", "owned", "dp")

    def __init__(self, engine: Engine, plan: Plan, resident: bool, largest: float = 0.0) -> None:
        d, bucket = plan.zero_shard, float(plan.bucket_elements)
        capped = {"fallback_bucket": (1, float(FALLBACK_BUCKET)), "live_params": (1, float(plan.live)),
                  "sub_group": (d, bucket)}
        linear_terms, capped_terms, owned_terms = [], [], []
        self.dp = d
        for buf in engine.buffers:
            # a CPU "device" is the host: what DeepSpeed offloads stays in the same resident set
            if buf.location == "nvme" or (buf.location == "host" and not resident):
                continue
            group = 0 if buf.phase in ("always", "grads") else 1 if buf.phase == "backward" else 2
            k = buf.count * buf.bytes / (d if buf.sharded else 1)
            role = ROLES.index(buf.role)
            if buf.basis == "owned":
                owned_terms.append((group, role, k))
            elif buf.basis == "reduce_bucket" and resident:
                capped_terms.append((group, role, k, buf.count, bucket))
            elif buf.basis in capped:
                capped_terms.append((group, role, k, *capped[buf.basis]))
            else:
                coef = {"psi": (k, 0.0, 0.0), "small": (0.0, k, 0.0), "reduce_bucket": (0.0, 0.0, k * bucket),
                        "hpz": (k / plan.hpz, -k / plan.hpz, 0.0), "largest": (0.0, 0.0, k * largest)}
                linear_terms.append((group, role, *coef[buf.basis]))
        self.linear_terms, self.capped_terms = tuple(linear_terms), tuple(capped_terms)
        self.owned_terms = tuple(owned_terms)
        # totals for the search's fast path (planner.search.checkpoint.StageModel): per quantity
        # (held, held buckets, backward, backward buckets, step) a * psi + b * small + c, plus
        # the capped terms
        lin = [[0.0, 0.0, 0.0] for _ in range(5)]
        for group, role, a, b, c in linear_terms:
            for q in _slots(group, role):
                lin[q] = [lin[q][0] + a, lin[q][1] + b, lin[q][2] + c]
        self.linear = tuple(tuple(x) for x in lin)
        self.mins = tuple((q, k, div, cap) for group, role, k, div, cap in capped_terms for q in _slots(group, role))
        self.owned = tuple((q, k) for group, role, k in owned_terms for q in _slots(group, role))

    def evaluate(self, psi: float, small: float, owned: float | None = None) -> tuple[list[float], list[float], float]:
        """(bytes per role held from backward through the step, bytes per role during backward
        only, bytes during the step only) for a device with `psi` parameters (`owned`: see
        Sizes.owned)."""
        out = ([0.0] * 4, [0.0] * 4, [0.0])
        for group, role, a, b, c in self.linear_terms:
            out[group][role if group < 2 else 0] += a * psi + b * small + c
        for group, role, k, div, cap in self.capped_terms:
            out[group][role if group < 2 else 0] += k * min(psi / div, cap)
        for group, role, k in self.owned_terms:
            out[group][role if group < 2 else 0] += k * (psi / self.dp if owned is None else owned)
        return out[0], out[1], out[2][0]


def _slots(group: int, role: int) -> tuple[int, ...]:
    """Which totals a buffer adds to: held (0), held buckets (1), backward (2), backward
    buckets (3), step (4)."""
    if group == 2:
        return (4,)
    return (2 * group, 2 * group + 1) if role == ROLES.index("buckets") else (2 * group,)


_ENGINE_FIELDS = ("zero", "precision", "overlap_comm", "dp", "bucket_elements", "live_elements", "offload_optimizer",
                  "offload_params", "hpz", "quantized_weights", "mics_shard")


@lru_cache(maxsize=4096)
def _footprint(key: tuple, pipeline: bool, accumulates: bool, resident: bool, largest: float) -> Footprint:
    plan = Plan(**dict(zip(_ENGINE_FIELDS, key)), pp=2 if pipeline else 1, grad_accum=2 if accumulates else 1)
    return Footprint(engine_for(plan), plan, resident, largest)


def footprint(plan: Plan, resident: bool = False, largest: float = 0.0) -> Footprint:
    """The plan's engine, precompiled; `resident`: see Sizes.resident (a CPU device, whose host
    buffers are its own memory: offloaded buffers count); `largest`: see Sizes.largest."""
    return _footprint(tuple(getattr(plan, f) for f in _ENGINE_FIELDS), plan.pp > 1, plan.grad_accum > 1, resident,
                      float(largest))


def host_bytes(plan: Plan, psi: float, small: float, location: str = "host", largest: float = 0.0) -> float:
    """Bytes one rank keeps in host memory (or on NVMe) for the plan's offloaded states."""
    eng = engine_for(plan)
    return sum(eng.bytes_by_role(sizes(plan, psi, small, largest=largest), PHASES, location=location).values())


def state_bytes(plan: Plan, psi: float, small: float, location: str = "device", largest: float = 0.0) -> float:
    """Model-state bytes one rank holds at the optimizer step in `location` (the buffers of the
    "always" and "grads" phases): what the executor counts tensor by tensor after backward."""
    eng = engine_for(plan)
    return sum(eng.bytes_by_role(sizes(plan, psi, small, largest=largest), ("always", "grads"),
                                 location=location).values())
