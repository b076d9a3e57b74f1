"""`planner profile`: what to measure (quick or full), and running it with progress ticks."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from planner.errors import PlannerError
from planner.profiler import comm, gemm, layers
from planner.profiler.device import Target
from planner.profiler.stats import time_call
from planner.specs.model import ModelSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileOptions:
    model: ModelSpec
    """Model whose GEMM shapes and block are measured."""
    precision: str = "bf16"
    """Precision of the GEMM sweep (efficiency curve) and the block timings."""
    quick: bool = False
    """A pass of about a minute on a 2-core CPU: fewer shapes, points, sizes and repeats."""
    procs: int = 2
    """Processes for the collective benchmarks; group sizes 2, 4, ... up to procs."""
    max_tp: int = 2
    """Largest TP degree whose per-rank shapes are measured."""
    tokens: tuple[int, ...] = ()
    """Token counts (micro-batch x sequence) of the GEMM sweep; () = from the layer points."""
    points: tuple[tuple[int, int, int], ...] = ()
    """(micro-batch, sequence, TP) points of the block timings; () = defaults for the device."""
    comm_timeout_s: float = 900.0
    engine: bool = True
    block_models: tuple[ModelSpec, ...] = ()
    """Further models whose block is timed at the same points (micro-batch <= 4; TP where legal),
    in every block precision: the step probe's line then spans their sizes (CPU default:
    chatglm3-6b small beside tiny, the lab's two scales)."""
    """Time the executor's DeepSpeed engine on one process (CPU: the step probe's framework costs)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkList:
    """The work list, known up front so the progress bar has a total."""

    points: tuple[tuple[int, int, int], ...]
    shapes: tuple[gemm.GemmShape, ...]
    precisions: tuple[str, ...] = ("bf16",)
    """Precisions the model-shape sweep runs in: the profiled one, and fp32 (the conventional
    baseline's), so each has an efficiency curve over the shapes that matter."""
    squares: dict[str, list[int]] = field(default_factory=dict)
    groups: tuple[int, ...] = ()
    sizes: tuple[int, ...] = ()

    @property
    def total(self) -> int:
        ticks_comm = len(self.groups) * len(self.sizes) * len(comm.OPS)
        blocks = len(self.points) + sum(len(self.other_points(m)) for m in self.block_models)
        return blocks * len(self.block_precisions) + len(self.shapes) * len(self.precisions) \
            + sum(map(len, self.squares.values())) + 2 + ticks_comm

    block_models: tuple[ModelSpec, ...] = ()

    def other_points(self, model: ModelSpec) -> list[tuple[int, int, int]]:
        """The block points a further block model is timed at: micro-batch <= 4, its legal TP."""
        return [(b, s, t) for b, s, t in self.points if b <= 4 and t in gemm.legal_tp(model, t)]

    @property
    def block_precisions(self) -> tuple[str, ...]:
        """The block is timed in every precision of the sweep: the step probe's line per precision
        (planner/specs/step.py)."""
        return self.precisions


def default_points(target: Target, model: ModelSpec, quick: bool, max_tp: int) -> tuple[tuple[int, int, int], ...]:
    tps = gemm.legal_tp(model, max_tp)
    seq_cap = model.max_seq
    if target.kind == "gpu":
        mbs, seqs = ((1, 2), (2048,)) if quick else ((1, 2, 4), (1024, 2048, 4096))
    else:
        # up to 16 x 128 tokens: the line of the step probe reaches blocks of the small scale's size
        mbs, seqs = ((1, 4, 16), (128,)) if quick else ((1, 2, 4, 8, 16), (64, 128, 256))
    tps = tps[:2] if quick else tps
    return tuple((b, s, t) for t in tps for s in seqs if s <= seq_cap for b in mbs)


def make_plan(opts: ProfileOptions, target: Target) -> WorkList:
    points = opts.points or default_points(target, opts.model, opts.quick, opts.max_tp)
    tokens = opts.tokens or tuple(sorted({b * s for b, s, _ in points}))
    tps = sorted({t for _, _, t in points} | set(gemm.legal_tp(opts.model, opts.max_tp)))
    shapes = tuple(sh for t in tps for tok in tokens for sh in gemm.model_shapes(opts.model, tok, t))
    if target.kind == "gpu":
        big = [1024, 2048, 4096] if opts.quick else [1024, 2048, 4096, 8192, 16384]
    else:
        big = [256, 1024] if opts.quick else [256, 512, 1024, 2048]
    squares = {p: list(big) for p in ("bf16", "fp16", "fp32")}
    if target.kind == "cpu":
        squares["fp16"] = [256, 512]  # no native fp16 GEMM on most CPUs: a few GFLOP/s
    groups = tuple(comm.group_sizes(opts.procs))
    sizes = tuple(comm.message_sizes(opts.quick, target.kind))
    precisions = tuple(dict.fromkeys((opts.precision, "fp32")))
    return WorkList(points=points, shapes=shapes, precisions=precisions, squares=squares, groups=groups, sizes=sizes,
                    block_models=tuple(opts.block_models))


def cpu_threads(procs: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, procs))


