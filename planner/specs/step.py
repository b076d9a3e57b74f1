"""Measured step probes of a profiled CPU: the "step" section of a measured profile.

What the executor's step is made of on this machine, measured by `planner profile`
(planner/profiler/run.py) and composed by the cost model in the structure it uses on GPUs
(planner/cost/block.py, tp.py, probes.py): the block's GEMMs, attention core and element-wise work are timed
from the GEMM curves and the memory bandwidth, and the block probe says how the executor's
real block relates to that sum in each precision; the TP all-reduces are timed as they run
inside autograd, between the block's GEMMs:

    "step": {
      "block": {"bf16": {"scale": 1.3, "overhead_s": 0.0021, "points": 6}, "fp32": {...}},
      "tp_allreduce": {"2": {"busbw_gbps": 0.9, "latency_us": 450.0, "points": 2}}
    }

- block[precision]: the executor's block (planner.model.block.Block, one TP rank's share, no
  communication) forward + backward measured at the profiler's (micro-batch, sequence, TP)
  points = scale x the cost model's block compute (GEMMs + attention core + element-wise) +
  overhead_s, a weighted least-squares line through the points (relative residuals). overhead_s
  is what the terms leave out per block (PyTorch's per-operator dispatch and autograd
  bookkeeping: on a CPU at these sizes, not negligible); scale what the GEMM probes' efficiency
  misses inside a whole block (the precision's conversions, cache effects).
- framework[precision]: the executor's DeepSpeed engine on one process (planner/profiler/engine.py),
  steps of 1 and 4 micro-batches: seconds per micro-batch and per optimizer step the compute
  terms and the Adam update leave out (DeepSpeed's hooks, the optimizer wrapper's master copies
  and gradient norm, Python).
- tp_allreduce[n]: one all-reduce of the block's activations over n processes as it runs in
  autograd (the executor's block with its TP group, minus the same block without it, per
  all-reduce), busbw and latency per latency step as planner/cost/comm.py counts them.
- parallel[precision]: the executor's engine on 2 processes (planner/profiler/engine.py
  measure_parallel), steps of 1 and 4 micro-batches, DP2 ZeRO-0 and PP2: what two ranks
  computing at once add per micro-batch and DeepSpeed's data-parallel step adds per step
  beyond the 1-process engine and the cost model's all-reduce (DP2); what the pipe schedule
  costs per micro-batch beyond the stage's compute, and the share of the fill / drain the
  step shows (PP2); what DP2 ZeRO-3 costs per micro-batch and per step beyond the cost
  model's ZeRO-3 terms. planner/cost/probes.py framework_overheads and planner/cost/estimate.py
  compose them.
- optimizer[precision]: the executor's optimizer step timed alone (planner/profiler/optimizer.py)
  at two sizes: seconds per parameter updated (param_s, the slope). It replaces the memory-bound
  ADAM_BYTES / copy-bandwidth update (planner/cost/estimate.py optimizer_time); the framework
  probe's per-step cost is measured net of it.

Absent (every built-in profile, and a measured one from before): the cost model uses its
GEMM curves and links alone. Pure stdlib: loaded with the profile.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from planner.errors import ProfileError

REGENERATE = "regenerate it with `planner profile --quick --out PATH` (planner/profiler)"


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockProbe:
    scale: float
    """Measured block time per second of the cost model's block compute."""
    overhead_s: float
    """Seconds per block forward + backward the compute terms do not cover."""
    points: int = 0
    gemm_scale: float | None = None
    """Per term class (None: `scale` for all three): measured block time = gemm_scale x GEMMs +
    core_scale x attention core + elementwise_scale x element-wise + overhead_s, fitted over
    the block points, whose sizes (hidden 128 and 512, sequences 64-256, micro-batch 1-16)
    separate the classes (element-wise work grows with h, GEMMs with h^2, the core with s)."""
    core_scale: float | None = None
    elementwise_scale: float | None = None

    def time(self, compute_s: float) -> float:
        return self.scale * compute_s + self.overhead_s

    @property
    def classes(self) -> tuple[float, float, float]:
        """(GEMM, core, element-wise) multipliers."""
        if self.gemm_scale is None:
            return self.scale, self.scale, self.scale
        return self.gemm_scale, self.core_scale, self.elementwise_scale


