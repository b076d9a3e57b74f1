"""Trace files: the (prompt, output) token lengths of real requests, replayed by the simulation.

One request per line, `prompt_tokens,output_tokens` (a comma, tab or spaces between them);
blank lines and lines starting with # are skipped; a first line naming the columns (any text
that is not two numbers, e.g. `prompt,output`) is a header. A JSON file holds a list of
[prompt, output] pairs or of objects with prompt_tokens/output_tokens (or input_len/output_len,
as vLLM's benchmark dumps name them). Anything else is one line naming the file, the line and
the fix (SpecError: exit 2).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from planner.errors import SpecError

FIX = "write one 'prompt_tokens,output_tokens' pair of positive integers per line"
KEYS = (("prompt_tokens", "output_tokens"), ("input_len", "output_len"), ("prompt", "output"))
MAX_ROWS = 1_000_000


def _pair(values: list[Any], where: str) -> tuple[int, int]:
    if len(values) != 2:
        raise SpecError("--trace", f"{where}: expected 2 numbers, got {len(values)}", FIX)
    out = []
    for v in values:
        try:
            n = int(v) if not isinstance(v, bool) else -1
            if isinstance(v, float) and v != n or isinstance(v, str) and not re.fullmatch(r"\s*\d+\s*", v):
                raise ValueError
        except (TypeError, ValueError):
            raise SpecError("--trace", f"{where}: {v!r} is not a whole number of tokens", FIX) from None
        if n < 1:
            raise SpecError("--trace", f"{where}: token counts must be >= 1, got {v!r}", FIX)
        out.append(n)
    return out[0], out[1]


def _from_json(data: Any, path: str) -> list[tuple[int, int]]:
    if not isinstance(data, list):
        raise SpecError("--trace", f"{path}: a JSON trace must be a list of pairs", FIX)
    rows = []
    for k, item in enumerate(data, 1):
        where = f"{path} item {k}"
        if isinstance(item, dict):
            keys = next((p for p in KEYS if p[0] in item and p[1] in item), None)
            if keys is None:
                raise SpecError("--trace", f"{where}: needs prompt_tokens and output_tokens", FIX)
            rows.append(_pair([item[keys[0]], item[keys[1]]], where))
        elif isinstance(item, list):
            rows.append(_pair(item, where))
        else:
            raise SpecError("--trace", f"{where}: {item!r} is not a pair", FIX)
    return rows


def read_trace(path: str | Path) -> tuple[tuple[int, int], ...]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError("--trace", f"cannot read {p} ({exc.__class__.__name__})", "give a readable text file") from None
    if text.lstrip().startswith("["):
        try:
            rows = _from_json(json.loads(text), str(p))
        except json.JSONDecodeError as exc:
            raise SpecError("--trace", f"{p}: not valid JSON (line {exc.lineno})", FIX) from None
    else:
        rows = []
        for k, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = [x for x in re.split(r"[,\t ]+", line) if x]
            if not rows and k == next(i for i, ln in enumerate(text.splitlines(), 1) if ln.strip()
                                      and not ln.strip().startswith("#")) \
                    and not all(re.fullmatch(r"-?\d+(\.\d*)?", x) for x in parts):
                continue  # a header line
            rows.append(_pair(parts, f"{p} line {k}"))
    if not rows:
        raise SpecError("--trace", f"{p} holds no requests", FIX)
    if len(rows) > MAX_ROWS:
        raise SpecError("--trace", f"{p} holds {len(rows)} requests, more than {MAX_ROWS}", "sample the trace")
    return tuple(rows)