def copy_bandwidth(target: Target, quick: bool) -> dict[str, Any]:
    """Memory bandwidth from a large tensor copy: bytes read + written per second (STREAM "copy")."""
    import torch
    nbytes = (64 << 20) if quick else (256 << 20) if target.kind == "cpu" else (2 << 30)
    src = torch.ones(nbytes // 4, device=target.device)
    dst = torch.empty_like(src)
    t = time_call(lambda: dst.copy_(src), sync=target.sync, warmup=2, repeats=5 if quick else 10)
    return {"bytes": nbytes, "time_s": t.to_dict(), "gbps": 2 * nbytes / t.median / 1e9,
            "gbps_max": 2 * nbytes / t.min / 1e9, "method": "torch copy_ of a float32 tensor; 2 x bytes per copy"}


def _loadavg() -> list[float] | None:
    """The host's 1, 5 and 15-minute load averages (None where the OS has none): a CPU profile
    measured while other processes ran is slower than the machine (docs/lab.md)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def measure_all(opts: ProfileOptions, target: Target, plan: WorkList,
                tick: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Run every measurement; returns the raw figures (planner.profiler.write turns them into a profile)."""
    import torch
    if target.kind == "cpu":
        # A CPU "device" is one of `procs` processes sharing the cores, as the executor runs its
        # ranks (OMP_NUM_THREADS = cores // world size): measure with that many threads.
        torch.set_num_threads(cpu_threads(opts.procs))
        # and under the executor's allocator (planner.profiler.device.EXECUTOR_MMAP_THRESHOLD):
        # every probe below -- GEMMs, blocks, the optimizer, the engine and collective processes --
        # pays the page faults the executor's ranks pay
        from planner.profiler.device import executor_allocator
        allocator = executor_allocator()
    started = time.perf_counter()
    load_before = _loadavg()
    window = 0.05 if opts.quick else 0.2
    out: dict[str, Any] = {"notes": []}
    if target.kind == "cpu":
        out["allocator"] = {"mmap_threshold": int(os.environ["MALLOC_MMAP_THRESHOLD_"]), "mallopt": allocator}
    results: list[gemm.GemmResult] = []
    for prec in plan.precisions:
        for sh in plan.shapes:
            results.append(gemm.measure(sh, prec, target, window_s=window))
            tick(f"GEMM {prec} {sh.name} tp={sh.tp} T={sh.tokens}")
    squares: list[gemm.GemmResult] = []
    for prec, sizes in plan.squares.items():
        squares += gemm.square_probe(prec, target, sizes, window_s=window, call_budget_s=0.5, tick=tick)
        for _ in range(len(sizes) - len([r for r in squares if r.precision == prec])):
            tick(f"GEMM {prec} (skipped: slow)")
    out["gemm"] = results
    out["gemm_square"] = squares
    out["copy"] = copy_bandwidth(target, opts.quick)
    tick("memory copy")
    pts = []
    for prec in plan.block_precisions:
        for b, s, t in plan.points:
            pts.append(layers.measure_point(opts.model, b, s, t, prec, target, repeats=3 if opts.quick else 7))
            tick(f"block {prec} b={b} s={s} tp={t}")
        for other in opts.block_models:
            for b, s, t in plan.other_points(other):
                pts.append(layers.measure_point(other, b, s, t, prec, target, repeats=3 if opts.quick else 7))
                tick(f"block {other.name} {prec} b={b} s={s} tp={t}")
    out["layers"] = pts
    out["engine"] = []
    if target.kind == "cpu" and opts.engine:
        from planner.profiler import engine
        # the largest block point of at most 4 sequences (TP 1): a micro-batch the lab's plans run
        b, s_ = max(((b, s) for b, s, t in plan.points if t == 1 and b <= 4), default=(1, plan.points[0][1]))
        try:
            out["engine"] = engine.measure(opts.model.to_dict(), b, s_, list(plan.block_precisions),
                                           cpu_threads(opts.procs))
        except PlannerError as exc:
            out["notes"].append(f"engine probe skipped: {exc.line()}")
        if opts.procs >= 2 and opts.model.layers >= 2:
            # DP2 and PP2 on two processes: the data-parallel step and the pipe schedule as they run
            try:
                # ZeRO-2's reduction at a second model size too (the further block model, micro-batch 1)
                other = opts.block_models[0].to_dict() if opts.block_models else None
                out["engine"] += engine.measure_parallel(opts.model.to_dict(), b, s_, list(plan.block_precisions),
                                                         cpu_threads(opts.procs), quick=opts.quick, other=other)
            except PlannerError as exc:
                out["notes"].append(f"parallel engine probe skipped: {exc.line()}")
    if target.kind == "cpu":
        from planner.profiler import optimizer
        out["optimizer"] = optimizer.measure(list(plan.block_precisions), cpu_threads(opts.procs), quick=opts.quick)
    tick("engine steps")
    backend = "nccl" if target.kind == "gpu" else "gloo"
    out["comm"] = {}
    if not plan.groups:
        out["notes"].append(f"collectives skipped: {opts.procs} process(es); a collective needs at least 2 "
                            "(run with --procs 2 or more)")
    block = {"model": opts.model.to_dict(), "precisions": list(plan.block_precisions),
             "points": sorted({(b, s) for b, s, _ in plan.points})} if target.kind == "cpu" else None
    for n in plan.groups:
        raw = comm.run_group(n, list(plan.sizes), backend=backend, repeats=3, window_s=window / 2,
                             timeout_s=opts.comm_timeout_s, tick=tick, block=block)
        out["comm"][str(n)] = comm.summarize_group(raw)
        if raw.get("teardown"):
            out["notes"].append(f"collectives on {n} processes: {raw['teardown']}")
    out["backend"] = backend
    out["wall_s"] = time.perf_counter() - started
    out["load"] = {"before": load_before, "after": _loadavg(), "cores": os.cpu_count()}
    return out