@dataclass(frozen=True, slots=True, kw_only=True)
class InStepLink:
    busbw_gbps: float
    latency_us: float
    points: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Framework:
    microbatch_s: float
    """Seconds per micro-batch the executor's engine spends beyond the cost model's compute terms."""
    step_s: float
    """Seconds per optimizer step beyond the memory-bound Adam update."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Parallel:
    """The executor's engine on 2 processes (planner/profiler/engine.py measure_parallel) beyond
    what the 1-process engine (Framework) and the cost model's terms account for."""
    microbatch_s: float
    """DP2: seconds per micro-batch the two ranks computing at once add (shared memory
    bandwidth and caches): plans of 2 or more processes without a pipeline."""
    dp_step_s: float
    """DP2: seconds per optimizer step beyond the 1-process engine's step and the cost model's
    gradient all-reduce (DeepSpeed's bucketing, flattening and the in-step all-reduce): plans
    with dp > 1 (ZeRO 0-2)."""
    pipe_microbatch_s: float
    """PP2: seconds per micro-batch per stage of DeepSpeed's pipe schedule beyond the stage's
    compute (sends, receives, the instruction loop, the engine's own per-micro-batch work):
    under a pipeline it replaces the framework's per-micro-batch cost and the point-to-point
    link of boundaries inside a node."""
    pipe_bubble: float
    """PP2: the share of the fill / drain time (pipeline.pipeline_time's bubble) that the step
    measures: (step with 1 micro-batch - the fixed step costs) / ((p - 1) x per micro-batch)."""
    zero3_microbatch_s: float = 0.0
    """DP2 ZeRO-3 (the profiled precision): seconds per micro-batch beyond the cost model's
    ZeRO-3 plan with the terms above (its module hooks' gathers and releases as they run):
    plans with ZeRO-3 over dp > 1. 0 where not measured."""
    zero3_step_s: float = 0.0
    """DP2 ZeRO-3: seconds per step beyond the same (its optimizer over partitions, its
    reductions). 0 where not measured."""
    zero2_fixed_s: float = 0.0
    zero2_param_s: float = 0.0
    """DP2 ZeRO-2 (the profiled precision; planner/profiler/engine.py measure_parallel adds a second
    model size): seconds per micro-batch beyond a step's first that ZeRO-2 costs beyond DP2
    ZeRO-0 and the cost model's terms = zero2_fixed_s + zero2_param_s x the stage's parameters.
    DeepSpeed's ZeRO-2 reduces every micro-batch's gradients (stage_1_and_2.py average_tensor:
    one dist.reduce per partition owner, bucket by bucket), where ZeRO 0/1 reduce once per step;
    on a CPU in line (its accelerator's streams are no-ops). 0 where not measured."""
    concurrency: float = 1.0
    """DP2 / one process, per micro-batch, same micro-batch and sequence: how much longer a rank's
    CPU-bound work takes while another rank computes beside it (the cores share execution units,
    caches and memory bandwidth). It stretches every CPU-bound term of a plan of 2 or more
    processes, as the oversubscription does (planner/cost/factors.py cluster_factors). 1 where
    not measured."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerProbe:
    """The executor's optimizer step (planner/profiler/optimizer.py): seconds per parameter it
    updates, in one precision (fp32: AdamW on the fp32 weights; bf16/fp16: the wrapper's
    gradient conversion, norm, AdamW on the fp32 master and the copy back)."""
    param_s: float
    points: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class StepProbes:
    block: Mapping[str, BlockProbe] = field(default_factory=dict)
    tp_allreduce: Mapping[int, InStepLink] = field(default_factory=dict)
    framework: Mapping[str, Framework] = field(default_factory=dict)
    parallel: Mapping[str, Parallel] = field(default_factory=dict)
    optimizer: Mapping[str, OptimizerProbe] = field(default_factory=dict)

    def block_for(self, precision: str) -> BlockProbe | None:
        return self.block.get(precision)

    def tp_link(self, n: int) -> InStepLink | None:
        """The in-step all-reduce of a group of n: measured at n, else at the largest measured
        size below n (None when nothing was measured)."""
        if n in self.tp_allreduce:
            return self.tp_allreduce[n]
        below = [k for k in self.tp_allreduce if k < n]
        return self.tp_allreduce[max(below)] if below else None

    @property
    def empty(self) -> bool:
        return not self.block and not self.tp_allreduce and not self.framework and not self.parallel \
            and not self.optimizer

    def to_dict(self) -> dict[str, Any]:
        return {"block": {p: {"scale": b.scale, "overhead_s": b.overhead_s, "points": b.points,
                              **({"gemm_scale": b.gemm_scale, "core_scale": b.core_scale,
                                  "elementwise_scale": b.elementwise_scale} if b.gemm_scale is not None else {})}
                          for p, b in self.block.items()},
                "tp_allreduce": {str(n): {"busbw_gbps": l.busbw_gbps, "latency_us": l.latency_us, "points": l.points}
                                 for n, l in self.tp_allreduce.items()},
                "framework": {p: {"microbatch_s": f.microbatch_s, "step_s": f.step_s} for p, f in self.framework.items()},
                "parallel": {p: {"microbatch_s": x.microbatch_s, "dp_step_s": x.dp_step_s,
                                 "pipe_microbatch_s": x.pipe_microbatch_s, "pipe_bubble": x.pipe_bubble,
                                 "zero3_microbatch_s": x.zero3_microbatch_s, "zero3_step_s": x.zero3_step_s,
                                 "zero2_fixed_s": x.zero2_fixed_s, "zero2_param_s": x.zero2_param_s,
                                 "concurrency": x.concurrency}
                             for p, x in self.parallel.items()},
                "optimizer": {p: {"param_s": o.param_s, "points": o.points} for p, o in self.optimizer.items()}}


def _number(v: Any, where: str, positive: bool = True) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (v <= 0 if positive else v < 0):
        raise ProfileError(where, f"must be a {'positive' if positive else 'non-negative'} number, got {v!r}",
                           REGENERATE)
    return float(v)


def step_from_dict(raw: Any, precisions: tuple[str, ...]) -> StepProbes:
    """Parse (and check) a profile's "step" section; None or absent = no probes."""
    if raw is None:
        return StepProbes()
    if not isinstance(raw, dict):
        raise ProfileError("step", "must be an object with 'block' and 'tp_allreduce'", REGENERATE)
    block = {}
    for prec, b in (raw.get("block") or {}).items():
        where = f"step.block.{prec}"
        if prec not in precisions:
            raise ProfileError(where, f"unknown precision (one of {', '.join(precisions)})", REGENERATE)
        if not isinstance(b, dict):
            raise ProfileError(where, "must be an object with scale and overhead_s", REGENERATE)
        cls = {k: _number(b[k], f"{where}.{k}", positive=False)
               for k in ("gemm_scale", "core_scale", "elementwise_scale") if k in b}
        if cls and len(cls) != 3:
            raise ProfileError(where, "gemm_scale, core_scale and elementwise_scale go together", REGENERATE)
        block[prec] = BlockProbe(scale=_number(b.get("scale"), f"{where}.scale"),
                                 overhead_s=_number(b.get("overhead_s"), f"{where}.overhead_s", positive=False),
                                 points=int(b.get("points", 0)), **cls)
    links = {}
    for n, l in (raw.get("tp_allreduce") or {}).items():
        where = f"step.tp_allreduce.{n}"
        if not str(n).isdigit() or int(n) < 2:
            raise ProfileError(where, "keys are group sizes (integers >= 2)", REGENERATE)
        if not isinstance(l, dict):
            raise ProfileError(where, "must be an object with busbw_gbps and latency_us", REGENERATE)
        links[int(n)] = InStepLink(busbw_gbps=_number(l.get("busbw_gbps"), f"{where}.busbw_gbps"),
                                   latency_us=_number(l.get("latency_us"), f"{where}.latency_us", positive=False),
                                   points=int(l.get("points", 0)))
    framework = {}
    for prec, f in (raw.get("framework") or {}).items():
        where = f"step.framework.{prec}"
        if prec not in precisions or not isinstance(f, dict):
            raise ProfileError(where, "must map a precision to microbatch_s and step_s", REGENERATE)
        framework[prec] = Framework(microbatch_s=_number(f.get("microbatch_s"), f"{where}.microbatch_s", positive=False),
                                    step_s=_number(f.get("step_s"), f"{where}.step_s", positive=False))
    parallel = {}
    for prec, x in (raw.get("parallel") or {}).items():
        where = f"step.parallel.{prec}"
        if prec not in precisions or not isinstance(x, dict):
            raise ProfileError(where, "must map a precision to microbatch_s, dp_step_s, pipe_microbatch_s and "
                               "pipe_bubble", REGENERATE)
        parallel[prec] = Parallel(**{k: _number(x.get(k), f"{where}.{k}", positive=False)
                                     for k in ("microbatch_s", "dp_step_s", "pipe_microbatch_s", "pipe_bubble")},
                                  **{k: _number(x.get(k, 0.0), f"{where}.{k}", positive=False)
                                     for k in ("zero3_microbatch_s", "zero3_step_s", "zero2_fixed_s",
                                               "zero2_param_s")},
                                  concurrency=_number(x.get("concurrency", 1.0), f"{where}.concurrency"))
    optimizer = {}
    for prec, o in (raw.get("optimizer") or {}).items():
        where = f"step.optimizer.{prec}"
        if prec not in precisions or not isinstance(o, dict):
            raise ProfileError(where, "must map a precision to param_s (seconds per parameter)", REGENERATE)
        optimizer[prec] = OptimizerProbe(param_s=_number(o.get("param_s"), f"{where}.param_s"),
                                         points=int(o.get("points", 0)))
    return StepProbes(block=block, tp_allreduce=links, framework=framework, parallel=parallel, optimizer=optimizer)
