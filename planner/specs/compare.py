"""A model variant beside its base (docs/variants.md): (figure, base, variant, variant / base)
rows of two estimates of one plan, and the "variant_comparison" object of estimate --json,
estimate.json and serve_plan.json. `planner estimate` / `serve` print the rows as a table."""
from __future__ import annotations

from typing import Any

from planner.specs.model import ModelSpec

Row = tuple[str, str, str, str]


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _ratio(base: float | None, var: float | None) -> str:
    return "-" if not base or var is None else f"{var / base:.2f}x"


def comparison_rows(figures: list[tuple[str, Any, Any, str]]) -> list[Row]:
    """(figure, base value, variant value, format spec) -> formatted rows with the ratio."""
    return [(k, _fmt(a, f), _fmt(b, f), _ratio(a, b)) for k, a, b, f in figures]


def _states(est: Any) -> float:
    m = est.stage_memory[est.peak_stage]
    return m.params + m.grads + m.optimizer


def training_comparison(base_model: ModelSpec, base: Any, model: ModelSpec, est: Any) -> list[Row]:
    """(figure, base, variant, variant / base) rows of two training estimates of one plan."""
    gb = 1e9
    return comparison_rows([
        ("parameters", base_model.params, model.params, ",.0f"),
        ("step time s", base.step_time_s, est.step_time_s, ".4f"),
        ("tokens/s", base.tokens_per_s, est.tokens_per_s, ",.0f"),
        ("model TFLOPs per step", base.model_flops_per_step / 1e12, est.model_flops_per_step / 1e12, ",.2f"),
        ("peak memory GB", base.peak_memory_gb, est.peak_memory_gb, ".3f"),
        ("model states GB (peak stage)", _states(base) / gb, _states(est) / gb, ".3f"),
        ("activations GB (peak stage)", base.stage_memory[base.peak_stage].activations / gb,
         est.stage_memory[est.peak_stage].activations / gb, ".3f")])


def comparison_doc(model: ModelSpec, rows: list[Row], **extra: Any) -> dict[str, Any]:
    """The "variant_comparison" object of estimate --json, estimate.json and serve_plan.json:
    the base and variant names, `extra` fields, and the (figure, base, variant, ratio) rows."""
    return {"base": model.base().name, "variant": model.name, **extra,
            "rows": [dict(zip(("figure", "base", "variant", "ratio"), r)) for r in rows]}
