"""The techniques of the ladder, the Plan fields each one owns, and the rung a set of them makes.

A rung is the conventional baseline with some techniques switched to the chosen plan's
values. Every Plan field belongs to exactly one technique (tests/unit/test_ladder_units.py checks
it), except the accumulation, which follows: micro-batch x accumulation x DP = the global
batch. So two rungs differ by exactly the techniques between their sets.

    precision   fp32 -> the plan's precision (mixed precision)
    overlap     overlap_comm off, default buckets -> the plan's overlap_comm and bucket size
    batching    padded static batches -> packed (dynamic) batches (not a Plan field: the
                executor's --batching)
    zero        ZeRO-0 -> the plan's ZeRO stage with its variants (offload, ZeRO++, ZeRO-3 knobs)
    recompute   no recompute at the baseline's micro-batch -> the plan's activation
                checkpointing and the micro-batch it frees (checkpointed blocks counted in
                total; where they sit per stage is the layout's)
    layout      plain DP over every device -> the plan's DP x TP x PP, stage boundaries,
                sequence parallelism and schedule (and the user's global batch when the
                baseline had to round it up: planner.search.baseline.baseline_train)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from planner.errors import PlannerError, SpecError
from planner.specs.plan import DEFAULT_BUCKET, Plan
from planner.specs.knobs import KNOBS, TECHNIQUES as KNOB_TECHNIQUES, technique_fields

TECHNIQUES = KNOB_TECHNIQUES
"""The article's order: mixed precision, communication overlap and buckets, dynamic batching,
ZeRO, activation checkpointing, the parallel layout (communication first, then batching,
then checkpointing)."""

LABELS = {
    "precision": "mixed precision",
    "overlap": "communication overlap and buckets",
    "batching": "dynamic (packed) batching",
    "zero": "ZeRO stage",
    "recompute": "activation checkpointing + micro-batch",
    "layout": "parallel layout",
}

FIELDS: dict[str, tuple[str, ...]] = technique_fields()
"""Plan fields each technique sets (planner/specs/knobs.py); grad_accum is derived (global
batch / (dp x micro-batch))."""

DERIVED = tuple(name for name, knob in KNOBS.items() if knob.technique is None)
"""Fields no technique sets: grad_accum follows from the others; runtime is the ladder's own
(every rung runs on DeepSpeed, the runtime the executor measures)."""

_OFF = Plan()  # the defaults of every field the baseline does not set


@dataclass(frozen=True, slots=True)
class Rung:
    """One rung's decisions: the plan, the batching mode and the global batch it trains, or
    why it is not a legal plan."""
    applied: frozenset[str]
    plan: Plan | None
    batching: str
    global_batch: int
    illegal: str = ""

    def same(self, other: "Rung") -> bool:
        """The same decisions (whatever techniques were asked for)."""
        return (self.plan, self.batching, self.global_batch, self.illegal) == \
            (other.plan, other.batching, other.global_batch, other.illegal)


def parse_order(text: str | None) -> tuple[str, ...]:
    """--order "zero,precision,...": known techniques, each once; the ones left out follow
    in the article's order (so the ladder still ends at the plan)."""
    if text is None or not text.strip():
        return TECHNIQUES
    names = [t.strip() for t in text.split(",") if t.strip()]
    for t in names:
        if t not in TECHNIQUES:
            raise SpecError("--order", f"unknown technique {t!r}", f"use a comma-separated list of {', '.join(TECHNIQUES)}")
    seen = set()
    for t in names:
        if t in seen:
            raise SpecError("--order", f"technique {t!r} is named twice", "name each technique at most once")
        seen.add(t)
    return tuple(names) + tuple(t for t in TECHNIQUES if t not in seen)


def view(plan: Plan, batching: str, technique: str, layers: int) -> tuple:
    """What `technique` decides in a rung: its fields (recompute: the mode, the number of
    checkpointed blocks and the micro-batch)."""
    if technique == "batching":
        return (batching,)
    if technique == "recompute":
        return (plan.recompute, sum(plan.checkpointed_per_stage(layers)), plan.micro_batch)
    return tuple(getattr(plan, f) for f in FIELDS[technique])


def differing(a: Rung, b: Rung, layers: int) -> set[str]:
    """The techniques whose decisions differ between two legal rungs."""
    assert a.plan is not None and b.plan is not None
    return {t for t in TECHNIQUES if view(a.plan, a.batching, t, layers) != view(b.plan, b.batching, t, layers)}


def compose(target: Plan, base: Plan, applied: frozenset[str], *, world: int, base_batch: int,
            user_batch: int) -> Rung:
    """The rung with `applied` techniques switched to `target`'s decisions, the rest the
    baseline's (`base`: fp32, plain DP over `world` devices, ZeRO-0, no recompute, its
    micro-batch; overlap_comm off and default buckets; padded static batches). An illegal
    combination comes back with `illegal` saying why (Plan's own rules)."""
    kw: dict = {}
    kw["precision"] = target.precision if "precision" in applied else "fp32"
    if "overlap" in applied:
        kw.update(overlap_comm=target.overlap_comm, bucket_elements=target.bucket_elements)
    else:
        kw.update(overlap_comm=False, bucket_elements=DEFAULT_BUCKET)
    for f in FIELDS["zero"]:
        kw[f] = getattr(target if "zero" in applied else _OFF, f)
    layout = "layout" in applied
    for f in FIELDS["layout"]:
        kw[f] = getattr(target if layout else _OFF, f)
    if not layout:
        kw["dp"] = world
        if len(target.stage_layers) == 1:  # one stage of every layer is plain DP's layout, written out
            kw["stage_layers"] = target.stage_layers
    if "recompute" in applied:
        kw["recompute"], kw["micro_batch"] = target.recompute, target.micro_batch
        rl = target.recompute_layers
        kw["recompute_layers"] = rl if (layout or not rl) else (sum(rl),)
    else:
        kw["recompute"], kw["recompute_layers"], kw["micro_batch"] = "none", (), base.micro_batch
    gb = user_batch if layout else base_batch
    batching = "dynamic" if "batching" in applied else "static"
    dp, mb = kw["dp"], kw["micro_batch"]
    if gb % (dp * mb):
        why = f"micro-batch {mb} x DP {dp} does not divide the global batch {gb}"
        if not layout:
            why += f" (plain DP over {world} devices: {gb / dp:g} sequences per rank)"
        return Rung(frozenset(applied), None, batching, gb, why)
    kw["grad_accum"] = gb // (dp * mb)
    try:
        plan = Plan(**kw)
    except PlannerError as exc:
        return Rung(frozenset(applied), None, batching, gb, exc.line())
    return Rung(frozenset(applied), plan, batching, gb)


def inert(technique: str, plan: Plan) -> str:
    """Why switching `technique` on changes nothing DeepSpeed does in this rung ("" if it may)."""
    if technique == "overlap" and plan.zero == 0:
        return ("DeepSpeed ignores overlap_comm and the bucket sizes under ZeRO-0: it all-reduces the gradients "
                "after backward in flat buffers of 5e8 elements (runtime/engine.py allreduce_gradients)")
    if technique == "overlap" and plan.dp == 1:
        return "one data-parallel rank: there is no gradient reduction to overlap"
    return ""


def replace_train_precision(train, plan: Plan):
    """The TrainSpec a rung is costed with: its global batch and the rung's precision."""
    return dataclasses.replace(train, precision=plan.precision)
