"""Hugging Face config.json -> ModelSpec: read the file, pick the family's reader by model_type
(dense families: hf_dense.py; mixture-of-experts: hf_moe.py). Any problem is one SpecError
line naming the field and the fix; nothing here raises anything else for bad input.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping

from planner.errors import SpecError
from planner.specs.hf_dense import FAMILIES as DENSE_FAMILIES, _Config
from planner.specs.hf_moe import MOE_FAMILIES
from planner.specs.model import ModelSpec

FAMILIES: dict[str, Callable[[_Config, str, str], ModelSpec]] = {**DENSE_FAMILIES, **MOE_FAMILIES}
"""Every supported model_type: the dense families and the MoE ones."""

__all__ = ["FAMILIES", "load_hf_config", "spec_from_hf"]


def spec_from_hf(data: Any, name: str = "hf-model", where: str = "config.json") -> ModelSpec:
    """Build a ModelSpec from a parsed Hugging Face config dict."""
    if not isinstance(data, Mapping):
        raise SpecError(where, "must be a JSON object", "give a Hugging Face config.json")
    model_type = data.get("model_type")
    families = FAMILIES
    if model_type is None:
        raise SpecError(f"{where}: model_type", "missing", f"add one of {', '.join(families)}")
    if not isinstance(model_type, str) or model_type.lower() not in families:
        raise SpecError(f"{where}: model_type", f"unsupported type {model_type!r}",
                        f"use a config of type {', '.join(families)}")
    family = model_type.lower()
    return families[family](_Config(data, where), name, family)


def load_hf_config(path: str | Path) -> ModelSpec:
    """Read a config.json file (or a directory holding one) into a ModelSpec."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError("--model", f"{p} does not exist",
                        "give a preset name or the path of a Hugging Face config.json") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError("--model", f"cannot read {p}: {getattr(exc, 'strerror', None) or exc}",
                        "give a readable UTF-8 config.json") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(str(p), f"is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})",
                        "re-download or repair the config.json") from None
    except RecursionError:
        raise SpecError(str(p), "is nested too deeply to read", "give a Hugging Face config.json") from None
    name = p.parent.name if p.name == "config.json" and p.parent.name else p.stem
    raw_name = data.get("_name_or_path") if isinstance(data, dict) else None
    if isinstance(raw_name, str) and raw_name.strip():
        name = raw_name.strip().rstrip("/").split("/")[-1]
    return spec_from_hf(data, name=name, where=str(p))
